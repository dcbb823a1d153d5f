"""Where a request's images come from, and the checks they pass before they are decoded: inline
``data:`` URLs (base64), local ``file:`` URLs inside the server's media directory (only when it
has one), or PIL images (offline). Remote URLs are refused: the server fetches nothing.

Only PNG, JPEG, WebP and GIF are decoded (Pillow's other decoders are never tried), a data URL's
declared type must be the bytes' format, and the byte and pixel limits are checked before the
pixels are decoded. Every refusal is an `IOProcessorInputError` (HTTP 400) naming the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from pagellm.config import MultiModalConfig
from pagellm.io_processors import IOProcessorInputError

MIME_FORMATS = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
}
FORMATS = sorted(set(MIME_FORMATS.values()))
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int
    max_pixels: int
    local_dir: str | None
    """The only directory ``file:`` URLs may name files in (a real path), or None."""

    @classmethod
    def from_config(cls, config: MultiModalConfig) -> MediaLimits:
        return cls(config.max_image_bytes, config.max_image_pixels, config.allowed_local_media_path)


def load_image(source: Any, index: int, limits: MediaLimits) -> Image.Image:
    """Image ``index`` of a request: a PIL image, or the image a URL holds."""
    name = f"image {index}"
    if isinstance(source, Image.Image):
        _check_pixels(source, name, limits)
        return source
    if not isinstance(source, str):
        raise IOProcessorInputError(
            f"{name} is a {type(source).__name__}: send a PIL image, or a data: URL "
            "(data:image/png;base64,...)."
        )
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        data, declared = _data_url(source, name, limits)
        return _decode(data, declared, name, limits)
    if scheme == "file":
        return _decode(_local_file(source, name, limits), None, name, limits)
    if scheme in ("http", "https"):
        raise IOProcessorInputError(
            f"{name} is a remote URL ({scheme}): this server fetches no media over the network; "
            "send the image inline as a data: URL (data:image/png;base64,...)."
        )
    raise IOProcessorInputError(
        f"{name}'s URL {source[:40]!r} is not a data: URL (data:image/png;base64,...)"
        + (" or a file: URL" if limits.local_dir else "")
        + "."
    )


def _data_url(url: str, name: str, limits: MediaLimits) -> tuple[bytes, str]:
    header, comma, payload = url.partition(",")
    params = header[len("data:") :].split(";")
    mime = params[0].strip().lower() or "text/plain"
    if not comma or "base64" not in (p.strip().lower() for p in params[1:]):
        raise IOProcessorInputError(f"{name}'s data URL is not base64 (data:{mime};base64,...).")
    if mime not in MIME_FORMATS:
        raise IOProcessorInputError(
            f"{name}'s data URL is of type {mime!r}, not an image type this server decodes "
            f"({', '.join(sorted(MIME_FORMATS))})."
        )
    if len(payload) * 3 // 4 > limits.max_bytes + 2:  # refused before decoding the base64
        raise _too_large(name, len(payload) * 3 // 4, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise IOProcessorInputError(f"{name}'s data URL is not valid base64: {exc}.") from None
    if len(data) > limits.max_bytes:
        raise _too_large(name, len(data), limits)
    return data, mime


def _local_file(url: str, name: str, limits: MediaLimits) -> bytes:
    if limits.local_dir is None:
        raise IOProcessorInputError(
            f"{name} is a file: URL, and this server reads no local files (start it with "
            "--allowed-local-media-path DIR to allow those under DIR)."
        )
    parsed = urlparse(url)
    path = os.path.realpath(unquote(parsed.path))
    inside = os.path.commonpath([path, limits.local_dir]) == limits.local_dir
    if parsed.netloc not in ("", "localhost") or not inside:
        raise IOProcessorInputError(
            f"{name}'s file {unquote(parsed.path)!r} is outside the server's media directory."
        )
    if not os.path.isfile(path):
        raise IOProcessorInputError(f"{name}'s file {unquote(parsed.path)!r} does not exist.")
    size = os.path.getsize(path)
    if size > limits.max_bytes:
        raise _too_large(name, size, limits)
    with open(path, "rb") as f:
        return f.read()


def _decode(data: bytes, declared: str | None, name: str, limits: MediaLimits) -> Image.Image:
    with warnings.catch_warnings():  # our pixel limit is the one that counts
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except (UnidentifiedImageError, *_DECODE_ERRORS) as exc:
            raise IOProcessorInputError(
                f"{name} is not a {', '.join(FORMATS)} image this server can read: {exc}"
            ) from None
        if declared is not None and MIME_FORMATS[declared] != image.format:
            raise IOProcessorInputError(
                f"{name} is declared {declared}, but its bytes are a {image.format} image."
            )
        _check_pixels(image, name, limits)
        try:
            image.load()
        except _DECODE_ERRORS as exc:
            raise IOProcessorInputError(f"{name} cannot be decoded: {exc}.") from None
    return image


def _check_pixels(image: Image.Image, name: str, limits: MediaLimits) -> None:
    width, height = image.size
    if width * height > limits.max_pixels:
        raise IOProcessorInputError(
            f"{name} is {width}×{height} pixels, more than this server's limit of "
            f"{limits.max_pixels} (--max-image-pixels)."
        )


def _too_large(name: str, size: int, limits: MediaLimits) -> IOProcessorInputError:
    return IOProcessorInputError(
        f"{name} is {size} bytes, more than this server's limit of {limits.max_bytes} "
        "(--max-image-bytes)."
    )
