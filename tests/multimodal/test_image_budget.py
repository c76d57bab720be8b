"""Visual tokens counted from an image's header equal what processing it gives (issue 31, item 5):
the request's limits are checked on every image's size before any image is decoded."""

from __future__ import annotations

import io
import random
import struct

import pytest
from PIL import Image

from deltaserve.errors import RequestError
from deltaserve.multimodal.image import decode_image, open_image
from deltaserve.multimodal.inputs import ImageLimits, header_visual_tokens, open_image_source
from deltaserve.multimodal.processor import num_visual_tokens, piece_grids, process_image


def sizes_px() -> list[tuple[int, int]]:
    """(h, w): edges of the slicing rules (one piece, 448^2, 9 slices) and random aspect ratios
    up to 1:60 and areas up to 6 MP."""
    fixed = [
        (1, 1),
        (14, 14),
        (13, 700),
        (447, 448),
        (448, 448),
        (449, 448),
        (896, 672),
        (1200, 1600),
        (1600, 1200),
        (2000, 100),
        (100, 2000),
        (3000, 3000),
    ]
    rng = random.Random(31)
    rand = []
    for _ in range(40):
        area, aspect = rng.uniform(1e3, 6e6), 60 ** rng.uniform(-1, 1)
        rand.append((max(1, round((area / aspect) ** 0.5)), max(1, round((area * aspect) ** 0.5))))
    return fixed + rand


@pytest.mark.parametrize("mode", ["16x", "4x"])
def test_count_from_the_size_equals_the_processed_count(mode: str) -> None:
    for height_px, width_px in sizes_px():
        processed = process_image(Image.new("RGB", (width_px, height_px), "teal"), mode)
        assert piece_grids((height_px, width_px), mode) == processed.grid_hw, (height_px, width_px)
        assert num_visual_tokens((height_px, width_px), mode) == processed.total_tokens


def encoded(img: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def with_orientation(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def png_chunks(data: bytes) -> list[bytes]:
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        chunks.append(data[pos : pos + 12 + length])
        pos += 12 + length
    return chunks


# stored 1624 wide, 570 high: 317 visual tokens in 16x mode, 322 turned upright (1231 / 1307 in 4x)
STORED = Image.new("RGB", (1624, 570), "olive")


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "PNG"])
def test_header_count_follows_exif_orientation(fmt: str, orientation: int) -> None:
    """A photo stored on its side with orientation 6 or 8 is processed turned upright: the header
    count reads the orientation without decoding, and equals the decoded image's count."""
    data = encoded(STORED, fmt, exif=with_orientation(orientation))
    opened = open_image(data)
    assert len(opened.sizes_px) == 1
    for mode in ("16x", "4x"):
        expected = process_image(decode_image(data), mode).total_tokens
        assert header_visual_tokens(opened, mode) == expected
    assert num_visual_tokens((570, 1624)) != num_visual_tokens((1624, 570))  # it matters here


def test_png_exif_after_the_pixels_gives_a_lower_bound() -> None:
    """Pillow reads a PNG's chunks after IDAT only while decoding: before it, both orientations
    are possible and the smaller count is used (a refusal from it is always right; the exact
    count is checked once decoded)."""
    chunks = png_chunks(encoded(STORED, "PNG", exif=with_orientation(6)))
    exif = next(c for c in chunks if c[4:8] == b"eXIf")
    late = b"\x89PNG\r\n\x1a\n" + b"".join(
        [c for c in chunks if c != exif][:-1] + [exif, chunks[-1]]
    )
    opened = open_image(late)
    assert opened.sizes_px == ((570, 1624), (1624, 570))
    for mode in ("16x", "4x"):
        exact = process_image(decode_image(late), mode).total_tokens
        assert exact == num_visual_tokens((1624, 570), mode)  # decoded upright
        assert header_visual_tokens(opened, mode) == min(
            exact, num_visual_tokens((570, 1624), mode)
        )
    assert open_image(encoded(STORED, "PNG")).sizes_px == ((570, 1624),)  # no EXIF: exact


def test_opening_a_source_decodes_nothing(monkeypatch) -> None:
    from PIL import ImageFile

    def no_decode(self):
        raise AssertionError("decoded")

    data = encoded(Image.new("RGB", (6000, 6000), "white"), "PNG")
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    opened = open_image_source(data, ImageLimits())
    assert header_visual_tokens(opened, "16x") == num_visual_tokens((6000, 6000)) == 640
    with pytest.raises(RequestError, match="pixels"):
        open_image_source(data, ImageLimits(max_image_pixels=35_000_000))
