from pagellm.model_loader.loader import load_model
from pagellm.model_loader.source import (
    ModelSource,
    default_model_path,
    load_hf_config,
    resolve_model_source,
)

__all__ = [
    "ModelSource",
    "default_model_path",
    "load_hf_config",
    "load_model",
    "resolve_model_source",
]
