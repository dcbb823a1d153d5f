"""Shortest prompt first: a waiting request with fewer prompt tokens is admitted sooner."""

from pagellm.request import Request
from pagellm.scheduler.policy import KeyOrderedPolicy


class ShortestPromptFirst(KeyOrderedPolicy):
    def key(self, request: Request) -> tuple[int, float]:
        return (request.num_prompt_tokens, request.arrival_time)
