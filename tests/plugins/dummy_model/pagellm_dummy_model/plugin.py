"""General plugin: registers an out-of-tree architecture (in every process that loads plugins)."""

from pagellm.models.registry import register_model
from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


@hookimpl
def pagellm_register() -> None:
    register_model("DummyLlamaForCausalLM", "pagellm_dummy_model.model:DummyLlamaForCausalLM")
