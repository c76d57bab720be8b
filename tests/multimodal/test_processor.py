"""The image processor and prompt layout against transformers' MiniCPM-V-4.6 (PIL backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from deltaserve.checkpoint.default import default_model_dir
from deltaserve.errors import RequestError
from deltaserve.multimodal import processor as ours
from deltaserve.multimodal.processor import (
    IMAGE_PAD,
    ensure_divide,
    expand_image_placeholders,
    image_placeholder_text,
    pack_images,
    process_image,
)

MODES = ("16x", "4x")
# (width, height) in px: tiny (upscaled), one exact piece, wide and tall panoramas (1x4 / 4x1
# slices), an overview + 2x2 slices (the "5 slices"), a 4:3 photo (2x3 slices), a 1:500 strip
SIZES_WH = [(20, 30), (448, 448), (1600, 300), (300, 1600), (896, 672), (1280, 960), (5000, 10)]
EXPECTED_GRIDS = {(896, 672): (2, 2), (1600, 300): (1, 4), (300, 1600): (4, 1), (1280, 960): (2, 3)}


def random_image(width_px: int, height_px: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode)  # "RGB", "RGBA", "L"
    pixels = rng.integers(0, 256, (height_px, width_px, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels)


@pytest.fixture(scope="module")
def reference():
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessorPil,
    )

    return MiniCPMV4_6ImageProcessorPil()


def assert_same_as_reference(reference, images: list[Image.Image], mode: str) -> float:
    """Our pieces equal the reference's for these images (processed as one batch); max abs error."""
    mine = [process_image(img, mode) for img in images]
    ref = reference(images, downsample_mode=mode, return_tensors=None)
    pixel_values, grid_hw = pack_images(mine)
    assert [list(hw) for hw in grid_hw] == ref["target_sizes"].tolist()
    assert [list(m.slice_grid or (0, 0)) for m in mine] == [list(g) for g in ref["grids"]]
    assert [len(m.grid_hw) for m in mine] == ref["num_patches_per_image"]
    expected = np.asarray(ref["pixel_values"])
    assert pixel_values.dtype == torch.float32 and tuple(pixel_values.shape) == expected.shape
    max_abs = float(np.abs(pixel_values.numpy() - expected).max())
    assert max_abs == 0.0, max_abs  # same PIL resize, same float64 -> float32 steps
    return max_abs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size_wh", SIZES_WH, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pixels_equal_reference(reference, size_wh, mode) -> None:
    image = random_image(*size_wh, seed=sum(size_wh))
    assert_same_as_reference(reference, [image], mode)
    processed = process_image(image, mode)
    assert processed.slice_grid == EXPECTED_GRIDS.get(size_wh)
    if size_wh == (896, 672):
        assert len(processed.grid_hw) == 5  # overview + 2x2 slices


@pytest.mark.parametrize("mode", MODES)
def test_batch_of_images_equals_reference(reference, mode) -> None:
    images = [random_image(1600, 300, 1), random_image(20, 30, 2), random_image(896, 672, 3)]
    assert_same_as_reference(reference, images, mode)


@pytest.mark.parametrize("mode_name", ["RGBA", "L"])
def test_alpha_and_gray_equal_reference(reference, mode_name) -> None:
    """Our RGB conversion is the reference's (alpha composited on white, gray replicated)."""
    assert_same_as_reference(reference, [random_image(200, 120, 7, mode_name)], "16x")


def test_size_rules_equal_reference(reference) -> None:
    """find_best_resize / get_sliced_grid / get_refine_size on 1500 random sizes and both modes."""
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 3000, (1500, 2)).tolist() + [[1, 2999], [2999, 1], [448, 448]]
    for mode in MODES:
        for h, w in sizes:
            size = (h, w)
            grid = ours.get_sliced_grid(size, 9, 448)
            ref_grid = reference.get_sliced_grid(size, 9, 448)
            assert grid == (None if ref_grid is None else tuple(ref_grid)), size
            upscale = grid is None
            assert ours.find_best_resize(size, mode, 448, upscale) == reference.find_best_resize(
                size, 448, 14, mode, allow_upscale=upscale
            ), (size, mode)
            if grid is not None:
                assert ours.get_refine_size(size, grid, mode, 448) == reference.get_refine_size(
                    size, list(grid), 448, 14, mode, allow_upscale=True
                ), (size, mode)


def test_ensure_divide_rounds_half_to_even() -> None:
    assert ensure_divide(84, 56) == 112  # 1.5 -> 2
    assert ensure_divide(140, 56) == 112  # 2.5 -> 2 (banker's rounding)
    assert ensure_divide(10, 56) == 56  # never below one multiple


