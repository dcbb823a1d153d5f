"""A stand-in for the ``flashinfer`` package on the CPU, where the real one cannot run (its
kernels need an NVIDIA GPU and nvcc). It records every call the backend makes and computes
attention from what it was planned with, by FlashInfer's documented semantics, in float64:

- row ``i``'s pages are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, its length
  ``(pages - 1) * page_size + kv_last_page_len[i]`` (0 without pages); queries
  ``qo_indptr[i]:qo_indptr[i+1]`` (decode: one per row), aligned to the end of the row (causal);
  ``window_left`` keys before each query are visible (-1: all); query head ``h`` reads KV head
  ``h // (num_qo_heads // num_kv_heads)``;
- a wrapper made with ``use_cuda_graph=True`` keeps its index arrays in the buffers it was given:
  ``plan`` copies into them, ``fast_decode_plan`` does not (the caller writes them), and ``run``
  reads them, as a replayed graph would.

So a test that gets the right attention out of the backend checks the arrays it built, and the
recorded calls show how it planned.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

__version__ = "0.6.13"


def _snapshot(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


@dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)

    def record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append(
            Call(
                name,
                tuple(_snapshot(a) for a in args),
                {k: _snapshot(v) for k, v in kwargs.items()},
            )
        )

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


log = Recorder()
"""Every call of the module, in order (tests clear it)."""


@dataclass
class Plan:
    qo_indptr: torch.Tensor | None  # None: one query per row (decode)
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    window_left: int
    sm_scale: float | None


def check_starts_at_zero(*indptrs: torch.Tensor) -> None:
    """FlashInfer reads row ``i``'s queries and pages from the start of ``q`` and of
    ``kv_indices``: its indptr arrays begin at 0."""
    for indptr in indptrs:
        if int(indptr[0]) != 0:
            raise ValueError(f"an indptr array starts at {int(indptr[0])}, not 0")


def check_seq_lens(
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
) -> None:
    """FlashInfer's prefill plan copies ``seq_lens`` (when given) to the device as the rows'
    KV lengths in place of the ones it would derive from the pages: they must agree (a row of
    no page has length 0), and be on the host."""
    if seq_lens.device.type != "cpu":
        raise ValueError("seq_lens must be a host tensor")
    pages = kv_indptr[1:] - kv_indptr[:-1]
    derived = torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len, 0)
    if not torch.equal(seq_lens.to(torch.int64), derived.to(torch.int64)):
        raise ValueError(f"seq_lens {seq_lens.tolist()} != the pages' {derived.tolist()}")


def attend(plan: Plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out):
    num_rows = plan.kv_last_page_len.shape[0]
    group = plan.num_qo_heads // plan.num_kv_heads
    scale = plan.sm_scale if plan.sm_scale is not None else 1 / math.sqrt(plan.head_dim)
    out.zero_()
    for row in range(num_rows):
        start, end = int(plan.kv_indptr[row]), int(plan.kv_indptr[row + 1])
        pages = plan.kv_indices[start:end].long()
        kv_len = 0 if end == start else (end - start - 1) * plan.page_size
        kv_len += int(plan.kv_last_page_len[row]) if end > start else 0
        if plan.qo_indptr is None:
            q0, q1 = row, row + 1
        else:
            q0, q1 = int(plan.qo_indptr[row]), int(plan.qo_indptr[row + 1])
        if kv_len == 0 or q1 == q0:
            continue
        keys = k_cache[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].double()
        values = v_cache[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].double()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = q[q0:q1].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = torch.arange(kv_len - (q1 - q0), kv_len).unsqueeze(1)
        k_pos = torch.arange(kv_len).unsqueeze(0)
        visible = torch.ones_like(scores[0], dtype=torch.bool)
        if plan.causal:
            visible &= k_pos <= q_pos
        if plan.window_left >= 0:
            visible &= k_pos >= q_pos - plan.window_left
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out


_plans = 0
"""Plans made so far in the process (each plan's schedule gets its number)."""


class _Wrapper:
    kind = "wrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", **kwargs):
        if kv_layout != "NHD":
            raise ValueError(f"the fake only lays pages out as NHD, not {kv_layout}")
        log.record(f"{self.kind}.__init__", float_workspace_buffer, kv_layout, **kwargs)
        self.kwargs = kwargs
        self.plan_args: Plan | None = None
        # As FlashInfer's: the wrapper's own int workspace until `reset_workspace_buffer`.
        self.int_workspace = torch.zeros(64, dtype=torch.uint8)
        self.schedule_id: int | None = None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        log.record(
            f"{self.kind}.reset_workspace_buffer", float_workspace_buffer, int_workspace_buffer
        )
        self.int_workspace = int_workspace_buffer

    def _write_schedule(self) -> None:
        """FlashInfer writes a plan's schedule into the int workspace, where the kernel reads
        it at every run: here a number unique to the plan, checked by `run`."""
        global _plans
        _plans += 1
        self.schedule_id = _plans
        self.int_workspace[:8].view(torch.int64)[0] = _plans

    def run(self, q: torch.Tensor, paged_kv_cache, *, out: torch.Tensor) -> torch.Tensor:
        log.record(f"{self.kind}.run", q.shape, out.shape)
        if self.plan_args is None:
            raise RuntimeError("run before plan")
        if int(self.int_workspace[:8].view(torch.int64)[0]) != self.schedule_id:
            raise RuntimeError(
                "the schedule in this wrapper's int workspace is another plan's (a wrapper "
                "sharing the buffer was planned since): the real kernel would read garbage"
            )
        k_cache, v_cache = paged_kv_cache
        return attend(self._arrays(), q, k_cache, v_cache, out)

    def _arrays(self) -> Plan:
        assert self.plan_args is not None
        return self.plan_args


