"""The config and tokenizer of a GGUF file, converted once and kept in a cache directory.

transformers can build both from the GGUF metadata, but parsing the metadata (the whole token
table and merges) takes seconds each time; after the first load they come from a plain HF
directory. The cache key covers the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

_GGUF_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def gguf_hf_dir(gguf_path: str) -> str:
    """A directory holding config.json and the tokenizer files converted from ``gguf_path``."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(
        f"{os.path.abspath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    ).hexdigest()[:24]
    root = os.environ.get("PAGELLM_CACHE_DIR") or os.path.expanduser("~/.cache/pagellm")
    target = os.path.join(root, "gguf", key)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target

    from transformers import AutoConfig, AutoTokenizer

    directory, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if not getattr(config, "architectures", None):
        # GGUF files name a model type, not a HF class; the causal-LM class is the one we serve.
        arch = _GGUF_MODEL_TYPE_TO_ARCH.get(config.model_type)
        config.architectures = [arch] if arch else []
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(target))
    try:
        tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)  # config.json last: its presence marks a complete entry
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise  # not a lost race with another process: a real failure
    return target
