"""Weight files other than HF safetensors (GGUF), read by plugins of ``pagellm.model_formats``.

The core only recognises such a file by its name (``source.py``) and dispatches on
``load_format``; the format's plugin reads it: config and tokenizer, weights, and which
quantization method keeps its weights as stored on this platform.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch

from pagellm.plugins.groups import MODEL_FORMAT
from pagellm.plugins.loader import load_group
from pagellm.plugins.registry import NotRegisteredError, Registry

if TYPE_CHECKING:
    from pagellm.layers.linear import CheckpointTensor
    from pagellm.quantization.base import QuantizationConfig

# The package that reads each format the core recognises, named in the error when it is absent.
FORMAT_PACKAGES = {"gguf": "pagellm-gguf"}


class ModelFormat(ABC):
    """How one weight-file format is read; registered under its ``load_format`` name."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def hf_directory(cls, path: str) -> str:
        """A directory with the config.json and tokenizer files of the model in file ``path``."""

    @classmethod
    @abstractmethod
    def iterate_weights(
        cls, path: str, dtype: torch.dtype, quant_config: QuantizationConfig | None
    ) -> Iterator[tuple[str, CheckpointTensor]]:
        """The file's tensors under HF names: float tensors in ``dtype``, except those
        ``quant_config`` (when it is the format's own method) keeps as stored. Each may be a
        lazy slice (`pagellm.layers.linear.TensorSlice`), read when indexed: a tensor-parallel
        layer then reads only its rank's part."""

    @classmethod
    def default_quantization(cls, path: str, device_type: str, dtype: torch.dtype) -> str | None:
        """The quantization method that runs the file's weights as stored on ``device_type``
        when none is asked for, or None to load them as float weights."""
        return None


model_formats: Registry[ModelFormat] = Registry("Model format", ModelFormat, MODEL_FORMAT, True)


def get_model_format(name: str) -> type[ModelFormat]:
    """The installed reader of format ``name``; ValueError naming the package when it is absent."""
    try:
        return model_formats.get(name)
    except NotRegisteredError:
        package = FORMAT_PACKAGES.get(name, f"a plugin of {MODEL_FORMAT}")
        for record in load_group(MODEL_FORMAT):  # installed, but not loaded (e.g. VLLM_PLUGINS)
            if record.name == name and record.status != "loaded":
                raise ValueError(
                    f"{name.upper()} files are read by the {record.name!r} plugin of "
                    f"{record.distribution}, which is {record.status}: {record.reason}."
                ) from None
        raise ValueError(
            f"{name.upper()} files are read by the {package} package, which is not installed: "
            f"pip install {package} (in this repository: pip install -e plugins/quantization/{name})."
        ) from None