def test_no_slice_mode_and_bad_options() -> None:
    image = random_image(1600, 300, 0)
    processed = process_image(image, slice_mode=False)
    assert processed.slice_grid is None and len(processed.grid_hw) == 1
    with pytest.raises(RequestError, match="downsample mode '8x'"):
        process_image(image, "8x")
    with pytest.raises(RequestError, match="max_slice_nums"):
        process_image(image, max_slice_nums=0)


def test_extreme_aspect_ratio_is_refused_before_resizing() -> None:
    """A 1.8 MP line would need ~1.2 GB of float32 pieces the reference's way."""
    line = Image.new("RGB", (1_800_000, 1))
    with pytest.raises(RequestError, match=r"extreme aspect ratio \(1:1800000\)"):
        process_image(line)


# The 4.6 tokenizer's multimodal tokens (formats.md 3.5), as its tokenizer_config declares them.
MULTIMODAL_TOKENS = {
    "image_token": IMAGE_PAD, "video_token": "<|video_pad|>",
    "image_start_token": "<image>", "image_end_token": "</image>",
    "slice_start_token": "<slice>", "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
}  # fmt: skip


@pytest.fixture(scope="module")
def reference_processor(reference):
    """transformers' MiniCPMV4_6Processor, unchanged but for one class check, over our shipped
    tokenizer with the 4.6 multimodal tokens added (read as tokenizer attributes, as from the real
    tokenizer_config). Returns (processor, tokenizer)."""
    from transformers import AutoTokenizer
    from transformers.models.minicpmv4_6.processing_minicpmv4_6 import MiniCPMV4_6Processor
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (
        MiniCPMV4_6VideoProcessor,
    )

    class Processor(MiniCPMV4_6Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            # This check looks the video processor up in a registry that is a stub without
            # torchvision (not installed); the video processor itself is never called here.
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(
        default_model_dir(), extra_special_tokens=MULTIMODAL_TOKENS
    )
    return Processor(reference, MiniCPMV4_6VideoProcessor(), tokenizer), tokenizer


CHAT = (
    "<|im_start|>user\nCompare <|image_pad|> with\n<|image_pad|>\nplease.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.mark.parametrize("mode", MODES)
def test_expanded_prompt_equals_reference(reference_processor, mode) -> None:
    processor, tokenizer = reference_processor
    images = [random_image(1600, 300, 11), random_image(20, 30, 12)]
    out = processor(
        images=images,
        text=[CHAT],
        downsample_mode=mode,
        return_text_replacement_offsets=True,
        return_tensors=None,
    )
    # the reference's expanded text, rebuilt from its replacement offsets
    expected, last = [], 0
    for item in out["text_replacement_offsets"][0]:
        start, end = item["span"]
        expected += [CHAT[last:start], item["replacement"]]
        last = end
    expected = "".join(expected) + CHAT[last:]

    mine = expand_image_placeholders(CHAT, [process_image(img, mode) for img in images])
    assert mine == expected
    assert tokenizer(mine)["input_ids"] == out["input_ids"][0]
    assert "</image><slice>" in mine and "<image_id>1</image_id>" in mine


def test_placeholder_layout() -> None:
    processed = process_image(random_image(896, 672, 0), "16x")  # overview + 2x2, 28x36 each
    pad = "P"
    piece = pad * 63  # 28 * 36 / 16
    expected = (
        f"<image_id>3</image_id><image>{piece}</image>"
        f"<slice>{piece}</slice><slice>{piece}</slice>\n<slice>{piece}</slice><slice>{piece}</slice>"
    )
    assert image_placeholder_text(processed, 3, pad_token=pad) == expected
    with pytest.raises(RequestError, match="2 image placeholders .* 1 images"):
        expand_image_placeholders(f"{IMAGE_PAD}{IMAGE_PAD}", [processed])


@pytest.mark.parametrize("mode", MODES)
def test_pad_count_equals_tower_rows(reduced_model, mode) -> None:
    """Placeholders by construction == the tower's output rows on the processed pixels."""
    # a 224 px piece side keeps the tower run short; slices of uneven (h, w) still arise
    sliced = process_image(random_image(896, 672, 5), mode, scale_resolution=224)
    images = [sliced, process_image(random_image(60, 40, 6), mode)]
    assert sliced.slice_grid is not None
    pixel_values, grid_hw = pack_images(images)
    features = reduced_model(pixel_values, grid_hw, mode)
    prompt = expand_image_placeholders(f"a {IMAGE_PAD} b {IMAGE_PAD}", images)
    assert features.shape[0] == prompt.count(IMAGE_PAD) == sum(m.total_tokens for m in images)
