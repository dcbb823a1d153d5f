"""Turning logits into next tokens, batched over requests with different parameters.

Order: raw logprobs snapshot (when asked); float32; allowed-token and banned-token masks (bad
words, stop tokens before ``min_tokens``); logit bias; repetition, frequency and presence penalties
(all before temperature, so greedy rows get them too); greedy rows take the argmax; then
temperature, min-p, top-k/top-p, and random rows draw by inverting their cumulative distribution,
with a uniform number from the request's own generator when it has a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.scheduler.output import SampleLogprobs

NEG_INF = float("-inf")


@dataclass
class Penalties:
    presence: torch.Tensor
    """[N] float32."""
    frequency: torch.Tensor
    repetition: torch.Tensor
    output_counts: torch.Tensor
    """[N, V] float32: how often each token occurs in the row's output so far."""
    prompt_mask: torch.Tensor | None
    """[N, V] bool: tokens of the row's prompt (needed by the repetition penalty only)."""


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
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator (seeded requests only)."""
    default_generator: torch.Generator
    max_num_logprobs: int | None
    """The largest ``logprobs`` asked for in the batch, or None when no row wants them."""
    allowed_mask: torch.Tensor | None = None
    """[N, V] bool: True where a token may be sampled."""
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) that must not be sampled this step."""
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids, biases)."""
    penalties: Penalties | None = None


@dataclass
class LogprobTensors:
    """Log-probabilities at N positions, still on the device: the given (sampled or prompt)
    token first, then the top k."""

    token_ids: torch.Tensor
    """[N, 1 + k] int64."""
    logprobs: torch.Tensor
    """[N, 1 + k] float32."""
    ranks: torch.Tensor
    """[N] int64: the given token's rank (1 = the most likely)."""

    def tensors(self) -> list[torch.Tensor]:
        """The three tensors, in field order (``LogprobTensors(*tensors)`` rebuilds it)."""
        return [self.token_ids, self.logprobs, self.ranks]

    def to_list(self) -> list[SampleLogprobs]:
        """Per position, on the host (a device→host copy unless the tensors are there already)."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [SampleLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks, strict=True)]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[N] int64."""
    logprobs: LogprobTensors | None
    """Kept on the device: the model runner copies them to the host with the sampled ids."""


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    if p.prompt_mask is not None:
        seen = p.prompt_mask | (p.output_counts > 0)
        factor = torch.where(seen, p.repetition.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    occurred = (p.output_counts > 0).float()
    return logits - p.frequency.unsqueeze(1) * p.output_counts - p.presence.unsqueeze(1) * occurred


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k and nucleus; at least one token survives."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Masks, bias and penalties: everything that applies to greedy and random rows alike."""
    if md.allowed_mask is not None:
        logits = logits.masked_fill(~md.allowed_mask, NEG_INF)
    if md.banned is not None:
        # A fill, not a host→device copy: that would wait for the device (a step in flight).
        logits = logits.index_put(md.banned, torch.full((), NEG_INF, device=logits.device))
    if md.logit_bias is not None:
        rows, tokens, bias = md.logit_bias
        logits = logits.index_put((rows, tokens), bias, accumulate=True)
    if md.penalties is not None:
        logits = apply_penalties(logits, md.penalties)
    return logits


def sample_from_probs(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One draw per row by inverting the cumulative distribution: one uniform number per row,
    taken from the request's own generator when it has a seed (so its stream does not depend on
    the batch). Zero-probability tokens are never drawn (``right=True`` skips flat stretches)."""
    uniform = torch.rand(probs.shape[0], 1, generator=md.default_generator, device=probs.device)
    for row, gen in md.generators.items():
        uniform[row] = torch.rand(1, generator=gen, device=probs.device)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    return picked.clamp(max=probs.shape[-1] - 1)


def changes_logits(md: SamplingMetadata) -> bool:
    """Whether `process_logits` does anything for this batch (masks, bias or penalties)."""
    return (
        md.allowed_mask is not None
        or md.banned is not None
        or md.logit_bias is not None
        or md.penalties is not None
    )


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.all_greedy and md.max_num_logprobs is None and not changes_logits(md):
            # The argmax of the logits as the model produced them: widening to float32 is exact
            # and keeps their order, so it picks the same token (the first of equal maxima)
            # without writing and reading a float32 copy of the [N, vocab] logits.
            return SamplerOutput(logits.argmax(dim=-1), None)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = process_logits(logits, md)

        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            temp = torch.where(md.temperature > 0, md.temperature, 1.0)
            scaled = logits / temp.unsqueeze(1)
            if md.min_p is not None:
                scaled = apply_min_p(scaled, md.min_p)
            scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p)
            random = sample_from_probs(scaled.softmax(dim=-1), md)
            sampled = random if md.all_random else torch.where(md.temperature > 0, random, greedy)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = logprob_tensors(raw_logprobs, sampled, md.max_num_logprobs or 0)
        return SamplerOutput(sampled, logprobs)


def logprob_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """Per row: the given token's logprob and rank, then the top-k (token ids and logprobs)."""
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > token_lp).sum(dim=-1) + 1
    if k:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_lp, top_ids = logprobs[:, :0], token_ids[:, None][:, :0]
    return LogprobTensors(
        torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        torch.cat([token_lp, top_lp], dim=1),
        ranks,
    )
