"""The classes the front-end plugins register."""

from collections.abc import Sequence
from typing import Any

from pagellm.io_processors import IOProcessor, IOProcessorInputError
from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase
from pagellm.outputs import RequestOutput


class UpperTextProcessor(IOProcessor[list[str], list[str]]):
    """An IO processor in its simplest form: ``{"texts": [...]}`` in, each text upper-cased as
    one prompt, each prompt's first completion out as ``{"completions": [...]}``."""

    def parse_request(self, request: Any) -> list[str]:
        texts = request.get("texts") if isinstance(request, dict) else None
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise IOProcessorInputError("texts must be a list of non-empty strings.", "texts")
        return list(texts)

    def pre_process(self, data: list[str]) -> list[Any]:
        return [text.upper() for text in data]

    def post_process(self, outputs: Sequence[RequestOutput], data: list[str]) -> list[str]:
        return [output.outputs[0].text for output in outputs]

    def output_to_response(self, output: list[str]) -> dict[str, Any]:
        return {"completions": output}


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
