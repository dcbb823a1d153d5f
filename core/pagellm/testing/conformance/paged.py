"""Paged attention steps for the kit: random requests in shuffled blocks, the steps that compute
them, and one attention layer of any backend run over those steps through the backend contract.

Nothing here knows a backend's cache layout: context reaches the cache through the backend's own
writes in earlier steps, as in the engine. The reference is TORCH_SDPA on the CPU in float32, run
over the same steps from the same inputs (rounded to the dtype under test first).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from pagellm.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagellm.attention.backends.torch_sdpa import TorchSDPABackend
from pagellm.kv_cache.fp8 import FP8_KV_DTYPE
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.testing.conformance.compare import (
    TOLERANCE,
    ConformanceFailure,
    check_output,
    describe_rows,
    difference,
)

FP8_SCALES = (0.011, 0.007)
"""k_scale, v_scale of an FP8 cache: unit-variance keys and values then fill most of e4m3's
range (+-448), and the largest of them saturate."""


@dataclass(frozen=True)
class LayerShape:
    """One attention layer as the kit builds it."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None
    kv_cache_dtype: str = "auto"
    """A ``--kv-cache-dtype`` name: ``auto`` (the model dtype) or ``fp8_e4m3``."""

    @property
    def scale(self) -> float:
        return self.head_size**-0.5

    @property
    def cache_dtype(self) -> torch.dtype | None:
        return FP8_KV_DTYPE if self.kv_cache_dtype == "fp8_e4m3" else None

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        text = (
            f"{dtype}, {self.num_heads} query heads / {self.num_kv_heads} KV heads of size "
            f"{self.head_size}, block size {self.block_size}"
        )
        if self.sliding_window is not None:
            text += f", sliding window {self.sliding_window}"
        if self.kv_cache_dtype != "auto":
            text += f", kv cache {self.kv_cache_dtype}"
        return text


Step = list[tuple[int, int]]
"""One step's rows, in batch order: (request, tokens it computes this step)."""


@dataclass(frozen=True)
class Scenario:
    """Requests of ``lengths`` tokens and the ``steps`` that compute them, in order."""

    name: str
    lengths: list[int]
    steps: list[Step]
    shared_prefix: dict[int, tuple[int, int]] = field(default_factory=dict)
    """request → (other request, blocks): the request's first blocks are the other's (a
    prefix-cache hit); it starts with their tokens computed."""


@dataclass
class StepInputs:
    common: CommonAttentionMetadata
    fused: torch.Tensor
    """[T, (H + 2 Hkv) D] in float32 (values of the dtype under test), on the host: query, key
    and value side by side, as a fused QKV projection leaves them."""
    rows: Step
    positions: list[tuple[int, int]]
    """(request, position) of each token: where a difference is reported."""


class PagedRequests:
    """The requests of a scenario in blocks of a shuffled pool (block 0 is the null block), with
    a query, key and value for each of their positions: random values of dtype ``values_of``,
    kept in float32."""

    def __init__(
        self, scenario: Scenario, shape: LayerShape, values_of: torch.dtype, seed: int = 0
    ) -> None:
        self.scenario, self.shape = scenario, shape
        gen = torch.Generator().manual_seed(seed)
        bs, width = shape.block_size, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_size
        own_blocks = [
            math.ceil(n / bs) - scenario.shared_prefix.get(r, (0, 0))[1]
            for r, n in enumerate(scenario.lengths)
        ]
        self.num_blocks = 1 + sum(own_blocks) + 3  # the null block, and a few never used
        pool = (torch.randperm(self.num_blocks - 1, generator=gen) + 1).tolist()
        self.blocks: list[list[int]] = []
        self.computed: list[int] = []
        self.qkv: list[torch.Tensor] = []
        for r, n in enumerate(scenario.lengths):
            values = torch.randn(n, width, generator=gen).to(values_of).float()
            values[values == 0] = 1.0  # the round trip tells written entries by being nonzero
            blocks = pool[: own_blocks[r]]
            del pool[: own_blocks[r]]
            other, shared = scenario.shared_prefix.get(r, (r, 0))
            if shared:  # the same prompt: the shared positions' keys and values are the other's
                blocks = self.blocks[other][:shared] + blocks
                values[: shared * bs, -2 * self._kv_width :] = self.qkv[other][
                    : shared * bs, -2 * self._kv_width :
                ]
            self.blocks.append(blocks)
            self.computed.append(shared * bs)
            self.qkv.append(values)

    @property
    def _kv_width(self) -> int:
        return self.shape.num_kv_heads * self.shape.head_size

    def slot(self, request: int, position: int) -> int:
        bs = self.shape.block_size
        return self.blocks[request][position // bs] * bs + position % bs

    def next_step(self, rows: Step, device: torch.device) -> StepInputs:
        """The inputs of a step computing ``rows``; the requests' progress advances."""
        qsl, seq_lens, slots, chunks, positions = [0], [], [], [], []
        for request, new in rows:
            start = self.computed[request]
            end = start + new
            if end > self.scenario.lengths[request]:
                raise ValueError(f"{self.scenario.name}: request {request} has {end - 1} tokens")
            qsl.append(qsl[-1] + new)
            seq_lens.append(end)
            slots += [self.slot(request, p) for p in range(start, end)]
            chunks.append(self.qkv[request][start:end])
            positions += [(request, p) for p in range(start, end)]
            self.computed[request] = end
        width = max(len(self.blocks[r]) for r, _ in rows)
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, (request, _) in enumerate(rows):
            table[i, : len(self.blocks[request])] = torch.tensor(self.blocks[request])
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_reqs=len(rows),
            num_actual_tokens=qsl[-1],
            max_query_len=max(n for _, n in rows),
            max_seq_len=max(seq_lens),
            query_start_loc=qsl_t.to(device),
            query_start_loc_cpu=qsl_t,
            seq_lens=seq_t.to(device),
            seq_lens_cpu=seq_t,
            block_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )
        return StepInputs(common, torch.cat(chunks), rows, positions)


