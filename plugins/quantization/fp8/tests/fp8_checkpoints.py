"""Tiny random Llama checkpoints for the fp8 tests: the float one, and fp8 ones written by
compressed-tensors (an independent writer of its format) or by hand in the Fp8Config format
(what vLLM and transformers' fp8 checkpoints hold: float8 weights, float32 ``weight_scale`` or
``weight_scale_inv``, optional ``input_scale``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# Every dimension a multiple of 128, so the 128x128 block scheme applies to each layer.
TINY_FP8_LLAMA = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FP8_MAX = 448.0


def tiny_llama(directory: Path, tokenizer_dir: str, **overrides: object) -> Path:
    """The tiny Llama of ``TINY_FP8_LLAMA`` changed by ``overrides``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_FP8_LLAMA, **overrides})).float()
    # A random model's next-token distributions are nearly flat, so fp8's few percent of noise
    # would flip its argmax more often than a trained model's. Large embeddings against small
    # layer weights give it a trained model's confident top-1 while every layer still shifts
    # the logits (the greedy continuations differ from the embeddings' alone).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 1.0 if "embed_tokens" in name else 0.03)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return directory


def _copy_tokenizer(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens")):
            (target / name).write_bytes((source / name).read_bytes())


def _write_config(source: Path, target: Path, quantization_config: dict) -> None:
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=1))


def input_amax(source: Path) -> dict[str, float]:
    """Each Linear's largest input magnitude over a calibration prompt (static activation scales)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    amax: dict[str, float] = {}

    def hook(name: str):
        def record(_module, args, _out):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_hook(hook(name))
    with torch.no_grad():
        model(torch.arange(3, 67).reshape(1, -1))
    return amax


def fp8_config_checkpoint(source: Path, target: Path, block: bool) -> Path:
    """The Fp8Config format, by hand: per-tensor weights with static activations, or 128x128
    blocks (``weight_scale_inv``) with dynamic activations."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    amax = input_amax(source) if not block else {}
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        layer = name.removesuffix(".weight")
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            out[name] = w
            continue
        if block:
            n, k = w.shape
            blocks = w.reshape(n // 128, 128, k // 128, 128)
            scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
            expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[name] = (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[f"{layer}.weight_scale_inv"] = scale.float()
        else:
            scale = w.abs().amax() / FP8_MAX
            out[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[f"{layer}.weight_scale"] = scale.float().reshape(())
            out[f"{layer}.input_scale"] = torch.tensor(amax[layer] / FP8_MAX, dtype=torch.float32)
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static"}
    if block:
        quant["weight_block_size"] = [128, 128]
    _copy_tokenizer(source, target)
    _write_config(source, target, quant)
    save_file(out, str(target / "model.safetensors"))
    return target


def compressed_tensors_checkpoint(source: Path, target: Path, preset: str) -> Path:
    """A compressed-tensors float-quantized checkpoint of preset FP8, FP8_DYNAMIC or FP8_BLOCK:
    compressed-tensors attaches the scheme, computes nothing itself (llm-compressor's observers
    would), so the weight scales are set here from the weights (min-max, as its observers do) and
    static activation scales from a calibration pass; it then compresses and writes the config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    amax = input_amax(source) if preset == "FP8" else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.data
        strategy = scheme.weights.strategy
        if strategy == "tensor":
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        elif strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            blocks = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, _ = calculate_qparams(low, high, scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if preset == "FP8":
            module.input_scale.data.fill_(amax[name] / FP8_MAX)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))
    _copy_tokenizer(source, target)
    return target
