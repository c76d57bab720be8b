"""Decoding user image bytes and data: URLs: conversions, and every hostile input a RequestError."""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from deltaserve.errors import RequestError
from deltaserve.multimodal.image import (
    DEFAULT_MAX_IMAGE_BYTES,
    decode_data_url,
    decode_image,
    parse_data_url,
    to_rgb,
)

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def encode(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def noise(width_px: int = 60, height_px: int = 40, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height_px, width_px, 3), dtype=np.uint8))


def png_header_only(width_px: int, height_px: int) -> bytes:
    """A PNG declaring width x height (8-bit RGB) with one empty IDAT: nothing to allocate."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width_px, height_px, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_allowed_format_decodes_to_rgb(fmt) -> None:
    img = noise()
    decoded = decode_image(encode(img, fmt))
    assert decoded.mode == "RGB" and decoded.size == (60, 40)
    if fmt in ("PNG", "BMP"):  # lossless
        assert np.array_equal(np.asarray(decoded), np.asarray(img))


def test_gray_palette_cmyk_convert_like_pil() -> None:
    img = noise()
    for source in (img.convert("L"), img.convert("P"), img.convert("CMYK")):
        fmt = "JPEG" if source.mode == "CMYK" else "PNG"
        data = encode(source, fmt)
        expected = Image.open(io.BytesIO(data)).convert("RGB")
        assert np.array_equal(np.asarray(decode_image(data)), np.asarray(expected)), source.mode


def test_alpha_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 0))  # fully transparent dark pixels
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    rgb = np.asarray(decode_image(encode(rgba, "PNG")))
    assert rgb[0, 0].tolist() == [10, 20, 30] and rgb[1, 3].tolist() == [255, 255, 255]
    la = Image.new("LA", (2, 2), (0, 0))
    assert np.asarray(to_rgb(la)).min() == 255


def test_16bit_gray_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257, 32896, 40000, 65535]], dtype=np.uint16)
    rgb = np.asarray(decode_image(encode(Image.fromarray(values), "PNG")))
    expected = np.round(values / 257).astype(np.uint8)
    assert np.array_equal(rgb[..., 0], expected) and np.array_equal(rgb[..., 2], expected)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_images_give_the_first_frame(fmt) -> None:
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 255, 0))]
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], **options)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert decode_image(data).getpixel((3, 3)) == (255, 0, 0)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, displayed rotated 90 degrees clockwise
    assert decode_image(encode(noise(60, 40), "JPEG", exif=exif)).size == (40, 60)


def test_truncated_files_are_request_errors() -> None:
    for fmt in FORMATS:
        data = encode(noise(), fmt)
        for cut in (8, 30, len(data) // 2, len(data) - 40):
            with pytest.raises(RequestError, match="truncated|corrupt"):
                decode_image(data[:cut])


def test_corrupted_bytes_never_raise_another_type() -> None:
    rng = np.random.default_rng(0)
    refused = decoded = 0
    for fmt in FORMATS:
        data = encode(noise(37, 23), fmt)
        for _ in range(60):
            damaged = bytearray(data)
            for pos in rng.integers(0, len(data), 4):
                damaged[pos] = rng.integers(0, 256)
            try:  # any other exception type fails the test
                img = decode_image(bytes(damaged))
            except RequestError:
                refused += 1
                continue
            assert img.mode == "RGB" and img.size[0] > 0 and img.size[1] > 0
            decoded += 1
    assert refused > 0 and refused + decoded == 60 * len(FORMATS)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"just some text, not an image\n", "not an image in a supported format"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
        (encode(noise(), "TIFF"), "TIFF is not supported"),
        (png_header_only(0, 0), "corrupt or truncated"),
        (png_header_only(1, 0), "corrupt or truncated"),
    ],
    ids=["zero-bytes", "text", "svg", "tiff", "png-0x0", "png-1x0"],
)
def test_unsupported_or_empty_input(data, message) -> None:
    with pytest.raises(RequestError, match=message):
        decode_image(data)


def test_decompression_bombs_are_refused_before_decoding() -> None:
    # beyond Pillow's own hard limit: refused inside Image.open
    with pytest.raises(RequestError, match="too large"):
        decode_image(png_header_only(100_000, 100_000))
    # under Pillow's limits but over ours: the header's size is enough (no IDAT data to decode)
    with pytest.raises(RequestError, match=r"8000x8000 = 64000000 pixels .* limit is 40000000"):
        decode_image(png_header_only(8000, 8000))
    # between Pillow's warning and error limits: Pillow warns, our check refuses
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(RequestError, match="pixels"):
            decode_image(png_header_only(10_000, 10_000))
    with pytest.raises(RequestError, match="limit is 100 pixels"):
        decode_image(encode(noise(), "PNG"), max_pixels=100)


def test_oversized_bytes_are_refused() -> None:
    with pytest.raises(RequestError, match=f"limit is {DEFAULT_MAX_IMAGE_BYTES} bytes"):
        decode_image(b"\x89PNG" + bytes(DEFAULT_MAX_IMAGE_BYTES))
    with pytest.raises(RequestError, match="limit is 100 bytes"):
        decode_image(encode(noise(), "PNG"), max_bytes=100)
    with pytest.raises(RequestError, match="must be bytes"):
        decode_image("not bytes")  # type: ignore[arg-type]


def test_data_url_round_trip() -> None:
    img = noise()
    payload = base64.b64encode(encode(img, "PNG")).decode()
    wrapped = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    for url in (f"data:image/png;base64,{payload}", f"DATA:image/PNG;charset=x;base64,{wrapped}"):
        assert np.array_equal(np.asarray(decode_data_url(url)), np.asarray(img))
    # the declared type only gates the request: a JPEG sent as image/png decodes by its bytes
    jpeg = base64.b64encode(encode(img, "JPEG")).decode()
    assert decode_data_url(f"data:image/png;base64,{jpeg}").size == (60, 40)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "must be a data: URL"),
        ("data:image/png;base64", "no ','"),
        ("data:,aGVsbG8=", "media type is none"),
        ("data:text/plain;base64,aGVsbG8=", "text/plain; an image/\\* type is required"),
        ("data:image/svg+xml;base64,PHN2Zy8+", "image/svg\\+xml is not supported"),
        ("data:image/png,%89PNG", "must be base64"),
        ("data:image/png;base64,", "no data"),
        ("data:image/png;base64,iVBOR$$w0KGgo=", "not valid base64"),
        ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image"),  # valid base64, not an image
    ],
)
def test_malformed_data_urls(url, message) -> None:
    with pytest.raises(RequestError, match=message):
        decode_data_url(url)


def test_oversized_data_url_is_refused_before_decoding() -> None:
    with pytest.raises(RequestError, match="limit is 1000 bytes"):
        parse_data_url("data:image/png;base64," + "A" * 4000, max_bytes=1000)
    with pytest.raises(RequestError, match="must be a string"):
        parse_data_url(b"data:image/png;base64,AAAA")  # type: ignore[arg-type]
