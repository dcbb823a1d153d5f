"""The engine-core side of test_plugins' process-boundary test (importable by a spawned process)."""

from __future__ import annotations

from typing import Any


def run_engine_core(config: Any, queue: Any) -> None:
    from pagellm.engine.core import EngineCore
    from pagellm.platforms import current_platform
    from pagellm.plugins.loader import loaded_records
    from pagellm.request import EngineCoreRequest
    from pagellm.sampling_params import SamplingParams

    core = EngineCore(config)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", [5, 6, 7], params, eos_token_id=None, arrival_time=0.0))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
    queue.put((tokens, current_platform.name, sorted(loaded_records())))
