"""Building the model and filling its weights: HF safetensors, GGUF (through its plugin), or random
(dummy)."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from pagellm.attention import AttentionBackend
from pagellm.config import EngineConfig
from pagellm.distributed import get_tp_group
from pagellm.layers.input_producer import InputProducer
from pagellm.layers.linear import CheckpointTensor, Linear
from pagellm.model_loader.formats import get_model_format
from pagellm.model_loader.kv_scales import KVScales, apply_kv_scales, take_kv_scales
from pagellm.model_loader.source import resolve_model_source
from pagellm.models.registry import resolve_model_cls
from pagellm.quantization.registry import quantization_methods

logger = logging.getLogger(__name__)


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's shards: those named by model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"Checkpoint shards named in {index} are missing: {missing}.")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"No *.safetensors weights found in {directory}.")
    return files


def iterate_safetensors_weights(
    directory: str, lazy: bool = False
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Tensors in their stored dtype: copying into a parameter casts to its dtype, and a
    quantized checkpoint's float8 weights and float32 scales must reach theirs unrounded. With
    ``lazy``, slices not read yet, so that a tensor-parallel rank reads only its part."""
    from safetensors import safe_open

    for path in safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def _init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Uniform random weights drawn where they live, by one seeded generator per device: the
    same weights on every run on the same kind of device (a GPU draws an 8B model's in a
    fraction of a second, where the host would take half a minute)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.lower().endswith("norm.weight"):  # RMSNorm's, LayerNorm's
            param.data.fill_(1.0)
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        values = torch.empty(param.shape, dtype=torch.float32, device=device)
        param.data.copy_(values.uniform_(-0.05, 0.05, generator=generators[device]))


def load_model(
    config: EngineConfig, backend: type[AttentionBackend], device: torch.device
) -> nn.Module:
    model_cfg = config.model
    _, model_cls = resolve_model_cls([model_cfg.architecture])
    quant_config = None
    tp = get_tp_group().world_size
    if config.quantization is not None:
        checkpoint_quant = dict(getattr(model_cfg.hf_config, "quantization_config", None) or {})
        quant_cls = quantization_methods.get(config.quantization)
        refusal = quant_cls.tensor_parallel_refusal(tp, checkpoint_quant) if tp > 1 else None
        if refusal is not None:
            raise ValueError(refusal)
        quant_config = quant_cls.from_config(checkpoint_quant)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_cfg.torch_dtype)
    try:
        with torch.device(device):
            model = model_cls(config=config, attn_backend=backend, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)

    load_format = config.load.load_format
    kv_scales: KVScales = {}
    if load_format == "dummy":
        _init_dummy_weights(model, model_cfg.seed)
        apply_kv_scales(model, kv_scales, config.cache.cache_dtype)
        return _after_loading(model)
    source = resolve_model_source(model_cfg.model)
    if load_format == "auto":
        load_format = "gguf" if source.gguf_file else "safetensors"
    weights: Iterator[tuple[str, CheckpointTensor]]
    if load_format == "gguf":
        if not source.gguf_file:
            raise ValueError(f"load_format='gguf' but {model_cfg.model} is not a GGUF file.")
        gguf = get_model_format("gguf")  # pagellm-gguf's reader (lazy slices, like safetensors')
        weights = gguf.iterate_weights(source.gguf_file, model_cfg.torch_dtype, quant_config)
    else:
        weights = iterate_safetensors_weights(source.directory, lazy=tp > 1)
    with torch.no_grad():
        loaded = model.load_weights(take_kv_scales(weights, kv_scales))  # type: ignore[operator]
    apply_kv_scales(model, kv_scales, config.cache.cache_dtype)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(
            f"The checkpoint at {model_cfg.model} lacks weights for: {sorted(missing)[:8]}."
        )
    return _after_loading(model)


def _after_loading(model: nn.Module) -> nn.Module:
    """Let each linear method convert its freshly loaded weights (e.g. repack for a kernel), then
    pair each layer producing a linear layer's input with that method's input quantizer."""
    modules = list(model.modules())
    for module in modules:
        if isinstance(module, Linear):
            module.linear_method.process_weights_after_loading(module)
    for module in modules:
        if isinstance(module, InputProducer):
            module.bind_input_quantizer()
    return model.eval()
