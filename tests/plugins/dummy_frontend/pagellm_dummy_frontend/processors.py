"""The classes the front-end plugins register."""

from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase


class UpperTextProcessor:
    """Turns a text prompt to upper case (an IO processor in its simplest form)."""

    def process_input(self, prompt: str) -> str:
        return prompt.upper()


class CollectingStatLogger(StatLoggerBase):
    """Keeps every pair of stats it is given, and counts its `log` calls."""

    def __init__(self, model_name: str = "") -> None:
        super().__init__(model_name)
        self.records: list[tuple[SchedulerStats | None, IterationStats | None]] = []
        self.num_logs = 0

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        self.records.append((scheduler_stats, iteration_stats))

    def log(self) -> None:
        self.num_logs += 1
