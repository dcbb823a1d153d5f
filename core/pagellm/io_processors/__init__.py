"""IO processors: what turns a model's requests into engine prompts and its outputs into responses,
when plain text in and text out is not the whole story (images in, embeddings out).

`IOProcessor` is the contract; plugins of ``pagellm.io_processor_plugins`` register theirs in
`io_processors` by name, and the front end (`RequestFrontend`) builds the one the engine config
names (`build_io_processor`): ``--io-processor``, else the model config.json's
``io_processor_plugin``. Loaded in the front end only: the engine core never imports one.
"""

from __future__ import annotations

from pagellm.io_processors.base import IOProcessor, IOProcessorInputError
from pagellm.io_processors.selection import build_io_processor, io_processors

__all__ = ["IOProcessor", "IOProcessorInputError", "build_io_processor", "io_processors"]
