"""A worker owns one device: it loads the model there, sizes and holds the KV cache, and runs
each step through its model runner."""

from __future__ import annotations

import logging
import time

import torch

from pagellm.attention.layer import Attention
from pagellm.config import EngineConfig
from pagellm.distributed import get_tp_group
from pagellm.forward_context import set_forward_context
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.model_loader import load_model
from pagellm.model_loader.weight_memory import describe_weight_bytes
from pagellm.platforms import current_platform
from pagellm.plugins import load_general_plugins
from pagellm.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class Worker:
    def __init__(self, config: EngineConfig, local_rank: int = 0) -> None:
        load_general_plugins()  # workers may run in processes of their own
        self.config = config
        self.device = current_platform.device(local_rank)
        current_platform.seed_everything(config.model.seed)
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        runner, start = self.model_runner, time.perf_counter()
        runner.model = load_model(self.config, runner.attn_backend, self.device)
        logger.info(
            "Model loaded in %.2f s. %s",
            time.perf_counter() - start,
            describe_weight_bytes(runner.model, self.config.quantization),
        )

    def parallel_rank(self) -> int:
        """This worker's rank in its tensor-parallel group (0 when it works alone)."""
        return get_tp_group().rank_in_group

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.model_runner.kv_cache_spec

    def model_memory_bytes(self) -> int:
        return _bytes(self.model_runner.model)

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every parameter, except an untied input embedding
        table (only a few of its rows are read)."""
        model = self.model_runner.model
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if embed is not None and getattr(model, "lm_head", None) is not embed:
            return _bytes(model) - _bytes(embed)
        return _bytes(model)

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache (all layers together)."""
        return int(
            current_platform.available_kv_cache_memory(
                self.config, self.model_memory_bytes(), self.profile_run
            )
        )

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass over ``max_num_batched_tokens`` tokens and a sampling step over
        ``max_num_seqs`` rows (a pooling model's: pooling), before the KV cache exists, so the platform can measure peak
        activation memory (attention itself is skipped)."""
        sched, model = self.config.scheduler, self.model_runner.model
        n = sched.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device) % self.config.model.max_model_len
        with set_forward_context(None):
            hidden = model(ids, positions)
        if self.model_runner.pooling:  # the step's prompts pooled (here as one), no sampling
            whole = torch.tensor([n], device=self.device)
            model.pooler(hidden, torch.zeros_like(whole), whole)
            return
        logits = model.compute_logits(hidden[: min(sched.max_num_seqs, n)])
        logits.float().log_softmax(dim=-1).argmax(dim=-1)

    @torch.inference_mode()
    def warm_up_logits(self) -> float:
        """The logits matmul and the greedy argmax once at every row count a step can sample (1
        to ``max_num_seqs``); returns the seconds taken. A GPU BLAS library chooses its kernel by
        shape and, on first use of a shape, decides and loads it on the host: milliseconds inside
        each step whose row count is new (prompt steps, which sample a different number of rows
        each time, a decode batch shrinking as its requests finish) while the device waits."""
        model = self.model_runner.model
        embed = getattr(model, "embed_input_ids", None)
        if self.model_runner.pooling or embed is None:
            return 0.0
        start = time.perf_counter()
        rows = self.config.scheduler.max_num_seqs
        hidden = embed(torch.zeros(rows, dtype=torch.long, device=self.device))
        for n in range(1, rows + 1):
            model.compute_logits(hidden[:n]).argmax(dim=-1)
        current_platform.synchronize()
        return time.perf_counter() - start

    def initialize_cache(self, num_blocks: int) -> dict[str, float]:
        """Give every attention layer its KV cache, then capture the graphs the config turns on;
        returns the seconds each kind of graph took to capture (`ModelRunner.capture_model`)."""
        runner, spec = self.model_runner, self.model_runner.kv_cache_spec
        backend = runner.attn_backend
        shape = backend.get_kv_cache_shape(
            num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        for layer in runner.model.modules():
            if isinstance(layer, Attention):
                layer.kv_cache = backend.allocate_kv_cache(shape, spec.storage_dtype, self.device)
        return runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def launch_model(self, scheduler_output: SchedulerOutput) -> None:
        self.model_runner.launch(scheduler_output)

    def collect_output(self) -> ModelRunnerOutput:
        return self.model_runner.collect()

    def drop_requests(self, req_ids: list[str]) -> None:
        self.model_runner.drop_requests(req_ids)

    def encoder_cache_stats(self) -> dict[str, int]:
        """The encoder cache's counters (hits, misses: items encoded, entries, tokens); empty
        for a text-only model."""
        multimodal = self.model_runner.multimodal
        return {} if multimodal is None else multimodal.cache.stats()
