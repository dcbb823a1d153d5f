"""Reading a checkpoint's ``quantization_config`` into an `Int4Scheme`: GPTQ (``quant_method:
gptq``), AutoAWQ's GEMM format (``quant_method: awq``) and compressed-tensors' ``pack-quantized``
int4 weight-only schemes (W4A16, W4A16_ASYM). Anything else is refused with what was found."""

from __future__ import annotations

from typing import Any

from pagellm_int4.scheme import BITS, Int4Format, Int4Scheme

GPTQ = "gptq"
AWQ = "awq"
COMPRESSED_TENSORS = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"


class Int4FormatError(ValueError):
    """A checkpoint's quantization_config that pagellm-int4 cannot run, and why."""


def _bits(value: Any, what: str) -> None:
    if value != BITS:
        raise Int4FormatError(
            f"{what} with {value} bits is not supported (pagellm-int4 reads 4-bit weights only)."
        )


def _group_size(value: Any, what: str) -> int:
    if value is None:
        return -1
    if not isinstance(value, int) or (value <= 0 and value != -1):
        raise Int4FormatError(f"{what} group_size {value!r} is not supported (-1 or > 0).")
    return value


def parse_gptq(config: dict[str, Any]) -> Int4Scheme:
    _bits(config.get("bits"), "GPTQ")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise Int4FormatError(
            f"GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2; marlin and "
            "bitblas repackings are not read)."
        )
    pack_dtype = str(config.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise Int4FormatError(f"GPTQ pack_dtype {pack_dtype!r} is not supported (int32 only).")
    if config.get("lm_head"):
        raise Int4FormatError("GPTQ checkpoints with a quantized lm_head are not supported.")
    if config.get("dynamic"):
        raise Int4FormatError("GPTQ per-module `dynamic` overrides are not supported.")
    return Int4Scheme(
        "gptq",
        _group_size(config.get("group_size"), "GPTQ"),
        sym=bool(config.get("sym", True)),
        desc_act=bool(config.get("desc_act", False)),
        gptq_v1=fmt == "gptq",
        ignored=tuple(config.get("modules_to_not_convert") or ()),
    )


def parse_awq(config: dict[str, Any]) -> Int4Scheme:
    _bits(config.get("bits", config.get("w_bit")), "AWQ")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise Int4FormatError(
            f"AWQ version {version!r} is not supported (gemm only: its packed layout is the one "
            "pagellm-int4 reads)."
        )
    return Int4Scheme(
        "awq",
        _group_size(config.get("group_size", config.get("q_group_size")), "AWQ"),
        sym=not config.get("zero_point", True),
        ignored=tuple(config.get("modules_to_not_convert") or ()),
    )


def _ct_groups(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for g in (config.get("config_groups") or {}).values() if isinstance(g, dict)]


def parse_compressed_tensors(config: dict[str, Any]) -> Int4Scheme:
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise Int4FormatError(
            f"compressed-tensors quantization_status {status!r} is not supported: only "
            "compressed checkpoints hold packed weights."
        )
    if config.get("sparsity_config"):
        raise Int4FormatError("compressed-tensors sparsity_config is not supported.")
    groups = _ct_groups(config)
    if len(groups) != 1:
        raise Int4FormatError(
            f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (one)."
        )
    group = groups[0]
    fmt = group.get("format") or config.get("format")
    if fmt != PACK_QUANTIZED:
        raise Int4FormatError(
            f"compressed-tensors format {fmt!r} is not an int4 format pagellm-int4 reads "
            f"({PACK_QUANTIZED} only)."
        )
    if group.get("input_activations"):
        raise Int4FormatError(
            "compressed-tensors schemes that quantize activations are not supported (W4A16 only)."
        )
    weights = group.get("weights")
    if not isinstance(weights, dict) or weights.get("type") != "int":
        raise Int4FormatError("compressed-tensors pack-quantized scheme without int weights.")
    _bits(weights.get("num_bits"), "compressed-tensors pack-quantized")
    strategy = weights.get("strategy")
    if strategy == "group":
        group_size = _group_size(weights.get("group_size"), "compressed-tensors")
    elif strategy == "channel":
        group_size = -1
    else:
        raise Int4FormatError(
            f"compressed-tensors weight strategy {strategy!r} is not supported (group or channel)."
        )
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise Int4FormatError(f"compressed-tensors actorder {actorder!r} is not supported.")
    if weights.get("dynamic"):
        raise Int4FormatError("compressed-tensors dynamic weight quantization is not supported.")
    return Int4Scheme(
        "compressed-tensors",
        group_size,
        sym=bool(weights.get("symmetric", True)),
        # "weight" and "static" reorder at quantization time; only "group" stores weight_g_idx.
        desc_act=actorder == "group",
        ignored=tuple(config.get("ignore") or ()),
    )


def checkpoint_format(config: dict[str, Any]) -> Int4Format | None:
    """The int4 format a ``quantization_config`` is in, for detection; None for any other
    checkpoint (it may be another plugin's). A malformed config of one of these formats still
    matches, so that loading it reports what is wrong."""
    method = config.get("quant_method")
    if method == GPTQ:
        return "gptq"
    if method == AWQ:
        return "awq"
    if method == COMPRESSED_TENSORS:
        for group in _ct_groups(config):
            weights = group.get("weights")
            fmt = group.get("format") or config.get("format")
            if fmt == PACK_QUANTIZED and isinstance(weights, dict) and weights.get("type") == "int":
                return "compressed-tensors"
    return None


def parse_checkpoint(config: dict[str, Any]) -> Int4Scheme:
    fmt = checkpoint_format(config)
    if fmt == "gptq":
        return parse_gptq(config)
    if fmt == "awq":
        return parse_awq(config)
    if fmt == "compressed-tensors":
        return parse_compressed_tensors(config)
    raise Int4FormatError(
        f"quant_method {config.get('quant_method')!r} ({config.get('format', 'no format')}) is "
        "not an int4 checkpoint format pagellm-int4 reads (gptq, awq, compressed-tensors "
        "pack-quantized)."
    )
