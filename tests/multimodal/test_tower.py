"""The vision path against transformers' MiniCPM-V-4.6 tower + merger, stage by stage, in fp32."""

from __future__ import annotations

import time

import pytest
import torch

from deltaserve.errors import RequestError
from deltaserve.multimodal.trace import random_pixels, trace_pair
from tests.multimodal.conftest import (
    REDUCED_VISION,
    minicpm_config,
    write_vision_checkpoint,
)

STAGE_MAX_ABS = 1e-3
OUTPUT_REL = 1e-4
# measured ~6e-7 on every stage; 1e-5 still fails a tanh GELU in the projector (rel 1.8e-4)
STAGE_REL = 1e-5

CASES = [
    ([(32, 32)], "16x"),  # one 448x448 piece
    ([(32, 32)], "4x"),
    ([(28, 36)], "16x"),  # 392x504 px
    ([(28, 36)], "4x"),
    ([(32, 32), (28, 36)], "16x"),  # two pieces packed as the processor packs slices
    ([(32, 32), (28, 36)], "4x"),
]


def expected_stages(num_layers: int, insert_layer_id: int, mode: str) -> list[str]:
    layers = [f"layers.{i}" for i in range(num_layers)]
    if mode == "16x":
        layers.insert(insert_layer_id + 1, "vit_merger")
    return ["embeddings", *layers, "post_layernorm", "projector"]


@pytest.mark.parametrize(
    ("grid_hw", "mode"), CASES, ids=lambda v: v if isinstance(v, str) else "+".join(
        f"{h}x{w}" for h, w in v
    )
)
def test_stages_match_transformers(reduced_model, reduced_reference, grid_hw, mode) -> None:
    pixels = random_pixels(grid_hw, 14, seed=len(grid_hw))
    rows = trace_pair(reduced_model, reduced_reference, pixels, grid_hw, mode)
    cfg = reduced_model.cfg
    assert [r["name"] for r in rows] == expected_stages(
        cfg.num_hidden_layers, cfg.insert_layer_id, mode
    )
    tokens_per_patch = 16 if mode == "16x" else 4
    assert rows[-1]["shape"] == [sum(h * w for h, w in grid_hw) // tokens_per_patch, 32]
    for row in rows:
        assert row["max_abs"] <= STAGE_MAX_ABS, row
        assert row["rel"] <= STAGE_REL, row
    assert rows[-1]["rel"] <= OUTPUT_REL


def test_packed_pieces_equal_pieces_alone(reduced_model) -> None:
    """Attention and both mergers stay inside each piece: packing changes nothing."""
    grids = [(32, 32), (28, 36), (8, 12)]
    pixels = random_pixels(grids, 14, seed=7)
    with torch.no_grad():
        packed = reduced_model(pixels, grids, "16x")
        alone, start = [], 0
        for h, w in grids:
            strip = pixels[..., start * 14 : (start + h * w) * 14]
            alone.append(reduced_model(strip, [(h, w)], "16x"))
            start += h * w
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_forward_is_the_last_traced_stage(reduced_model) -> None:
    grids = torch.tensor([[16, 20]], dtype=torch.int32)  # target_sizes as the processor gives them
    pixels = random_pixels(grids.tolist(), 14, seed=3)
    with torch.no_grad():
        out = reduced_model(pixels[0], grids)  # unbatched strip, config's default mode (16x)
        stages = reduced_model.trace(pixels, grids, "16x")
    assert torch.equal(out, stages[-1][1])
    assert out.shape == (16 * 20 // 16, 32)


@pytest.mark.parametrize(
    ("grid_hw", "mode", "needle"),
    [
        ([(30, 32)], "16x", "multiple of 4"),
        ([(31, 32)], "4x", "multiple of 2"),
        ([], "16x", "no image pieces"),
        ([(32, 32)], "8x", "not one of"),
    ],
)
def test_bad_grid_is_a_clear_error(reduced_model, grid_hw, mode, needle) -> None:
    pixels = random_pixels(grid_hw or [(4, 4)], 14, seed=0)
    with pytest.raises(RequestError, match=needle):
        reduced_model(pixels, grid_hw, mode)


def test_pixels_not_matching_the_grid_are_a_clear_error(reduced_model) -> None:
    pixels = random_pixels([(8, 8)], 14, seed=0)
    with pytest.raises(RequestError, match=r"need \[1, 3, 14, 1344\]"):
        reduced_model(pixels, [(8, 12)], "16x")


@pytest.mark.slow
def test_real_shape_tower_matches_transformers(tmp_path) -> None:
    """1152 wide, 27 layers, window merger after layer 6; random weights, fp32, one 448px piece."""
    from deltaserve.multimodal.loader import load_vision_model
    from deltaserve.validate.vision_reference import load_vision_reference

    model_dir = write_vision_checkpoint(tmp_path / "real", minicpm_config())
    model = load_vision_model(model_dir, torch.float32)
    assert model.cfg.hidden_size == 1152 != REDUCED_VISION["hidden_size"]
    reference = load_vision_reference(model_dir, torch.float32)
    grid_hw = [(32, 32)]
    start = time.perf_counter()
    rows = trace_pair(model, reference, random_pixels(grid_hw, 14, seed=0), grid_hw, "16x")
    elapsed_s = time.perf_counter() - start
    assert len(rows) == 31
    worst = max(rows, key=lambda r: r["max_abs"])
    print(f"\nreal shape 448px 16x: output rel {rows[-1]['rel']:.2e}, worst stage "
          f"{worst['name']} max_abs {worst['max_abs']:.2e}, both sides {elapsed_s:.1f} s")
    assert rows[-1]["shape"] == [64, 1024]
    assert rows[-1]["rel"] <= OUTPUT_REL
    for row in rows:
        assert row["max_abs"] <= STAGE_MAX_ABS, row
