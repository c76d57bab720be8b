"""MiniCPM-V-4.6 image processor and prompt layout (formats.md 3.4 and 3.5).

One RGB image -> an overview piece plus, for large images, a rows x cols grid of slices, each
resized (PIL bicubic on uint8, as transformers' PIL processor does), scaled to [-1, 1] and packed
patch by patch into the tower's strip. The prompt gets one `<|image_pad|>` per language-model token
of every piece, counted with the tower's own formula (`config.num_piece_tokens`).

Sizes named `*_px` are pixels; grids `(h, w)` are in 14-pixel patches; pairs are (height, width).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from deltaserve.errors import RequestError
from deltaserve.multimodal.config import DOWNSAMPLE_MODES, MERGE_SIDE_PATCHES, num_piece_tokens
from deltaserve.multimodal.image import to_rgb

PATCH_PX = 14
DEFAULT_SCALE_RESOLUTION_PX = 448
DEFAULT_MAX_SLICE_NUMS = 9
IMAGE_PAD = "<|image_pad|>"
IMAGE_START, IMAGE_END = "<image>", "</image>"
SLICE_START, SLICE_END = "<slice>", "</slice>"
IMAGE_ID_START, IMAGE_ID_END = "<image_id>", "</image_id>"
# rescale 1/255 then normalize with mean = std = 0.5 (the processor's IMAGENET_STANDARD_*)
_RESCALE = 1 / 255
_MEAN = np.float32(0.5)
_STD = np.float32(0.5)
# Cap on all pieces' pixels, in units of scale_resolution^2. In a random search over sizes up to
# 40 MP: aspect ratios up to 1:100 stay under 12 (overview + 9 slices, sides rounded up), up to
# 1:1000 under 16, and 32 is first passed near 1:4000; a 3850000x1 line would need 490 (1.2 GB).
MAX_PIECES_AREA = 32

SizePx = tuple[float, float]  # (height, width); fractional only for a slice cell of get_refine_size


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image's pieces for the tower, in order: the overview, then slices row-major."""

    pixel_values: torch.Tensor  # [1, 3, PATCH_PX, L * PATCH_PX] float32, L = sum(h * w)
    grid_hw: tuple[tuple[int, int], ...]  # (h, w) in patches per piece
    slice_grid: tuple[int, int] | None  # (rows, cols) of slices; None = overview only
    num_tokens: tuple[int, ...]  # language-model tokens per piece
    mode: str  # downsample mode the sizes were rounded for ("16x" or "4x")
    # blake2b of the resized uint8 pixels the pieces come from (b"": hash pixel_values instead)
    content_digest: bytes = b""

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


def ensure_divide(length_px: float, divisor_px: int) -> int:
    """Nearest positive multiple of divisor_px; Python's round, so exact halves go to even."""
    return max(round(length_px / divisor_px) * divisor_px, divisor_px)


def find_best_resize(
    size_px: SizePx, mode: str, scale_resolution_px: int, allow_upscale: bool
) -> tuple[int, int]:
    """Target (h, w) of a piece: about scale_resolution_px^2 pixels at the same aspect ratio when
    larger (or when upscaling is allowed), sides rounded to the mode's merge multiple."""
    height_px, width_px = size_px
    if height_px * width_px > scale_resolution_px * scale_resolution_px or allow_upscale:
        aspect = width_px / height_px
        height_px = int(scale_resolution_px / math.sqrt(aspect))
        width_px = int(height_px * aspect)
    multiple_px = PATCH_PX * MERGE_SIDE_PATCHES[mode]
    return ensure_divide(height_px, multiple_px), ensure_divide(width_px, multiple_px)


def get_sliced_grid(
    size_px: tuple[int, int], max_slice_nums: int, scale_resolution_px: int
) -> tuple[int, int] | None:
    """(rows, cols) of slices for an image of size_px, or None when it fits one piece.

    Slice counts around area / scale_resolution_px^2 are tried; the grid whose cols/rows ratio is
    closest to the image's in log space wins, ties going to more rows (the reference's rule).
    """
    height_px, width_px = size_px
    log_aspect = math.log(width_px / height_px)
    area_ratio = width_px * height_px / (scale_resolution_px * scale_resolution_px)
    multiple = min(math.ceil(area_ratio), max_slice_nums)
    if multiple <= 1:
        return None
    best, best_error = (1, 1), float("inf")
    for num_slices in (multiple - 1, multiple, multiple + 1):
        if num_slices == 1 or num_slices > max_slice_nums:
            continue
        for num_rows in range(1, num_slices + 1):
            if num_slices % num_rows:
                continue
            num_cols = num_slices // num_rows
            error = abs(log_aspect - math.log(num_cols / num_rows))
            if error < best_error or (error == best_error and num_rows > best[0]):
                best, best_error = (num_rows, num_cols), error
    return best


