"""IO processors (multimodal input/output) by name; plugins of ``pagellm.io_processor_plugins`` add
theirs here. Loaded in the front end only."""

from __future__ import annotations

from pagellm.plugins.class_registry import ClassRegistry


def _load_plugins() -> None:
    from pagellm.plugins import load_frontend_plugins

    load_frontend_plugins()


_REGISTRY: ClassRegistry[object] = ClassRegistry("IO processor", object, _load_plugins)
register_io_processor = _REGISTRY.register
registered_io_processors = _REGISTRY.names
get_io_processor_cls = _REGISTRY.get
