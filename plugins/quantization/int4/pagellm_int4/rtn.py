"""Round-to-nearest int4 quantization of a float Hugging Face checkpoint, written as a GPTQ, AWQ
(GEMM) or compressed-tensors pack-quantized checkpoint that pagellm (and the formats' other
readers) loads: so tests and benchmarks need no external quantizer.

Each linear weight of the decoder layers (2-D ``model.layers.*.weight`` tensors other than norms)
is quantized per output row and group of ``group_size`` input columns: symmetric, ``scale =
max|w| / 7.5`` and zero 8; asymmetric, ``scale = (max - min) / 15`` over a range that includes 0
and ``zero = round(-min / scale)``; then ``q = clamp(round(w / scale) + zero, 0, 15)`` against
the scale as stored (float16). Embeddings, norms and the LM head stay as they are.

There is no calibration, so GPTQ's ``desc_act`` cannot order columns by activation statistics:
``--desc-act`` writes a fixed pseudo-random column order per layer input (the same for layers
that share their input, as real act-order checkpoints have), so that readers' act-order path is
exercised; it does not improve accuracy.

    python -m pagellm_int4.rtn SRC DST --format gptq|awq|compressed-tensors [--group-size 128]
        [--asym] [--desc-act] [--gptq-v2] [--device cuda] [--random-weights]

``--random-weights`` takes a directory with only a config.json (e.g. benchmarks/configs/
llama-3.1-8b) and quantizes random weights of its shapes: an 8B-shaped int4 checkpoint without
writing the 16 GB bf16 one first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagellm_int4.checkpoint_tensors import SYMMETRIC_ZERO, write_layer
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.scheme import Int4Format, Int4Scheme

SCALE_DTYPE = torch.float16
FORMATS: tuple[Int4Format, ...] = ("gptq", "awq", "compressed-tensors")


def act_order(name: str, in_features: int) -> torch.Tensor:
    """The column order ``--desc-act`` writes for the layer whose weight is ``name``: one per
    parent module and input width, so q/k/v (and gate/up) share theirs."""
    parent = name.rsplit(".", 2)[0]
    seed = zlib.crc32(f"{parent}:{in_features}".encode())
    return torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))


def quantize_rtn(
    weight: torch.Tensor,
    group_size: int,
    sym: bool,
    order: torch.Tensor | None = None,
    min_zero: int = 0,
) -> Int4Values:
    """``weight`` [N, K] float -> 4-bit values. ``order``: the columns in quantization order
    (groups are consecutive in it), None for the natural one; ``min_zero``: the smallest zero
    point the target format stores (1 for GPTQ v1)."""
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"group_size {group_size} does not divide the weight's {k} input columns.")
    w = weight.float() if order is None else weight.float()[:, order]
    tiles = w.reshape(n, k // group, group)
    if sym:
        scales = tiles.abs().amax(-1) / 7.5
        zeros = torch.full_like(scales, SYMMETRIC_ZERO)
    else:
        low = tiles.amin(-1).clamp(max=0.0)
        high = tiles.amax(-1).clamp(min=0.0)
        scales = (high - low) / 15.0
    scales = torch.where(scales == 0, torch.ones_like(scales), scales).to(SCALE_DTYPE).float()
    if not sym:
        zeros = torch.round(-low / scales).clamp(min_zero, 15)
    q = torch.round(tiles / scales[..., None]) + zeros[..., None]
    q = q.clamp(0, 15).reshape(n, k).to(torch.uint8)
    g_idx = torch.arange(k, device=weight.device) // group
    if order is not None:
        # Back to the checkpoint's column order; g_idx records each column's group.
        inverse = torch.argsort(order)
        q, g_idx = q[:, inverse], g_idx[inverse]
    return Int4Values(
        q=q.t().contiguous(),
        zeros=zeros.t().to(torch.uint8).contiguous(),
        scales=scales.t().contiguous(),
        g_idx=g_idx,
    )


def quantization_config(scheme: Int4Scheme) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for ``scheme``, as each format writes it."""
    if scheme.format == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": scheme.group_size,
            "desc_act": scheme.desc_act,
            "sym": scheme.sym,
            "static_groups": False,
            "true_sequential": True,
            "lm_head": False,
            "checkpoint_format": "gptq" if scheme.gptq_v1 else "gptq_v2",
        }
    if scheme.format == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": scheme.group_size,
            "zero_point": not scheme.sym,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": scheme.sym,
        "strategy": "channel" if scheme.group_size == -1 else "group",
        "group_size": None if scheme.group_size == -1 else scheme.group_size,
        "actorder": "group" if scheme.desc_act else None,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and "norm" not in name
    )