class LayerRun:
    """One attention layer of ``backend``: its KV cache, metadata builder and impl, fed step
    after step."""

    def __init__(
        self,
        backend: type[AttentionBackend],
        shape: LayerShape,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.backend, self.shape, self.device = backend, shape, device
        spec = KVCacheSpec(
            shape.block_size,
            shape.num_kv_heads,
            shape.head_size,
            shape.dtype,
            shape.sliding_window,
            shape.cache_dtype,
        )
        cache_shape = backend.get_kv_cache_shape(
            num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size
        )
        self.kv_cache = backend.allocate_kv_cache(cache_shape, spec.storage_dtype, device)
        self.builder = backend.get_builder_cls()(spec, device)
        self.impl = backend.get_impl_cls()(
            shape.num_heads, shape.head_size, shape.scale, shape.num_kv_heads, shape.sliding_window
        )
        if shape.cache_dtype is not None:
            self.impl.k_scale, self.impl.v_scale = FP8_SCALES

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key and value as strided column views of one tensor, in the layer's dtype on
        its device."""
        s = self.shape
        on_device = fused.to(device=self.device, dtype=s.dtype)
        q_width, kv_width = s.num_heads * s.head_size, s.num_kv_heads * s.head_size
        return (
            on_device[:, :q_width],
            on_device[:, q_width : q_width + kv_width],
            on_device[:, q_width + kv_width :],
        )

    def forward(self, inputs: StepInputs, attn_metadata: object = None) -> torch.Tensor:
        """The step's output in float32 on the host; built eagerly unless ``attn_metadata``."""
        if attn_metadata is None:
            attn_metadata = self.builder.build(inputs.common)
        query, key, value = self.split(inputs.fused)
        out = self.impl.forward(query, key, value, self.kv_cache, attn_metadata)
        s = self.shape
        what = f"{self.backend.name} ({s.describe()})"
        check_output(out, inputs.common.num_actual_tokens, s.num_heads * s.head_size, s.dtype, what)
        return out.float().cpu()


def run_scenario(
    backend: type[AttentionBackend],
    shape: LayerShape,
    scenario: Scenario,
    device: torch.device,
    values_of: torch.dtype | None = None,
) -> list[tuple[StepInputs, torch.Tensor]]:
    """Each step's inputs and output (float32, on the host). ``values_of``: the dtype the inputs
    are rounded to (default: the layer's)."""
    requests = PagedRequests(scenario, shape, values_of or shape.dtype)
    layer = LayerRun(backend, shape, requests.num_blocks, device)
    steps = [requests.next_step(rows, device) for rows in scenario.steps]
    return [(inputs, layer.forward(inputs)) for inputs in steps]


def reference_outputs(shape: LayerShape, scenario: Scenario) -> list[torch.Tensor]:
    """TORCH_SDPA's outputs for ``scenario`` in float32 on the CPU, from the inputs the layer
    under test gets (rounded to its dtype)."""
    float_shape = dataclasses.replace(shape, dtype=torch.float32)
    cpu = torch.device("cpu")
    return [
        out for _, out in run_scenario(TorchSDPABackend, float_shape, scenario, cpu, shape.dtype)
    ]


def assert_step_matches(
    what: str, shape: LayerShape, inputs: StepInputs, out: torch.Tensor, expected: torch.Tensor
) -> None:
    """A `ConformanceFailure` naming ``what`` (the case, backend and step), the layer, the rows
    and the worst value, unless ``out`` matches ``expected`` within the dtype's tolerance."""
    seq_lens = inputs.common.seq_lens_cpu.tolist()
    found = difference(out, expected, shape.num_heads, inputs.positions, TOLERANCE[shape.dtype])
    if found is not None:
        raise ConformanceFailure(
            f"{what} ({shape.describe()}; {describe_rows(inputs.rows, seq_lens)}) differs from "
            f"TORCH_SDPA: {found}"
        )


def assert_matches_reference(
    backend: type[AttentionBackend], shape: LayerShape, scenario: Scenario, device: torch.device
) -> None:
    """Every step of ``scenario`` gives TORCH_SDPA's output within the dtype's tolerance."""
    got = run_scenario(backend, shape, scenario, device)
    expected = reference_outputs(shape, scenario)
    for i, ((inputs, out), ref) in enumerate(zip(got, expected, strict=True)):
        what = f"{scenario.name}: {backend.name}, step {i + 1} of {len(got)}"
        assert_step_matches(what, shape, inputs, out, ref)
