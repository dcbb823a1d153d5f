"""The model's recommended sampling defaults (``--generation-config``), as vLLM applies them since
0.8: the sampling values its ``generation_config.json`` sets become the defaults of requests that
leave them unset.

Six keys are read, those vLLM reads: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (which becomes ``max_tokens``). The OpenAI
endpoints use them for a request's unset fields (``max_tokens`` caps the default output
length, never a request's own), and `LLM.generate` / `LLM.chat` for calls without sampling
parameters; an explicit `SamplingParams` is taken as it is. ``--generation-config vllm``
ignores the file (every default is the API's own), a directory reads its
``generation_config.json`` instead of the model's, and ``--override-generation-config`` sets
any of the six over both.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pagellm.config import ConfigError
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
FILE_NAME = "generation_config.json"


def _read(directory: str, required: bool) -> dict[str, Any]:
    path = os.path.join(directory, FILE_NAME)
    if not os.path.isfile(path):
        if required:
            raise ConfigError(
                f"generation_config={directory!r} (--generation-config): no {FILE_NAME} there."
            )
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a JSON object.")
    return data


def resolve_default_sampling(
    setting: str, override: dict[str, Any] | None, model_directory: str
) -> dict[str, Any]:
    """The sampling defaults (`SamplingParams` field names) for ``--generation-config setting``
    (``auto``: the file in ``model_directory``, if any; ``vllm``: none; else a directory whose
    file must exist) with ``override`` set over them. Values that `SamplingParams` refuses are a
    `ConfigError` naming where they came from."""
    if setting == "vllm":
        found: dict[str, Any] = {}
        source = "none"
    else:
        directory = model_directory if setting == "auto" else setting
        found = _read(directory, required=setting != "auto")
        source = os.path.join(directory, FILE_NAME)
    unknown = sorted(set(override or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ConfigError(
            f"override_generation_config keys {unknown} are not sampling defaults "
            f"(--override-generation-config takes {list(SAMPLING_KEYS)})."
        )
    merged = {**found, **(override or {})}
    values = {key: merged[key] for key in SAMPLING_KEYS if merged.get(key) is not None}
    if "max_new_tokens" in values:
        values["max_tokens"] = values.pop("max_new_tokens")
    try:
        SamplingParams(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"The sampling defaults from {source} and --override-generation-config {values} "
            f"are not valid sampling parameters: {exc}"
        ) from None
    if values:
        logger.info(
            "Default sampling parameters from the model's generation config (%s): %s; requests "
            "that set none of these get them (--generation-config vllm: the API's own defaults).",
            source if found else "--override-generation-config",
            values,
        )
    return values
