"""Multimodal input in the engine: the items a prompt carries (`MultiModalItem`) and what a model
takes (`MultiModalSpec`). Turning media into items is an IO processor's job (front end); embedding
them is the model's, in the workers (`pagellm.worker.multimodal`)."""

from __future__ import annotations

from pagellm.multimodal.inputs import MultiModalItem, MultiModalSpec, check_items

__all__ = ["MultiModalItem", "MultiModalSpec", "check_items"]
