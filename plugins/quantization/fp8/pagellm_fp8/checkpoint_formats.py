"""Reading a checkpoint's ``quantization_config`` into an `Fp8Scheme`: the Fp8Config format
(``quant_method: fp8``) and compressed-tensors' float-quantized fp8 schemes. Anything else fp8-like
is refused with what was found."""

from __future__ import annotations

from typing import Any

from pagellm_fp8.scheme import BLOCK, ActivationGranularity, Fp8Scheme, WeightGranularity

FP8_CONFIG = "fp8"
COMPRESSED_TENSORS = "compressed-tensors"

# compressed-tensors (weights strategy, input activations strategy, dynamic) -> our scheme's parts
_CT_SCHEMES: dict[tuple[str, str, bool], tuple[WeightGranularity, ActivationGranularity]] = {
    ("tensor", "tensor", False): ("tensor", "tensor"),  # FP8: static activation scales
    ("tensor", "tensor", True): ("tensor", "tensor"),
    ("channel", "token", True): ("channel", "token"),  # FP8_DYNAMIC
    ("block", "group", True): ("block", "group"),  # FP8_BLOCK
}


class Fp8FormatError(ValueError):
    """A checkpoint's quantization_config that pagellm-fp8 cannot run, and why."""


def parse_fp8_config(config: dict[str, Any]) -> Fp8Scheme:
    """The Fp8Config format: ``activation_scheme`` static|dynamic, optional ``weight_block_size``."""
    activation = config.get("activation_scheme", "dynamic")
    if activation not in ("static", "dynamic"):
        raise Fp8FormatError(
            f"Fp8Config activation_scheme {activation!r} is not supported (static or dynamic)."
        )
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Fp8FormatError(f"Fp8Config fmt {fmt!r} is not supported (float8 e4m3 only).")
    ignored = tuple(config.get("ignored_layers") or config.get("modules_to_not_convert") or ())
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Scheme(
            "tensor",
            "tensor",
            static_activations=activation == "static",
            serialized=True,
            ignored=ignored,
        )
    if list(block) != list(BLOCK):
        raise Fp8FormatError(
            f"Fp8Config weight_block_size {list(block)} is not supported (only {list(BLOCK)})."
        )
    if activation == "static":
        raise Fp8FormatError(
            "Fp8Config block-scaled weights with static activations are not supported."
        )
    return Fp8Scheme(
        "block", "group", serialized=True, scale_name="weight_scale_inv", ignored=ignored
    )


def _float8_args(args: Any, what: str) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise Fp8FormatError(f"compressed-tensors scheme without {what} is not supported.")
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise Fp8FormatError(
            f"compressed-tensors {what} of type {args.get('type')!r} with {args.get('num_bits')} "
            "bits is not an fp8 scheme."
        )
    if not args.get("symmetric", True):
        raise Fp8FormatError(f"compressed-tensors asymmetric fp8 {what} are not supported.")
    return args


def parse_compressed_tensors(config: dict[str, Any]) -> Fp8Scheme:
    """One float-quantized fp8 scheme for every targeted Linear (FP8, FP8_DYNAMIC, FP8_BLOCK)."""
    fmt = config.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise Fp8FormatError(f"compressed-tensors format {fmt!r} is not an fp8 format.")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise Fp8FormatError(
            f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (one)."
        )
    group = groups[0]
    weights = _float8_args(group.get("weights"), "weights")
    acts = _float8_args(group.get("input_activations"), "input activations")
    key = (str(weights.get("strategy")), str(acts.get("strategy")), bool(acts.get("dynamic")))
    if key not in _CT_SCHEMES:
        raise Fp8FormatError(
            f"compressed-tensors fp8 scheme with {key[0]} weight scales and "
            f"{'dynamic' if key[2] else 'static'} {key[1]} activation scales is not supported "
            "(supported: FP8, FP8_DYNAMIC, FP8_BLOCK)."
        )
    if key[0] == "block" and list(weights.get("block_structure") or []) != list(BLOCK):
        raise Fp8FormatError(
            f"compressed-tensors block_structure {weights.get('block_structure')} is not "
            f"supported (only {list(BLOCK)})."
        )
    if key[1] == "group" and acts.get("group_size") != BLOCK[1]:
        raise Fp8FormatError(
            f"compressed-tensors activation group_size {acts.get('group_size')} is not supported "
            f"(only {BLOCK[1]})."
        )
    weight_granularity, act_granularity = _CT_SCHEMES[key]
    return Fp8Scheme(
        weight_granularity,
        act_granularity,
        static_activations=not key[2],
        serialized=True,
        ignored=tuple(config.get("ignore") or ()),
    )


def parse_checkpoint(config: dict[str, Any]) -> Fp8Scheme:
    method = config.get("quant_method")
    if method == FP8_CONFIG:
        return parse_fp8_config(config)
    if method == COMPRESSED_TENSORS:
        return parse_compressed_tensors(config)
    raise Fp8FormatError(f"quant_method {method!r} is not an fp8 checkpoint format.")


def checkpoint_weights(config: dict[str, Any]) -> WeightGranularity | None:
    """The weight granularity of an fp8 checkpoint in a format we read, for detection; None for
    any other checkpoint (it may be another plugin's). A malformed fp8 config still matches, so
    that loading it reports what is wrong."""
    method = config.get("quant_method")
    if method == FP8_CONFIG:
        return "block" if config.get("weight_block_size") else "tensor"
    if method != COMPRESSED_TENSORS:
        return None
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if (
            isinstance(weights, dict)
            and weights.get("type") == "float"
            and weights.get("num_bits") == 8
        ):
            strategy = weights.get("strategy")
            if strategy in ("tensor", "channel", "block"):
                return strategy
    return None
