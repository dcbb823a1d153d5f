"""Turning logits into next tokens, batched over requests with different parameters.

Order: raw logprobs snapshot (when asked), float32, temperature, top-k/top-p, then greedy rows
take the argmax and random rows sample with the exponential-race trick (argmax of p / q with
q ~ Exp(1)), drawing q from the request's own generator when it has a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.scheduler.output import SampleLogprobs


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor
    """[N] float32; 0 for greedy rows."""
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    """[N] float32, or None when no row uses top-p."""
    top_k: torch.Tensor | None
    """[N] int64 (vocab size = off), or None when no row uses top-k."""
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator (seeded requests only)."""
    default_generator: torch.Generator
    max_num_logprobs: int | None
    """The largest ``logprobs`` asked for in the batch, or None when no row wants them."""


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[N] int64."""
    logprobs: list[SampleLogprobs] | None


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k and nucleus; at least one token survives."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None

        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            sampled = greedy
        else:
            temp = torch.where(metadata.temperature > 0, metadata.temperature, 1.0)
            scaled = apply_top_k_top_p(logits / temp.unsqueeze(1), metadata.top_k, metadata.top_p)
            probs = scaled.softmax(dim=-1)
            q = torch.empty_like(probs)
            q.exponential_(generator=metadata.default_generator)
            for row, gen in metadata.generators.items():
                q[row].exponential_(generator=gen)
            random = probs.div(q).argmax(dim=-1)
            sampled = (
                random
                if metadata.all_random
                else torch.where(metadata.temperature > 0, random, greedy)
            )

        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs or 0)
        return SamplerOutput(sampled, logprobs)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, k: int) -> list[SampleLogprobs]:
        token_lp = raw.gather(1, sampled.unsqueeze(1))
        ranks = (raw > token_lp).sum(dim=-1) + 1
        top_lp, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], sampled[:, None][:, :0])
        ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1).tolist()
        lps = torch.cat([token_lp, top_lp], dim=1).tolist()
        return [SampleLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks.tolist(), strict=True)]
