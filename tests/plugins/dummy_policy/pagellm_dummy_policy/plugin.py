"""Scheduling-policy plugin (plugin API 1.1), naming its class vLLM's way: a dotted path."""

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.1"


@hookimpl
def pagellm_scheduler_policies() -> dict[str, str]:
    return {"shortest_prompt_first": "pagellm_dummy_policy.policy.ShortestPromptFirst"}
