"""Which runner serves a model (generate, or pooling for an embedding model), and what the pooling
runner makes of the other engine arguments: resolved by `EngineArgs.create_engine_config`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from torch import nn

from pagellm.config import ConfigError, PoolerConfig, Runner
from pagellm.model_loader.sentence_transformers import read_pooler_config

if TYPE_CHECKING:
    from pagellm.engine.args import EngineArgs
    from pagellm.model_loader.source import ModelSource

logger = logging.getLogger(__name__)

_RUNNER_OF_TASK: dict[str, Runner] = {"generate": "generate", "embed": "pooling"}


def resolve_runner(args: EngineArgs, architecture: str, supported: tuple[Runner, ...]) -> Runner:
    """The runner asked for (``runner``, or vLLM's ``task``), else the model's default (the
    first it ``supported``); one the model cannot run is refused, and so are the arguments the
    pooling runner cannot honour (`check_pooling_args`)."""
    runner, task = args.runner, args.task
    from_task = _RUNNER_OF_TASK.get(task)
    if from_task and runner not in ("auto", from_task):
        raise ConfigError(
            f"task={task!r} (--task) asks for runner {from_task!r} but runner={runner!r} "
            "(--runner); pass only one of them."
        )
    asked = from_task or (None if runner == "auto" else runner)
    if asked is None:
        asked = supported[0]
    elif asked not in supported:
        what = {"generate": "generate text", "pooling": "pool (embed)"}.get(asked, asked)
        raise ConfigError(
            f"runner={asked!r}: {architecture} cannot {what}; it supports runner "
            f"{', '.join(repr(r) for r in supported)}."
        )
    if asked == "pooling":
        check_pooling_args(args)
    return cast(Runner, asked)


def pooler_config(
    runner: Runner, source: ModelSource, model_cls: type[nn.Module]
) -> PoolerConfig | None:
    """The pooling runner's pooler: the checkpoint's sentence-transformers one, else the model
    class's ``default_pooling_type`` (last token for a decoder) with normalization."""
    if runner != "pooling":
        return None
    directory = None if source.gguf_file else source.directory
    return read_pooler_config(directory, getattr(model_cls, "default_pooling_type", "LAST"))


def check_pooling_args(args: EngineArgs) -> None:
    """What the pooling runner cannot honour (refused) and what it turns off (logged): each
    prompt is computed whole, in one step, since an encoder's tokens see the tokens after them,
    so neither a prefill chunk nor a cached prefix can be computed alone."""
    if args.long_prefill_token_threshold:
        raise ConfigError(
            f"long_prefill_token_threshold={args.long_prefill_token_threshold} "
            "(--long-prefill-token-threshold): a pooling model computes each prompt in one step; "
            "leave it at 0."
        )
    off = [
        name
        for name, on in (
            ("chunked prefill", args.enable_chunked_prefill),
            ("prefix caching", args.enable_prefix_caching),
        )
        if on
    ]
    if off:
        logger.info("Pooling runner: %s off (each prompt is computed whole)", " and ".join(off))
