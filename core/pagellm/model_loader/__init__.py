from pagellm.model_loader.loader import load_model
from pagellm.model_loader.source import default_model_path

__all__ = ["default_model_path", "load_model"]
