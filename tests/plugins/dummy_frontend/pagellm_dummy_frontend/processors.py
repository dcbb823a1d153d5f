"""The classes the front-end plugins register."""


class UpperTextProcessor:
    """Turns a text prompt to upper case (an IO processor in its simplest form)."""

    def process_input(self, prompt: str) -> str:
        return prompt.upper()


class CollectingStatLogger:
    """Keeps every stats record it is given."""

    def __init__(self) -> None:
        self.records: list[object] = []

    def record(self, stats: object) -> None:
        self.records.append(stats)
