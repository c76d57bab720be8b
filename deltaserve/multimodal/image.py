"""User image bytes -> an RGB PIL image, safely: every failure is a `RequestError` (a 400).

Order of checks, cheapest first: encoded size, format (only PNG, JPEG, WEBP, GIF, BMP are parsed:
Pillow's other plugins never see user bytes), declared pixel count (read from the header by
`Image.open`, before any pixel is decoded), then the decode itself. `open_image` stops before the
decode, with the size the image will have once oriented, so that a caller can check every image
of a request (e.g. its visual tokens) before decoding any.

Decisions (formats.md 3.4 takes an RGB PIL image; these are the steps before it):
- Animated GIF / WEBP / APNG: the first frame, as transformers' processors do with a PIL image
  (`np.array(img)` and `convert` read the current frame, frame 0 after `open`); other frames are
  never decoded, so their number costs nothing.
- EXIF orientation is applied (`ImageOps.exif_transpose`), as transformers' `load_image` does for
  URLs, paths and base64 (the reference's own bytes -> image path); an unreadable EXIF block leaves
  the image as stored instead of failing the request.
- RGB conversion is the image processor's (`convert_to_rgb`): anything with an alpha band or a
  transparency key is composited onto white, everything else is `convert("RGB")` (CMYK naively,
  palettes, grayscale). Exception: 16-bit grayscale (`I;16*`), which `convert` clips to 0/255
  (all but the darkest 1/257 of the range turns white); we scale it by 255/65535 instead.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
from typing import NamedTuple

import numpy as np
from PIL import ExifTags, Image, ImageOps

from deltaserve.errors import RequestError
from deltaserve.multimodal.limits import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS

# Pillow plugin ids we let parse user bytes. MPO (multi-picture JPEG, written by many phone
# cameras) is what the JPEG plugin returns for such files; its first picture is a plain JPEG.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DECODED_FORMATS = (*ALLOWED_FORMATS, "MPO")
# Media types a data: URL may declare (image/jpg is not registered but clients send it).
ALLOWED_MEDIA_TYPES = (
    "image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp"
)
_GRAY16_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
# Leading bytes of common formats we refuse, only to name them in the error message.
_REFUSED_SIGNATURES = (
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"%PDF", "PDF"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x01\x00", "ICO"),
)
_HEIF_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF", b"avif": "AVIF", b"avis": "AVIF"}
_ALLOWED_TEXT = ", ".join(ALLOWED_FORMATS)
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # exif_transpose swaps width and height for these


class OpenedImage(NamedTuple):
    """An image with only its header read and checked: no pixel decoded yet."""

    image: Image.Image
    # (height, width) once decoded: one size, or both orientations where only decoding can tell
    sizes_px: tuple[tuple[int, int], ...]


def decode_image(
    data: bytes,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Image.Image:
    """Encoded image bytes -> a loaded RGB image (first frame, EXIF orientation applied)."""
    return decode_opened(open_image(data, max_bytes, max_pixels).image)


def open_image(
    data: bytes,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> OpenedImage:
    """Encoded image bytes -> the image with its header read: size, format and pixel count
    checked, the size after EXIF orientation known, no pixel decoded (`decode_opened` does that).

    NOTE: Pillow's own guard (`Image.MAX_IMAGE_PIXELS`) still refuses more than twice its limit
    (~179 MP) inside `Image.open`, so `max_pixels` above that has no effect.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RequestError(f"image data must be bytes, got {type(data).__name__}")
    num_bytes = len(data)
    if num_bytes == 0:
        raise RequestError("image data is empty (0 bytes)")
    if num_bytes > max_bytes:
        raise RequestError(f"image data is {num_bytes} bytes; the limit is {max_bytes} bytes")
    data = bytes(data)
    img = _open(data, max_pixels)
    return OpenedImage(img, _oriented_sizes(img, data))


def decode_opened(img: Image.Image) -> Image.Image:
    """An opened image -> a loaded RGB image (first frame, EXIF orientation applied)."""
    _load(img)
    return to_rgb(_apply_exif_orientation(img))


def _oriented_sizes(img: Image.Image, data: bytes) -> tuple[tuple[int, int], ...]:
    """(height, width) after `_apply_exif_orientation`, from the metadata before the pixels."""
    width_px, height_px = img.size
    both = ((height_px, width_px), (width_px, height_px))
    if img.format == "PNG" and _png_metadata_after_pixels(data):
        return both  # Pillow reads those chunks (EXIF, XMP) only while decoding
    try:
        # Image's getexif reads img.info alone; PngImageFile's would decode the pixels first
        orientation = Image.Image.getexif(img).get(ExifTags.Base.Orientation, 1)
    except Exception:  # a malformed EXIF block: decoding keeps the pixels as stored (or not)
        return both
    return both[1:] if orientation in _TRANSPOSING_ORIENTATIONS else both[:1]


def _png_metadata_after_pixels(data: bytes) -> bool:
    """Whether a chunk that may hold EXIF or XMP follows the first IDAT (chunk headers only)."""
    pos, seen_pixels = 8, False
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IEND":
            return False
        seen_pixels = seen_pixels or kind == b"IDAT"
        if seen_pixels and kind in (b"eXIf", b"tEXt", b"zTXt", b"iTXt"):
            return True
        pos += 12 + length  # length, type, body, CRC
    return False


