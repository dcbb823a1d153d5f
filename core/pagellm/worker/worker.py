"""A worker owns one device: it loads the model there, holds the KV cache and runs each step."""

from __future__ import annotations

from pagellm.config import EngineConfig
from pagellm.kv_cache.spec import KVCacheSpec
from pagellm.platforms import current_platform
from pagellm.plugins import load_general_plugins
from pagellm.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0) -> None:
        load_general_plugins()  # workers may run in processes of their own
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.device = current_platform.device(local_rank)
        current_platform.seed_everything(config.model.seed)
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.model_runner.kv_cache_spec

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the KV cache (all layers together)."""
        return int(
            current_platform.available_kv_cache_memory(
                self.config, self.model_runner.model_memory_bytes(), self.model_runner.profile_run
            )
        )

    def decode_weight_bytes(self) -> int:
        return self.model_runner.decode_weight_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        self.model_runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def drop_requests(self, req_ids: list[str]) -> None:
        self.model_runner.drop_requests(req_ids)
