"""What has to happen before ``flash_attn.cute`` (flash-attn-4) is imported.

- Its CuTe DSL (``nvidia-cutlass-dsl``) keeps the ``cutlass`` package under
  ``nvidia_cutlass_dsl/dsl_packages``, which a ``.pth`` file puts on ``sys.path`` at interpreter
  start. Installed with ``pip install --target DIR`` (as on the GPU machine, where DIR is on
  ``PYTHONPATH``), that ``.pth`` file is never run, so ``cutlass`` does not import;
  `add_cutlass_dsl_packages` does what it would have done.
- FA4 compiles each kernel variant on first use (seconds each) and keeps it in memory only,
  unless its persistent cache is enabled, which it reads from the environment when imported;
  `use_persistent_jit_cache` enables it, so a second start loads the kernels from disk.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

CACHE_ENABLED_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR_VAR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def add_cutlass_dsl_packages() -> str | None:
    """Put ``nvidia_cutlass_dsl/dsl_packages`` first on ``sys.path`` (as the DSL's ``.pth`` file
    does) unless ``cutlass`` already imports; returns the directory added, or None."""
    if importlib.util.find_spec("cutlass") is not None:
        return None
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        packages = os.path.join(location, "dsl_packages")
        if os.path.isdir(packages):
            if packages not in sys.path:
                sys.path.insert(0, packages)
            importlib.invalidate_caches()
            return packages
    return None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagellm" / "flash_attn_cute"


def use_persistent_jit_cache() -> Path | None:
    """Enable FA4's on-disk kernel cache unless the user turned it off (``=0``); its directory
    is ``$FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, by default ``~/.cache/pagellm/flash_attn_cute``.
    Returns the directory, or None when the cache is off. Must run before the import."""
    os.environ.setdefault(CACHE_ENABLED_VAR, "1")
    if os.environ[CACHE_ENABLED_VAR] != "1":
        return None
    os.environ.setdefault(CACHE_DIR_VAR, str(default_cache_dir()))
    return Path(os.environ[CACHE_DIR_VAR])
