"""Test plugin: engine steps raise while they run a *poisoned* request.

A request is poisoned when its prompt holds the token ``PAGELLM_FAULT_TOKEN``; with
``PAGELLM_FAULT_AFTER=k`` only once it has generated k tokens (a fault in the middle of a
generation). The step raises after the runner has updated its persistent batch, as a real fault in
input preparation or sampling would. Loaded as a general plugin, so it acts in the engine-core
process; does nothing unless ``PAGELLM_FAULT_TOKEN`` is set. `install` does the same in-process.

``PAGELLM_SLOW_TOKEN`` and ``PAGELLM_SLOW_STEP_S`` make a step that runs a request whose prompt
holds that token take that many seconds more (one long step, as a huge prefill on a CPU).
"""

from __future__ import annotations

import os
import time
from typing import Any

from pagellm.plugins import hookimpl

pagellm_plugin_api = "1.0"


class InjectedFault(RuntimeError):
    pass


def install(
    token: int | None, after: int = 0, slow_token: int | None = None, slow_s: float = 0
) -> None:
    from pagellm.worker.model_runner import ModelRunner

    original = ModelRunner._prepare_inputs
    if getattr(original, "_fault_injection", False):
        original = original.__wrapped__  # type: ignore[attr-defined]

    def prepare_inputs(self: Any, plan: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.input_batch
        for row in plan.rows.tolist():
            state = self.requests[batch.req_ids[row]]
            generated = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            if token in state.prompt_token_ids and generated >= after:
                raise InjectedFault(f"injected fault for request {state.req_id}")
            if slow_token in state.prompt_token_ids and generated == 0:
                time.sleep(slow_s)
        return original(self, plan, *args, **kwargs)

    prepare_inputs._fault_injection = True  # type: ignore[attr-defined]
    prepare_inputs.__wrapped__ = original  # type: ignore[attr-defined]
    ModelRunner._prepare_inputs = prepare_inputs  # type: ignore[method-assign]


def uninstall() -> None:
    from pagellm.worker.model_runner import ModelRunner

    current = ModelRunner._prepare_inputs
    if getattr(current, "_fault_injection", False):
        ModelRunner._prepare_inputs = current.__wrapped__  # type: ignore[attr-defined,method-assign]


@hookimpl
def pagellm_register() -> None:
    token = os.environ.get("PAGELLM_FAULT_TOKEN")
    if token:
        slow = os.environ.get("PAGELLM_SLOW_TOKEN")
        install(
            int(token),
            int(os.environ.get("PAGELLM_FAULT_AFTER", "0")),
            int(slow) if slow else None,
            float(os.environ.get("PAGELLM_SLOW_STEP_S", "0")),
        )
