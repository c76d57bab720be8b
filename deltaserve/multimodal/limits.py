"""Per-request image bounds: torch- and PIL-free, so the command line can parse without them."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Per request; a 448x448 image is 64 visual tokens in 16x mode, overview + 9 slices 640."""

    max_images: int = 8
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_visual_tokens: int = 4096
