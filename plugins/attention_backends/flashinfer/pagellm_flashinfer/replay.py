"""The prefill wrapper's kernel call, recorded at a step's first layer and replayed at the others.

FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper.run`` checks its arguments and builds the
kernel's argument list (about fifty of them: the plan's buffers and scalars, the query, the
layer's K and V pages, the output) in Python, then calls its compiled module's ``paged_run``.
Within one step every layer runs the same plan, so everything but the query, the layer's pages
and the output is the same: measured on an H100, that Python is 0.17 ms a layer of host time
(W2's prompt steps, whose host work outlasts the GPU's, docs/benchmarks.md). So the first
layer's ``run`` goes through FlashInfer with the module's ``paged_run`` recorded, and the other
layers call ``paged_run`` with the recorded arguments, the four tensors swapped.

It only replays what it found: exactly one ``paged_run`` call in the first ``run``, with the
query, the K and V pages and the output each at one position (by identity). Anything else (a
FlashInfer whose ``run`` works otherwise, a module without ``paged_run``), and every layer goes
through ``run`` as before, once logged. The first replay in a process is checked against
``run`` on the same tensors, bit for bit (`PAGELLM_FLASHINFER_REPLAY=0` turns replays off).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPLAY_ENV = "PAGELLM_FLASHINFER_REPLAY"


class _Recorder:
    """Stands in for the wrapper's module during one ``run``: records ``paged_run``'s
    arguments, passes every call through."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[tuple[Any, ...]] = []

    def paged_run(self, *args: Any) -> Any:
        self.calls.append(args)
        return self._module.paged_run(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _State:
    """Per process: replays on (the environment), the first replay checked, why off."""

    enabled = os.environ.get(REPLAY_ENV, "1") != "0"
    checked = False
    reason_logged = False


def _give_up(reason: str) -> None:
    if not _State.reason_logged:
        logger.info("FLASHINFER: each layer calls the prefill wrapper's run (%s)", reason)
        _State.reason_logged = True


class PrefillRun:
    """A planned prefill wrapper's ``run`` for one step's layers (made again at each plan)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self._args: list[Any] | None = None
        self._slots: tuple[int, int, int, int] | None = None
        self._paged_run: Any = None
        self._recorded = not _State.enabled

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        if self._slots is not None and not _capturing(q):
            return self._replay(q, k_cache, v_cache, out)
        if self._recorded:
            self.wrapper.run(q, (k_cache, v_cache), out=out)
            return out
        self._recorded = True
        module = getattr(self.wrapper, "_cached_module", None)
        if module is None or not hasattr(module, "paged_run"):
            _give_up("its module has no paged_run")
            self.wrapper.run(q, (k_cache, v_cache), out=out)
            return out
        recorder = _Recorder(module)
        self.wrapper._cached_module = recorder
        try:
            self.wrapper.run(q, (k_cache, v_cache), out=out)
        finally:
            self.wrapper._cached_module = module
        if len(recorder.calls) != 1:
            _give_up(f"its run called paged_run {len(recorder.calls)} times")
            return out
        args = list(recorder.calls[0])
        slots = [[i for i, a in enumerate(args) if a is t] for t in (q, k_cache, v_cache, out)]
        if any(len(found) != 1 for found in slots):
            _give_up("the query, pages and output are not each one of paged_run's arguments")
            return out
        self._args = args
        self._slots = (slots[0][0], slots[1][0], slots[2][0], slots[3][0])
        self._paged_run = module.paged_run
        return out

    def _replay(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        assert self._args is not None and self._slots is not None
        args = list(self._args)
        iq, ik, iv, io = self._slots
        args[iq], args[ik], args[iv], args[io] = q, k_cache, v_cache, out
        self._paged_run(*args)
        if not _State.checked:
            self._check(q, k_cache, v_cache, out)
        return out

    def _check(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
    ) -> None:
        """The first replay of the process against FlashInfer's own run, bit for bit."""
        _State.checked = True
        expected = torch.empty_like(out)
        self.wrapper.run(q, (k_cache, v_cache), out=expected)
        if not torch.equal(expected, out):
            _State.enabled = False
            self._slots = None
            self._recorded = True
            logger.warning(
                "FLASHINFER: the replayed prefill call differs from the wrapper's run; every "
                "layer calls run from now on"
            )
            out.copy_(expected)


def _capturing(q: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream (the first replay's check would
    synchronize): such calls go through ``run``."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()