def get_refine_size(
    size_px: tuple[int, int], slice_grid: tuple[int, int], mode: str, scale_resolution_px: int
) -> tuple[int, int]:
    """(h, w) the whole image is resized to before it is cut into equal slices.

    NOTE: formats.md 3.4 sizes a cell from (h / rows, w / cols); the reference first rounds each
    side to a multiple of the grid (ensure_divide), and the cell is sized from that.
    """
    height_px, width_px = size_px
    num_rows, num_cols = slice_grid
    grid_height_px = ensure_divide(height_px, num_rows)
    grid_width_px = ensure_divide(width_px, num_cols)
    cell_h_px, cell_w_px = find_best_resize(
        (grid_height_px / num_rows, grid_width_px / num_cols),
        mode,
        scale_resolution_px,
        allow_upscale=True,
    )
    return cell_h_px * num_rows, cell_w_px * num_cols


def _resized_pixels(rgb: Image.Image, size_px: tuple[int, int], digest=None) -> np.ndarray:
    """[3, h, w] float32 in [-1, 1]: bicubic on uint8, then float64 * 1/255 -> float32 and
    (x - 0.5) / 0.5 in float32, the reference's exact dtypes (so results match bit for bit).
    digest (hashlib): fed the uint8 pixels, which the float ones are a function of (4x fewer
    bytes to hash than the result)."""
    height_px, width_px = size_px
    resized = np.asarray(rgb.resize((width_px, height_px), Image.Resampling.BICUBIC))
    if digest is not None:
        digest.update(repr(resized.shape).encode())
        digest.update(np.ascontiguousarray(resized).data)
    scaled = (resized.astype(np.float64) * _RESCALE).astype(np.float32)
    return ((scaled - _MEAN) / _STD).transpose(2, 0, 1)


def _patchify(chw: np.ndarray) -> np.ndarray:
    """[C, H, W] -> [C, P, (H/P * W/P) * P]: patches row-major, each patch's rows stacked."""
    num_channels, height_px, width_px = chw.shape
    grid_h, grid_w = height_px // PATCH_PX, width_px // PATCH_PX
    patches = chw.reshape(num_channels, grid_h, PATCH_PX, grid_w, PATCH_PX)
    return patches.transpose(0, 2, 1, 3, 4).reshape(num_channels, PATCH_PX, -1)


def _check_options(mode: str, max_slice_nums: int, scale_resolution: int) -> None:
    if mode not in DOWNSAMPLE_MODES:
        raise RequestError(f"downsample mode '{mode}' is not one of {', '.join(DOWNSAMPLE_MODES)}")
    if max_slice_nums < 1:
        raise RequestError(f"max_slice_nums must be at least 1, got {max_slice_nums}")
    if scale_resolution < PATCH_PX:
        raise RequestError(
            f"scale_resolution must be at least {PATCH_PX} px, got {scale_resolution}"
        )


def plan_pieces(
    size_px: tuple[int, int],
    mode: str,
    max_slice_nums: int,
    scale_resolution_px: int,
    slice_mode: bool,
) -> tuple[tuple[int, int] | None, tuple[int, int], tuple[int, int] | None]:
    """(slice_grid, overview (h, w), refined whole-image (h, w) or None), from arithmetic alone.

    Refuses images whose pieces would exceed MAX_PIECES_AREA scale_resolution^2 in total: only
    aspect ratios beyond about 1:4000 get there (the reference would resize those to gigabytes).
    """
    slice_grid = None
    if slice_mode:
        slice_grid = get_sliced_grid(size_px, max_slice_nums, scale_resolution_px)
    # the overview may only grow when it is the sole piece (no slices carry the detail)
    upscale = slice_grid is None
    overview_px = find_best_resize(size_px, mode, scale_resolution_px, allow_upscale=upscale)
    refine_px = None
    if slice_grid is not None:
        refine_px = get_refine_size(size_px, slice_grid, mode, scale_resolution_px)
    area_px = overview_px[0] * overview_px[1] + (refine_px[0] * refine_px[1] if refine_px else 0)
    if area_px > MAX_PIECES_AREA * scale_resolution_px**2:
        height_px, width_px = size_px
        ratio = max(height_px, width_px) / min(height_px, width_px)
        raise RequestError(
            f"image of {width_px}x{height_px} pixels has an extreme aspect ratio (1:{ratio:.0f}); "
            f"its pieces would need {area_px} pixels, over the limit of "
            f"{MAX_PIECES_AREA * scale_resolution_px**2}"
        )
    return slice_grid, overview_px, refine_px


