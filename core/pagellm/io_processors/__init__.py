"""IO processors (multimodal input/output) by name; plugins of ``pagellm.io_processor_plugins`` add
theirs here. Loaded in the front end only."""

from __future__ import annotations

from pagellm.plugins.groups import IO_PROCESSOR
from pagellm.plugins.registry import Registry

io_processors: Registry[object] = Registry("IO processor", object, IO_PROCESSOR)