def decode_data_url(
    url: str,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Image.Image:
    """A `data:image/...;base64,...` URL -> a loaded RGB image (see `decode_image`)."""
    return decode_image(parse_data_url(url, max_bytes), max_bytes, max_pixels)


def parse_data_url(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a base64 `data:` URL whose media type is an allowed image type (RFC 2397).

    The declared type only gates the request; the bytes are decoded by their own signature.
    """
    if not isinstance(url, str):
        raise RequestError(f"image URL must be a string, got {type(url).__name__}")
    if url[:5].lower() != "data:":
        raise RequestError(
            f"image URL must be a data: URL (data:image/png;base64,...), got '{url[:32]}'"
        )
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise RequestError("data: URL has no ',' between its media type and its data")
    params = [p.strip() for p in header.split(";")]
    media_type = params[0].lower()
    if not media_type.startswith("image/"):
        shown = media_type or "none (text/plain)"
        raise RequestError(f"data: URL media type is {shown}; an image/* type is required")
    if media_type not in ALLOWED_MEDIA_TYPES:
        raise RequestError(
            f"data: URL media type {media_type} is not supported ({', '.join(ALLOWED_MEDIA_TYPES)})"
        )
    if "base64" not in (p.lower() for p in params[1:]):
        raise RequestError("data: URL must be base64-encoded (';base64,' before the data)")
    # Clients wrap long base64 at 76 columns; whitespace is not data, anything else must be.
    payload = re.sub(r"\s+", "", payload)
    if not payload:
        raise RequestError("data: URL carries no data after ','")
    # 4 base64 characters carry 3 bytes: refuse oversize input before allocating its decode.
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise RequestError(
            f"data: URL carries about {len(payload) // 4 * 3} bytes; the limit is {max_bytes} bytes"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"data: URL payload is not valid base64 ({exc})") from None


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB the way transformers' image processor does (see the module notes)."""
    if img.mode in _GRAY16_MODES:
        img = _gray16_to_gray8(img)
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Parse the header only (lazy `Image.open`) and check format and declared size."""
    try:
        img = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except Image.UnidentifiedImageError:
        raise RequestError(_unsupported_message(data)) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Warning: only raised when warnings are errors; otherwise our own check below refuses.
        raise RequestError(f"image is too large to decode: {exc}") from None
    except Exception as exc:  # Pillow's plugins raise many types for malformed headers
        detail = f"{type(exc).__name__}: {exc}"
        raise RequestError(f"image header is corrupt or truncated ({detail})") from None
    if img.format not in _DECODED_FORMATS:  # a plugin handing back another type: refuse it too
        raise RequestError(f"image format {img.format} is not supported ({_ALLOWED_TEXT})")
    width_px, height_px = img.size
    if width_px <= 0 or height_px <= 0:
        raise RequestError(f"image has zero size ({width_px}x{height_px} pixels)")
    num_pixels = width_px * height_px
    if num_pixels > max_pixels:
        raise RequestError(
            f"image is {width_px}x{height_px} = {num_pixels} pixels ({num_pixels / 1e6:.4g} MP); "
            f"the limit is {max_pixels} pixels ({max_pixels / 1e6:.4g} MP)"
        )
    return img


def _load(img: Image.Image) -> None:
    """Decode the first frame's pixels; truncated or corrupt data becomes a RequestError."""
    try:
        img.load()
    except Exception as exc:  # OSError (truncated), SyntaxError, zlib.error, struct.error, ...
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise RequestError(f"{img.format} image data is truncated or corrupt ({detail})") from None


def _apply_exif_orientation(img: Image.Image) -> Image.Image:
    try:
        rotated = ImageOps.exif_transpose(img)
    except Exception:  # a malformed EXIF block: keep the pixels as stored rather than fail
        return img
    return img if rotated is None else rotated


def _gray16_to_gray8(img: Image.Image) -> Image.Image:
    """16-bit grayscale -> 8-bit, rounding x * 255 / 65535 (PIL's convert would clip at 255)."""
    values = np.asarray(img).astype(np.uint32)
    gray8 = (values * 255 + 65535 // 2) // 65535
    return Image.fromarray(gray8.astype(np.uint8))


def _unsupported_message(data: bytes) -> str:
    """Name the format when we recognise it; say what is accepted either way."""
    kind = None
    for signature, name in _REFUSED_SIGNATURES:
        if data.startswith(signature):
            kind = name
    if data[4:8] == b"ftyp":
        kind = _HEIF_BRANDS.get(data[8:12], "ISO media (MP4/HEIF)")
    if kind is None and data.lstrip()[:1] == b"<":
        kind = "SVG/XML/HTML text"
    if kind is not None:
        return f"image format {kind} is not supported ({_ALLOWED_TEXT})"
    if data.startswith((b"\x89PNG", b"\xff\xd8", b"GIF8", b"BM", b"RIFF")):
        return f"image header is corrupt or truncated ({len(data)} bytes)"
    return f"data is not an image in a supported format ({_ALLOWED_TEXT})"