def random_float_weights(
    config_dir: Path, device: str, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model ``config_dir/config.json`` describes, drawn at random (normal
    with the config's ``initializer_range``; norms 1) in bfloat16: for benchmarks at a real
    model's shapes without its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    for name, shape in shapes.items():
        if "norm" in name:
            yield name, torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            values = torch.randn(shape, generator=generator, device=device) * std
            yield name, values.to(torch.bfloat16)


def write_checkpoint(
    source: Path,
    target: Path,
    scheme: Int4Scheme,
    device: str = "cpu",
    random_weights: bool = False,
) -> Path:
    """Quantize the float checkpoint in ``source`` into ``target`` (safetensors, config.json,
    and the tokenizer and generation files copied), computing on ``device`` (``cuda`` is much
    faster for an 8B model). ``random_weights``: ``source`` holds only a config.json, whose
    model's weights are drawn at random (`random_float_weights`)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from pagellm.model_loader.loader import iterate_safetensors_weights

    if scheme.format == "awq" and scheme.desc_act:
        raise ValueError("AWQ has no act-order (desc_act): its columns are in natural order.")
    target.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    weights = (
        random_float_weights(source, device)
        if random_weights
        else iterate_safetensors_weights(str(source))
    )
    for name, tensor in tqdm(weights, desc="int4 RTN tensors"):
        if not _is_quantized(name, tensor):
            out[name] = tensor.cpu().contiguous()
            continue
        layer = name.removesuffix(".weight")
        order = act_order(name, tensor.shape[1]) if scheme.desc_act else None
        min_zero = 1 if scheme.format == "gptq" and scheme.gptq_v1 else 0
        if order is not None:
            order = order.to(device)
        values = quantize_rtn(tensor.to(device), scheme.group_size, scheme.sym, order, min_zero)
        for local, packed in write_layer(scheme, values, SCALE_DTYPE).items():
            out[f"{layer}.{local}"] = packed.cpu().contiguous()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        # Tokenizer and generation files; not the float checkpoint's config or shard index.
        copied = path.suffix in (".json", ".txt", ".model") and path.name != "config.json"
        if path.is_file() and copied and not path.name.endswith(".index.json"):
            shutil.copy(path, target / path.name)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="float HF checkpoint directory")
    parser.add_argument("target", type=Path, help="where to write the int4 checkpoint")
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--group-size", type=int, default=128, help="-1: one group per row")
    parser.add_argument("--asym", action="store_true", help="zero points (AWQ's default)")
    parser.add_argument("--desc-act", action="store_true", help="GPTQ/compressed-tensors act-order")
    parser.add_argument("--gptq-v2", action="store_true", help="checkpoint_format gptq_v2")
    parser.add_argument("--device", default="cpu", help="where to quantize (e.g. cuda)")
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="SOURCE holds only config.json: quantize random weights of its shapes (benchmarks)",
    )
    args = parser.parse_args(argv)
    scheme = Int4Scheme(
        args.format,
        args.group_size,
        sym=not args.asym,
        desc_act=args.desc_act,
        gptq_v1=not args.gptq_v2,
    )
    path = write_checkpoint(args.source, args.target, scheme, args.device, args.random_weights)
    print(f"wrote {scheme.format} int4 checkpoint (group size {scheme.group_size}) to {path}")


if __name__ == "__main__":
    main()
