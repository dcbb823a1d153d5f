"""An image → the pixel tensor a CLIP vision tower takes, as the model's preprocessor_config.json
says and as transformers' CLIP image processor computes it: RGB (transparency on white), resize
(shortest edge, keeping the aspect ratio, or to a fixed size; PIL with the config's resampling),
center crop (zero-padded where the image is smaller), rescale (× 1/255), normalize (per-channel
mean and std), channels first, float32."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

CONFIG_FILE = "preprocessor_config.json"
CLIP_PROCESSORS = frozenset(
    {"CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil"}
)
"""The image processor types this preprocessing reproduces."""


def _height_width(size: Any, name: str) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    if isinstance(size, dict) and {"height", "width"} <= set(size):
        return int(size["height"]), int(size["width"])
    raise ValueError(f"{CONFIG_FILE}: {name} {size!r} is neither a size nor height and width.")


@dataclass(frozen=True)
class ClipPreprocessing:
    do_convert_rgb: bool
    shortest_edge: int | None
    """Resize so the shorter side has this length (None: ``resize_to``, or no resize)."""
    resize_to: tuple[int, int] | None
    """Resize to (height, width)."""
    resample: int
    """A PIL resampling filter (3: bicubic)."""
    crop: tuple[int, int] | None
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_model_dir(cls, directory: str) -> ClipPreprocessing:
        path = os.path.join(directory, CONFIG_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{directory} has no {CONFIG_FILE}: the image processor needs the model's image "
                "preprocessing (the Hugging Face checkpoint's file)."
            )
        with open(path) as f:
            config = json.load(f)
        kind = config.get("image_processor_type", "CLIPImageProcessor")
        if kind not in CLIP_PROCESSORS:
            raise ValueError(
                f"{path}: image_processor_type {kind!r} is not supported; pagellm-io-image "
                f"preprocesses as {', '.join(sorted(CLIP_PROCESSORS))} do."
            )
        return cls.from_dict(config)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ClipPreprocessing:
        size = config.get("size", {"shortest_edge": 224})
        shortest_edge, resize_to = None, None
        if config.get("do_resize", True):
            if isinstance(size, int) or (isinstance(size, dict) and "shortest_edge" in size):
                shortest_edge = int(size if isinstance(size, int) else size["shortest_edge"])
            else:
                resize_to = _height_width(size, "size")
        crop = None
        if config.get("do_center_crop", True):
            crop = _height_width(
                config.get("crop_size", {"height": 224, "width": 224}), "crop_size"
            )
        normalize = config.get("do_normalize", True)
        return cls(
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
            shortest_edge=shortest_edge,
            resize_to=resize_to,
            resample=int(config.get("resample", Image.Resampling.BICUBIC)),
            crop=crop,
            rescale_factor=float(config.get("rescale_factor", 1 / 255))
            if config.get("do_rescale", True)
            else None,
            mean=tuple(config.get("image_mean", (0.48145466, 0.4578275, 0.40821073)))
            if normalize
            else None,
            std=tuple(config.get("image_std", (0.26862954, 0.26130258, 0.27577711)))
            if normalize
            else None,
        )

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, when it does not depend on the image's."""
        return self.crop or self.resize_to

    def __call__(self, image: Image.Image) -> torch.Tensor:
        if self.do_convert_rgb:
            image = _rgb(image)
        size = self._resized_size(image.width, image.height)
        if size is not None:
            image = image.resize((size[1], size[0]), resample=self.resample)
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        values = pixels.astype(np.float32)
        if self.rescale_factor is not None:  # in float64 then down, as transformers does
            values = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32)
            std = np.asarray(self.std, dtype=np.float32)
            values = (values - mean) / std
        return torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))

    def _resized_size(self, width: int, height: int) -> tuple[int, int] | None:
        if self.resize_to is not None:
            return self.resize_to
        if self.shortest_edge is None:
            return None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def _rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centered height × width window (height, width, channels), zero-padded around an image
    smaller than it."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        top, left = (padded.shape[0] - h + 1) // 2, (padded.shape[1] - w + 1) // 2
        padded[top : top + h, left : left + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top : top + height, left : left + width]
