"""The image preprocessing against transformers' CLIP image processor (its PIL backend,
`CLIPImageProcessorPil`: `CLIPImageProcessor` is its torchvision twin) on the same images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagellm_io_image.preprocess import ClipPreprocessing
from PIL import Image

LLAVA_LIKE = {
    "size": {"shortest_edge": 32},
    "crop_size": {"height": 32, "width": 32},
    "resample": 3,
}


def _images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (50, 30, 4), dtype=np.uint8)
    gray = rng.integers(0, 256, (33, 64), dtype=np.uint8)
    return {
        "rgb landscape": Image.fromarray(rgb),
        "rgba portrait": Image.fromarray(rgba, "RGBA"),
        "grayscale": Image.fromarray(gray, "L"),
        "palette": Image.fromarray(rgb).convert("P"),
        "small, upscaled": Image.fromarray(rgb[:9, :13]),
    }


def _hf(config: dict, image: Image.Image) -> torch.Tensor:
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(**config)
    return processor(images=image, return_tensors="pt")["pixel_values"][0]


@pytest.mark.parametrize("name", list(_images()))
def test_llava_preprocessing_matches_transformers(name: str):
    image = _images()[name]
    ours = ClipPreprocessing.from_dict(LLAVA_LIKE)(image)
    theirs = _hf(LLAVA_LIKE, image)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (3, 32, 32)
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_a_crop_larger_than_the_resized_image_is_zero_padded_as_transformers_pads_it():
    config = {"size": {"shortest_edge": 12}, "crop_size": {"height": 17, "width": 40}}
    image = _images()["rgb landscape"]
    ours = ClipPreprocessing.from_dict(config)(image)
    assert ours.shape == (3, 17, 40)
    assert torch.allclose(ours, _hf(config, image), atol=1e-6)


def test_a_fixed_size_without_crop_rescale_or_normalize_is_taken_as_given():
    config = {"size": {"height": 20, "width": 28}, "do_center_crop": False, "do_normalize": False}
    image = _images()["rgba portrait"]
    ours = ClipPreprocessing.from_dict(config)(image)
    assert ours.shape == (3, 20, 28) and float(ours.max()) <= 1.0
    assert torch.allclose(ours, _hf(config, image), atol=1e-6)


def test_a_model_without_a_clip_preprocessor_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no preprocessor_config.json"):
        ClipPreprocessing.from_model_dir(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "SiglipX"}')
    with pytest.raises(ValueError, match="'SiglipX' is not supported"):
        ClipPreprocessing.from_model_dir(str(tmp_path))