def piece_grids(
    size_px: tuple[int, int],
    mode: str = "16x",
    max_slice_nums: int = DEFAULT_MAX_SLICE_NUMS,
    scale_resolution: int = DEFAULT_SCALE_RESOLUTION_PX,
    slice_mode: bool = True,
) -> tuple[tuple[int, int], ...]:
    """(h, w) in patches of each piece process_image makes of an image of size_px (h, w), from
    its size alone: what the limits are checked against before any pixel is decoded."""
    _check_options(mode, max_slice_nums, scale_resolution)
    slice_grid, overview_px, refine_px = plan_pieces(
        size_px, mode, max_slice_nums, scale_resolution, slice_mode
    )
    grids = [(overview_px[0] // PATCH_PX, overview_px[1] // PATCH_PX)]
    if slice_grid is not None and refine_px is not None:
        num_rows, num_cols = slice_grid
        cell = (refine_px[0] // num_rows // PATCH_PX, refine_px[1] // num_cols // PATCH_PX)
        grids += [cell] * (num_rows * num_cols)
    return tuple(grids)


def num_visual_tokens(size_px: tuple[int, int], mode: str = "16x", **options) -> int:
    """Language-model tokens of an image of size_px (h, w); options as process_image's."""
    return sum(num_piece_tokens(h, w, mode) for h, w in piece_grids(size_px, mode, **options))


def process_image(
    img: Image.Image,
    mode: str = "16x",
    max_slice_nums: int = DEFAULT_MAX_SLICE_NUMS,
    scale_resolution: int = DEFAULT_SCALE_RESOLUTION_PX,
    slice_mode: bool = True,
) -> ProcessedImage:
    """An image (any PIL mode; see `image.to_rgb`) -> its packed pieces.

    Arguments keep the reference's names; scale_resolution is the side, in px, of the square
    whose area a piece is sized to (448 -> 32x32 patches).
    """
    _check_options(mode, max_slice_nums, scale_resolution)
    if img.width <= 0 or img.height <= 0:
        raise RequestError(f"image has zero size ({img.width}x{img.height} pixels)")
    size_px = (img.height, img.width)
    slice_grid, overview_px, refine_px = plan_pieces(
        size_px, mode, max_slice_nums, scale_resolution, slice_mode
    )
    rgb = to_rgb(img)
    digest = hashlib.blake2b(digest_size=16)
    pieces = [_resized_pixels(rgb, overview_px, digest)]
    if slice_grid is not None and refine_px is not None:
        refined = _resized_pixels(rgb, refine_px, digest)
        num_rows, num_cols = slice_grid
        cell_h_px, cell_w_px = refine_px[0] // num_rows, refine_px[1] // num_cols
        for row in range(num_rows):
            for col in range(num_cols):
                top_px, left_px = row * cell_h_px, col * cell_w_px
                cell = refined[:, top_px : top_px + cell_h_px, left_px : left_px + cell_w_px]
                pieces.append(cell)
    grid_hw = tuple((p.shape[1] // PATCH_PX, p.shape[2] // PATCH_PX) for p in pieces)
    strip = np.concatenate([_patchify(p) for p in pieces], axis=-1)
    return ProcessedImage(
        pixel_values=torch.from_numpy(np.ascontiguousarray(strip))[None],
        grid_hw=grid_hw,
        slice_grid=slice_grid,
        num_tokens=tuple(num_piece_tokens(h, w, mode) for h, w in grid_hw),
        mode=mode,
        content_digest=digest.digest(),
    )


def pack_images(images: Sequence[ProcessedImage]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Several images as one tower input: strips concatenated on the last axis (as the reference
    batches them), grid_hw in the same order. All must share one downsample mode."""
    if not images:
        raise RequestError("no images to pack")
    modes = {image.mode for image in images}
    if len(modes) > 1:
        raise RequestError(f"images processed for different downsample modes: {sorted(modes)}")
    pixel_values = torch.cat([image.pixel_values for image in images], dim=-1)
    return pixel_values, [hw for image in images for hw in image.grid_hw]


def image_placeholder_text(
    processed: ProcessedImage, image_index: int, pad_token: str = IMAGE_PAD
) -> str:
    """The text standing for one image (formats.md 3.5): its id, the overview in <image>, then
    slice rows of <slice> pieces joined by newlines, one pad_token per language-model token."""
    overview_tokens, *slice_tokens = processed.num_tokens
    text = f"{IMAGE_ID_START}{image_index}{IMAGE_ID_END}"
    text += IMAGE_START + pad_token * overview_tokens + IMAGE_END
    if processed.slice_grid is not None:
        num_rows, num_cols = processed.slice_grid
        # each slice carries its own count: the reference does not assume equal slices
        pieces = [SLICE_START + pad_token * n + SLICE_END for n in slice_tokens]
        rows = ["".join(pieces[r * num_cols : (r + 1) * num_cols]) for r in range(num_rows)]
        text += "\n".join(rows)
    return text


def expand_image_placeholders(
    text: str, images: Sequence[ProcessedImage], pad_token: str = IMAGE_PAD
) -> str:
    """Replace the k-th pad_token of a chat text by image k's placeholder text (ids from 0 within
    this text, as the reference's `_prepend_local_ids` numbers them per prompt)."""
    parts = text.split(pad_token)
    num_placeholders = len(parts) - 1
    if num_placeholders != len(images):
        raise RequestError(
            f"the prompt has {num_placeholders} image placeholders ({pad_token}) but "
            f"{len(images)} images were given"
        )
    out = [parts[0]]
    for index, (image, after) in enumerate(zip(images, parts[1:], strict=True)):
        out.append(image_placeholder_text(image, index, pad_token))
        out.append(after)
    return "".join(out)