class _PrefillModule:
    """The prefill wrapper's compiled module, as FlashInfer's ``run`` uses it: one
    ``paged_run`` call with the whole argument list (here: the wrapper's int workspace, the
    query, the K and V pages, the output, the plan, a scalar), computing into the output."""

    def paged_run(self, int_workspace, q, k_cache, v_cache, out, plan, schedule_id, causal):
        log.record("prefill.paged_run", q.shape, out.shape)
        if int(int_workspace[:8].view(torch.int64)[0]) != schedule_id:
            raise RuntimeError("paged_run with another plan's schedule in the workspace")
        attend(plan, q, k_cache, v_cache, out)


prefill_module = _PrefillModule()
"""The one module every prefill wrapper gets at ``plan`` (FlashInfer caches them)."""


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """``run`` checks its arguments, then calls its module's ``paged_run`` (as FlashInfer's
    does): `pagellm_flashinfer.replay` records that call and replays it."""

    kind = "prefill"
    _cached_module: Any = None

    def run(self, q: torch.Tensor, paged_kv_cache, *, out: torch.Tensor) -> torch.Tensor:
        log.record(f"{self.kind}.run", q.shape, out.shape)
        if self.plan_args is None or self._cached_module is None:
            raise RuntimeError("run before plan")
        k_cache, v_cache = paged_kv_cache
        if out.shape != q.shape or k_cache.shape != v_cache.shape:
            raise ValueError("run's shapes do not match")
        self._cached_module.paged_run(
            self.int_workspace, q, k_cache, v_cache, out, self.plan_args, self.schedule_id, True
        )
        return out

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        *,
        causal=False,
        sm_scale=None,
        window_left=-1,
        q_data_type="float16",
        kv_data_type=None,
        non_blocking=True,
        max_token_per_sequence=None,
        seq_lens=None,
    ) -> None:
        log.record(
            "prefill.plan",
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            causal=causal,
            sm_scale=sm_scale,
            window_left=window_left,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            non_blocking=non_blocking,
            max_token_per_sequence=max_token_per_sequence,
            seq_lens=seq_lens,
        )
        check_starts_at_zero(qo_indptr, paged_kv_indptr)
        if seq_lens is not None:
            check_seq_lens(seq_lens, paged_kv_indptr, paged_kv_last_page_len, page_size)
        if int(qo_indptr[-1]) == 0:
            raise ValueError("a prefill plan of no query token")
        self._cached_module = prefill_module
        self.plan_args = Plan(
            qo_indptr.clone(),
            paged_kv_indptr.clone(),
            paged_kv_indices.clone(),
            paged_kv_last_page_len.clone(),
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            causal,
            window_left,
            sm_scale,
        )
        self._write_schedule()


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    kind = "decode"

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
    ):
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph=use_cuda_graph,
            use_tensor_cores=use_tensor_cores,
        )
        self.is_cuda_graph_enabled = use_cuda_graph
        self.buffers = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )
        if use_cuda_graph and any(b is None for b in self.buffers):
            raise ValueError("a CUDA-graph wrapper needs its three index buffers")

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        pos_encoding_mode="NONE",
        window_left=-1,
        q_data_type="float16",
        kv_data_type=None,
        sm_scale=None,
        non_blocking=True,
        disable_split_kv=False,
    ) -> None:
        log.record(
            "decode.plan",
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            sm_scale=sm_scale,
            non_blocking=non_blocking,
            disable_split_kv=disable_split_kv,
        )
        check_starts_at_zero(indptr)
        if self.is_cuda_graph_enabled:
            indptr_buf, indices_buf, last_buf = self.buffers
            if last_page_len.shape[0] != last_buf.shape[0]:
                raise ValueError("a CUDA-graph wrapper's batch size is fixed")
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[: indices.shape[0]].copy_(indices)
        self._planned(
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            window_left,
            sm_scale,
        )

    def _planned(self, indptr, indices, last, heads, kv_heads, dim, page, window, scale) -> None:
        self._write_schedule()
        self.plan_args = Plan(
            None,
            indptr.clone(),
            indices.clone(),
            last.clone(),
            heads,
            kv_heads,
            dim,
            page,
            False,
            window,
            scale,
        )

    def _arrays(self) -> Plan:
        plan = super()._arrays()
        if not self.is_cuda_graph_enabled:
            return plan
        indptr_buf, indices_buf, last_buf = self.buffers
        num_pages = int(indptr_buf[-1])
        return Plan(
            None,
            indptr_buf,
            indices_buf[:num_pages],
            last_buf,
            plan.num_qo_heads,
            plan.num_kv_heads,
            plan.head_dim,
            plan.page_size,
            False,
            plan.window_left,
            plan.sm_scale,
        )


