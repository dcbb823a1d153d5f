"""The pooler a sentence-transformers checkpoint declares: ``modules.json`` lists its modules (the
transformer, then a Pooling module whose ``config.json`` names the pooling mode, then optionally
Normalize), read once when the engine config is resolved."""

from __future__ import annotations

import json
import os
from typing import Any

from pagellm.config import ConfigError, PoolerConfig, PoolingType

_MODULE = "sentence_transformers.models."
# sentence-transformers' pooling modes (the config's flags, or its newer "pooling_mode") → ours.
_MODES: dict[str, PoolingType] = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}
_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pooling_mode(config: dict[str, Any], path: str) -> PoolingType:
    mode = config.get("pooling_mode")
    modes = [mode] if isinstance(mode, str) else [m for f, m in _FLAGS.items() if config.get(f)]
    if len(modes) != 1 or modes[0] not in _MODES:
        raise ConfigError(
            f"{path} asks for pooling {modes or 'none'}; pagellm pools with one of "
            f"{sorted(_MODES)} (sentence-transformers' mean, cls, lasttoken)."
        )
    return _MODES[modes[0]]


def read_pooler_config(directory: str | None, default: PoolingType) -> PoolerConfig:
    """The checkpoint's pooler when ``directory`` holds a sentence-transformers ``modules.json``;
    else ``default`` pooling (the model class's) with normalization, as vLLM does for embedding
    models. Modules pagellm does not run (Dense, ...) are refused rather than skipped."""
    modules_path = os.path.join(directory, "modules.json") if directory else ""
    if not modules_path or not os.path.isfile(modules_path):
        return PoolerConfig(pooling_type=default, normalize=True)
    pooling_type: PoolingType | None = None
    normalize = False
    for module in _read_json(modules_path):
        kind = str(module.get("type", "")).removeprefix(_MODULE)
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            path = os.path.join(directory or "", module.get("path", ""), "config.json")
            pooling_type = _pooling_mode(_read_json(path), path)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ConfigError(
                f"{modules_path} lists a sentence-transformers module {module.get('type')!r} "
                "that pagellm does not run (it runs Transformer, Pooling and Normalize)."
            )
    return PoolerConfig(pooling_type=pooling_type or default, normalize=normalize)
