"""A launched step's results on their way back: the sampled ids stay on the device (the next
step's inputs read them there) while one copy of them, and of their logprobs when asked, travels
to the host (`Platform.copy_to_host`). `StepInFlight.finish` waits for that copy, writes the
tokens into the persistent batch and builds the step's `ModelRunnerOutput`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.layers.sampler import LogprobTensors
from pagellm.platforms.interface import HostCopy
from pagellm.scheduler.output import ModelRunnerOutput, SampleLogprobs
from pagellm.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class StepInFlight:
    step_id: int
    req_ids: list[str]
    """The step's requests, in its row order."""
    sample_pos: np.ndarray
    """Indices into ``req_ids`` of the requests that sampled, in the sampled ids' order."""
    sample_rows: np.ndarray
    """Their batch rows when the step was launched."""
    positions: np.ndarray
    """Where each sampled token goes among its request's token ids."""
    batch_version: int
    """`InputBatch.version` at launch: while it holds, ``sample_rows`` are still the rows."""
    sampled: torch.Tensor | None = None
    """[len(sample_pos)] int64 on the device; None when no request sampled."""
    host_copy: HostCopy | None = None
    """On their way to the host: the sampled ids, the sample logprob tensors (when asked), then
    the prompt logprob tensors of each request in ``prompt_logprob_ids``."""
    num_logprobs: np.ndarray | None = None
    """Per sampling request: how many top logprobs it asked for (-1: none); None: nobody did."""
    prompt_logprob_ids: list[str] = field(default_factory=list)
    pooled: bool = False
    """A pooling step: ``host_copy`` holds one [len(req_ids), hidden] float32 tensor of pooled
    vectors, and nothing was sampled."""

    def finish(
        self,
        batch: InputBatch,
        requests: Mapping[str, CachedRequestState],
        max_model_len: int,
    ) -> ModelRunnerOutput:
        """Wait for the host copy, store the tokens, and report them per request."""
        if self.pooled:
            vectors = self.host_copy.wait()[0].numpy() if self.host_copy is not None else None
            return ModelRunnerOutput(
                req_ids=self.req_ids,
                sampled_token_ids=[[] for _ in self.req_ids],
                pooled=[] if vectors is None else [vector.tobytes() for vector in vectors],
            )
        tokens: list[int] = []
        logprobs: list[SampleLogprobs] | None = None
        host = self.host_copy.wait() if self.host_copy is not None else []
        if self.sampled is not None:
            tokens = host[0].tolist()
            self._store(host[0].numpy(), batch, requests, max_model_len)
            host = host[1:]
            if self.num_logprobs is not None:
                logprobs, host = LogprobTensors(*host[:3]).to_list(), host[3:]
        prompt_logprobs = {
            req_id: LogprobTensors(*host[3 * k : 3 * k + 3]).to_list()
            for k, req_id in enumerate(self.prompt_logprob_ids)
        }
        return self._output(tokens, logprobs, prompt_logprobs or None)

    def _store(
        self,
        tokens: np.ndarray,
        batch: InputBatch,
        requests: Mapping[str, CachedRequestState],
        max_model_len: int,
    ) -> None:
        """The tokens into their rows (which the next step's inputs only read on the device);
        a request preempted since keeps it in its saved output, a finished one drops it."""
        fits = self.positions < max_model_len
        if batch.version == self.batch_version:
            batch.token_ids[self.sample_rows[fits], self.positions[fits]] = tokens[fits]
            return
        index_of = batch.req_id_to_index
        columns = (self.sample_pos, self.positions, tokens, fits)
        for k, pos, token, ok in zip(*(c.tolist() for c in columns), strict=True):
            req_id = self.req_ids[k]
            row = index_of.get(req_id)
            if row is not None:
                if ok:
                    batch.token_ids[row, pos] = token
                continue
            state = requests.get(req_id)
            if state is not None:  # preempted after the launch: its saved output ends here
                index = pos - len(state.prompt_token_ids)
                if index < len(state.output_token_ids):
                    state.output_token_ids[index] = token

    def _output(
        self,
        tokens: list[int],
        logprobs: list[SampleLogprobs] | None,
        prompt_logprobs: dict[str, list[SampleLogprobs]] | None,
    ) -> ModelRunnerOutput:
        """Per scheduled request: its sampled token (none for a prefill chunk) and logprobs."""
        num_rows = len(self.req_ids)
        sample_pos = self.sample_pos.tolist()
        if len(sample_pos) == num_rows:
            sampled = [[token] for token in tokens]
        else:
            sampled = [[] for _ in range(num_rows)]
            for pos, token in zip(sample_pos, tokens, strict=True):
                sampled[pos] = [token]
        row_logprobs: list[SampleLogprobs | None] = [None] * num_rows
        if logprobs is not None and self.num_logprobs is not None:
            for pos, lp, k in zip(sample_pos, logprobs, self.num_logprobs.tolist(), strict=True):
                if k >= 0:  # the sampled token, then the row's own top k
                    lp.token_ids, lp.logprobs = lp.token_ids[: k + 1], lp.logprobs[: k + 1]
                    row_logprobs[pos] = lp
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=sampled,
            logprobs=row_logprobs if any(lp is not None for lp in row_logprobs) else None,
            prompt_logprobs=prompt_logprobs,
        )
