"""`RequestOutputCollector`: where one request's outputs wait for their consumer (an HTTP stream).

One slot rather than a queue: when the consumer falls behind the engine, the DELTA outputs that
pile up are merged into one, so a busy front end sends fewer, larger chunks instead of falling
further behind.
"""

from __future__ import annotations

import asyncio

from pagellm.outputs import AnyRequestOutput, RequestOutput
from pagellm.sampling_params import RequestOutputKind


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append ``new`` (a DELTA output of the same request) to ``into``, completion by index."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if old.logprobs is not None and c.logprobs is not None:
            old.logprobs.extend(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens


class RequestOutputCollector:
    """The outputs of one request not yet taken by its consumer: at most one, merged.

    DELTA outputs are merged (texts and token ids appended); for the other kinds the newer output
    supersedes the older. An error is handed out after the output that came before it. A
    waiting consumer is woken through one future (put for every token of a stream: lighter
    than an ``asyncio.Event``).
    """

    __slots__ = ("delta", "output", "error", "waiter")

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.delta = output_kind == RequestOutputKind.DELTA
        self.output: AnyRequestOutput | None = None
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    def put(self, output: AnyRequestOutput) -> None:
        if self.output is None or not self.delta:
            self.output = output
        elif isinstance(self.output, RequestOutput) and isinstance(output, RequestOutput):
            merge_delta(self.output, output)
        self._wake()

    def put_error(self, error: Exception) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def wait(self) -> asyncio.Future[None] | None:
        """None when an output or the error waits to be taken (`take`); else a future done when
        one does (a future, not a coroutine: one frame less per streamed token)."""
        if self.output is not None or self.error is not None:
            return None
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter  # a cancelled wait leaves a done future, which `_wake` skips

    def take(self) -> AnyRequestOutput | Exception:
        """The pending output, else the error (it stays: every later call returns it)."""
        output = self.output
        if output is None:
            if self.error is None:
                raise RuntimeError("take() with nothing to take: wait() first")
            return self.error
        self.output = None
        return output
