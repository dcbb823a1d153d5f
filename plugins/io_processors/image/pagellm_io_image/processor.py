"""The ``image`` IO processor: a prompt with images → an engine prompt whose image placeholders
are expanded to the model's image tokens, with one `MultiModalItem` (the preprocessed pixels) per
image.

Its raw request is vLLM's prompt dict: ``{"prompt": text, "multi_modal_data": {"image": one or a
list}}`` (or ``prompt_token_ids`` instead of the text), each image a PIL image, a ``data:`` URL or
(with a media directory) a ``file:`` URL. The prompt holds one placeholder (``<image>``: the
model's image token) where each image goes, in order. The OpenAI chat route renders each
``image_url`` content part as that placeholder (`chat_placeholders`) and hands the URLs over.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from pagellm.config import EngineConfig
from pagellm.io_processors import IOProcessor, IOProcessorInputError
from pagellm.multimodal import MultiModalItem
from pagellm.outputs import RequestOutput
from pagellm_io_image.media import MediaLimits, load_image
from pagellm_io_image.preprocess import ClipPreprocessing

MODALITY = "image"


@dataclass
class ImagePrompt:
    """A parsed request: its prompt (text, or token ids) and its images, decoded."""

    text: str | None
    token_ids: list[int] | None
    images: list[Image.Image]


class ImageProcessor(IOProcessor[ImagePrompt, list[RequestOutput]]):
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        super().__init__(config, tokenizer)
        specs = [s for s in config.model.multimodal_specs if s.modality == MODALITY]
        if not specs:
            raise ValueError(
                f"The image IO processor needs a model that takes images; "
                f"{config.model.architecture} takes none (drop --io-processor image)."
            )
        self.spec = specs[0]
        self.preprocess = ClipPreprocessing.from_model_dir(config.model.model)
        size = self.preprocess.output_size()
        if size != self.spec.item_shape[1:]:
            raise ValueError(
                f"The model's preprocessor_config.json makes images of {size} pixels (height, "
                f"width); its vision tower takes {self.spec.item_shape[1:]}."
            )
        self.limits = MediaLimits.from_config(config.multimodal)
        self.max_images = config.multimodal.max_images_per_prompt
        self.placeholder = (
            tokenizer.convert_ids_to_tokens(self.spec.placeholder_token_id)
            if tokenizer is not None
            else None
        )
        """The text of the image token (``<image>``): one in a text prompt per image."""
        self.chat_placeholders = {"image_url": self.placeholder} if self.placeholder else {}

    def parse_request(self, request: Any) -> ImagePrompt:
        if not isinstance(request, dict) or not isinstance(request.get("multi_modal_data"), dict):
            raise IOProcessorInputError(
                'An image prompt is a dict with "multi_modal_data": {"image": ...}.',
                "multi_modal_data",
            )
        data = request["multi_modal_data"]
        unknown = sorted(set(data) - {MODALITY})
        if unknown:
            raise IOProcessorInputError(
                f"multi_modal_data has {', '.join(map(repr, unknown))}: this model takes images "
                '("image") only.',
                "multi_modal_data",
            )
        images = data.get(MODALITY)
        sources = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(sources) > self.max_images:
            raise IOProcessorInputError(
                f"The prompt has {len(sources)} images; this server takes at most "
                f"{self.max_images} per prompt (--max-images-per-prompt).",
                "multi_modal_data",
            )
        token_ids = request.get("prompt_token_ids")
        text = request.get("prompt")
        if token_ids is None and not isinstance(text, str):
            raise IOProcessorInputError("An image prompt needs a prompt text or prompt_token_ids.")
        return ImagePrompt(
            text if isinstance(text, str) else None,
            None if token_ids is None else list(token_ids),
            [load_image(source, i, self.limits) for i, source in enumerate(sources)],
        )

    def pre_process(self, data: ImagePrompt) -> list[Any]:
        return [self._expand(data, self._token_ids(data))]

    async def parse_request_async(self, request: Any) -> ImagePrompt:
        return await asyncio.to_thread(self.parse_request, request)  # decoding blocks

    async def pre_process_async(self, data: ImagePrompt) -> list[Any]:
        # Tokenized on the event loop (the tokenizer is shared with the other requests'
        # tokenization); the pixels are preprocessed off it.
        ids = self._token_ids(data)
        return [await asyncio.to_thread(self._expand, data, ids)]

    def _token_ids(self, data: ImagePrompt) -> list[int]:
        if data.token_ids is not None:
            return data.token_ids
        if self.tokenizer is None:
            raise IOProcessorInputError(
                "This engine has no tokenizer (skip_tokenizer_init): send prompt_token_ids."
            )
        return list(self.tokenizer.encode(data.text))

    def _expand(self, data: ImagePrompt, ids: list[int]) -> dict[str, Any]:
        """Each placeholder token expanded to the image's tokens, and its item."""
        token, count = self.spec.placeholder_token_id, self.spec.tokens_per_item
        positions = [i for i, t in enumerate(ids) if t == token]
        if len(positions) != len(data.images):
            raise IOProcessorInputError(
                f"The prompt has {len(positions)} image placeholder(s) ({self.placeholder!r}) "
                f"and {len(data.images)} image(s): put one placeholder where each image goes.",
                "multi_modal_data",
            )
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        start = 0
        for position, image in zip(positions, data.images, strict=True):
            expanded += ids[start:position]
            pixels: torch.Tensor = self.preprocess(image)
            items.append(MultiModalItem.from_tensor(MODALITY, pixels, len(expanded), count))
            expanded += [token] * count
            start = position + 1
        expanded += ids[start:]
        return {"prompt": data.text, "prompt_token_ids": expanded, "multi_modal_items": items}
