"""A vLLM-style plugin: the entry point names a function to call, not a module of hooks."""


def register() -> None:
    pass