def fast_decode_plan(
    self: BatchDecodeWithPagedKVCacheWrapper,
    indptr,
    indices,
    last_page_len,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    page_size,
    *,
    pos_encoding_mode="NONE",
    window_left=-1,
    q_data_type=None,
    kv_data_type=None,
    sm_scale=None,
    non_blocking=True,
) -> None:
    log.record(
        "fast_decode_plan",
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        q_data_type=q_data_type,
        kv_data_type=kv_data_type,
        sm_scale=sm_scale,
        non_blocking=non_blocking,
    )
    if self.plan_args is None:
        raise RuntimeError("fast_decode_plan needs a first plan (it reuses the loaded module)")
    self._planned(
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        window_left,
        sm_scale,
    )


NINJA = shutil.which("ninja")


@dataclass
class FakeSpec:
    """A JIT spec built as FlashInfer's ``JitSpec`` is: its generated source (``source``) and
    its own ninja file in ``build_dir``, which `build` runs (with the real ninja where it is on
    PATH, whose log there then records the library; else the log is written as ninja would)."""

    name: str
    build_dir: Path

    @property
    def is_compiled(self) -> bool:
        return (self.build_dir / f"{self.name}.so").exists()

    @property
    def ninja_path(self) -> Path:
        return self.build_dir / "build.ninja"

    @property
    def source(self) -> Path:
        return self.build_dir / f"{self.name}.cu"

    def generate(self) -> None:
        """The generator's output, written only where it changed (as FlashInfer's is)."""
        self.build_dir.mkdir(parents=True, exist_ok=True)
        if not self.source.exists():
            self.source.write_text(f"// {self.name}\n")

    def write_ninja(self) -> None:
        content = (
            "ninja_required_version = 1.3\n"
            "rule link\n  command = cp $in $out\n"
            f"build {self.name}.so: link {self.source.name}\n"
        )
        if not self.ninja_path.exists() or self.ninja_path.read_text() != content:
            self.ninja_path.write_text(content)

    def build(self, verbose: bool) -> None:
        log.record("jit.build", self.name)
        self.generate()
        self.write_ninja()
        if NINJA is not None:
            subprocess.run(
                [NINJA, "-C", str(self.build_dir), "-f", str(self.ninja_path)],
                check=True,
                capture_output=True,
            )
            return
        (self.build_dir / f"{self.name}.so").write_text("")
        with open(self.build_dir / ".ninja_log", "a") as f:
            f.write(f"0\t1\t0\t{self.build_dir / self.name}.so\t0\n")


class _Jit:
    """``flashinfer.jit``: module specs, a JIT cache whose content tests choose, and builds."""

    def __init__(self) -> None:
        self.env = SimpleNamespace(FLASHINFER_JIT_DIR=Path("/fake/flashinfer/cached_ops"))

    def spec_dir(self, name: str) -> Path:
        return self.env.FLASHINFER_JIT_DIR / name

    def gen_batch_prefill_module(self, backend, dtype_q, dtype_kv, dtype_o, dtype_idx, *rest):
        head_qk, head_vo, pos_encoding, sliding, soft_cap, fp16_qk = rest
        name = (
            f"batch_prefill_{backend}_{str(dtype_q).removeprefix('torch.')}_"
            f"{str(dtype_idx).removeprefix('torch.')}_head_{head_qk}_{head_vo}_swa_{sliding}"
        )
        if (dtype_kv, dtype_o, pos_encoding, soft_cap, fp16_qk) != (
            dtype_q,
            dtype_q,
            0,
            False,
            False,
        ):
            name += "_unexpected"
        spec = FakeSpec(name, self.spec_dir(name))
        spec.generate()
        return spec

    def build_jit_specs(self, specs: list[FakeSpec]) -> None:
        """One ninja run over several modules, logged in the JIT directory, not in theirs."""
        log.record("jit.build_jit_specs", [s.name for s in specs])
        for spec in specs:
            spec.build_dir.mkdir(parents=True, exist_ok=True)
            (spec.build_dir / f"{spec.name}.so").write_text("")


jit = _Jit()


@contextmanager
def installed() -> Iterator[ModuleType]:
    """This module as ``flashinfer`` in ``sys.modules``, its log and JIT cache empty."""
    module = sys.modules[__name__]
    log.calls.clear()
    jit_dir = tempfile.mkdtemp(prefix="fake_flashinfer_jit_")
    jit.env.FLASHINFER_JIT_DIR = Path(jit_dir)
    previous = sys.modules.get("flashinfer")
    sys.modules["flashinfer"] = module
    try:
        yield module
    finally:
        shutil.rmtree(jit_dir, ignore_errors=True)
        if previous is None:
            del sys.modules["flashinfer"]
        else:
            sys.modules["flashinfer"] = previous
