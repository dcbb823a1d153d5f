"""Where images come from and what is refused before (and while) they are decoded: each refusal
an `IOProcessorInputError` (an HTTP 400 on the server) naming the image and what to do."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from pagellm_io_image.media import MediaLimits, load_image
from PIL import Image

from pagellm.io_processors import IOProcessorInputError

LIMITS = MediaLimits(max_bytes=64 << 10, max_pixels=256 * 256, local_dir=None)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def picture(width: int = 24, height: int = 16) -> Image.Image:
    rng = np.random.default_rng(1)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def refused(source: object, limits: MediaLimits = LIMITS) -> str:
    with pytest.raises(IOProcessorInputError) as error:
        load_image(source, 3, limits)
    assert str(error.value).startswith("image 3")
    return str(error.value)


@pytest.mark.parametrize(
    "fmt,mime",
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")],
)
def test_data_urls_of_each_format_decode_to_the_image(fmt: str, mime: str):
    image = load_image(data_url(encoded(picture(), fmt), mime), 0, LIMITS)
    assert image.format == fmt and image.size == (24, 16)
    if fmt == "PNG":
        assert np.array_equal(np.asarray(image), np.asarray(picture()))


def test_a_wrong_or_missing_image_type_is_refused():
    png = encoded(picture())
    assert "of type 'text/plain', not an image type" in refused(data_url(png, "text/plain"))
    assert "declared image/jpeg, but its bytes are a PNG image" in refused(
        data_url(png, "image/jpeg")
    )
    bmp = encoded(picture(), "BMP")
    assert "is not a GIF, JPEG, PNG, WEBP image" in refused(data_url(bmp, "image/png"))
    assert "is not base64" in refused("data:image/png," + "x" * 8)
    assert "not valid base64" in refused("data:image/png;base64,@@@@")


def test_a_truncated_image_is_refused_when_decoded():
    png = encoded(picture(64, 64))
    assert "cannot be decoded" in refused(data_url(png[: len(png) // 2]))


def test_too_many_pixels_are_refused_before_decoding_and_too_many_bytes_before_base64():
    huge = encoded(Image.new("L", (6000, 5000)))  # a few KB of PNG, 30 megapixels
    assert len(huge) < LIMITS.max_bytes
    message = refused(data_url(huge))
    assert "6000×5000 pixels" in message and "--max-image-pixels" in message
    big = data_url(b"\0" * (LIMITS.max_bytes + 100))
    assert "--max-image-bytes" in refused(big)
    assert "--max-image-pixels" in refused(Image.new("RGB", (300, 300)))


def test_remote_urls_are_refused_and_local_files_need_the_media_directory(tmp_path):
    assert "fetches no media over the network" in refused("https://example.com/cat.png")
    assert "fetches no media" in refused("http://127.0.0.1/cat.png")
    media = tmp_path / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(encoded(picture()))
    (tmp_path / "secret.png").write_bytes(encoded(picture()))
    url = f"file://{media}/cat.png"
    assert "--allowed-local-media-path" in refused(url)
    allowed = MediaLimits(LIMITS.max_bytes, LIMITS.max_pixels, str(media.resolve()))
    assert load_image(url, 0, allowed).size == (24, 16)
    assert "outside the server's media directory" in refused(
        f"file://{media}/../secret.png", allowed
    )
    assert "does not exist" in refused(f"file://{media}/dog.png", allowed)
    assert "is not a data: URL" in refused("cat.png")
    assert "is a bytes" in refused(encoded(picture()))
