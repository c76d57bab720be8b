"""`deltaserve trace`: our vision path against transformers', stage by stage, on random pixels.

Both sides load the same checkpoint tensors in fp32; each stage row gives max-abs and relative-L2
errors (||ours - ref|| / ||ref||), so the first stage that drifts points at the faulty block.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.multimodal.loader import load_vision_model
from deltaserve.multimodal.tower import GridSizes, VisionModel, check_grid


def random_pixels(grid_hw: GridSizes, patch_px: int, seed: int, channels: int = 3) -> torch.Tensor:
    """[1, channels, P, L*P] uniform in [-1, 1] (the processor's range after mean/std 0.5)."""
    num_patches = sum(int(h) * int(w) for h, w in grid_hw)
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(1, channels, patch_px, num_patches * patch_px, generator=gen) * 2 - 1


def compare_stages(
    ours: list[tuple[str, torch.Tensor]], reference: list[tuple[str, torch.Tensor]]
) -> list[dict]:
    """One row per stage: name, shape, max_abs, rel. Names and shapes must line up."""
    names = [name for name, _ in ours]
    if names != [name for name, _ in reference]:
        raise AssertionError(f"stage lists differ: {names} vs {[n for n, _ in reference]}")
    rows = []
    for (name, mine), (_, ref) in zip(ours, reference, strict=True):
        if mine.shape != ref.shape:
            raise AssertionError(f"stage {name}: shape {list(mine.shape)} vs {list(ref.shape)}")
        diff = mine.double() - ref.double()
        rows.append({
            "name": name,
            "shape": list(mine.shape),
            "max_abs": float(diff.abs().max()),
            "rel": float(diff.norm() / ref.double().norm()),
        })
    return rows


def trace_pair(
    model: VisionModel, reference, pixel_values: torch.Tensor, grid_hw: GridSizes, mode: str
) -> list[dict]:
    """Run both sides on the same input and compare every stage."""
    from deltaserve.validate.vision_reference import reference_trace

    with torch.no_grad():
        ours = model.trace(pixel_values, grid_hw, mode)
    return compare_stages(ours, reference_trace(reference, pixel_values, grid_hw, mode))


def run_trace(
    model_dir: Path | str,
    grid_hw: tuple[int, int] | list[tuple[int, int]],
    mode: str = "16x",
    seed: int = 0,
) -> list[dict]:
    """Ours vs transformers on random pixels for one piece (h, w) or a list of pieces, in patches."""
    from deltaserve.validate.vision_reference import load_vision_reference

    pieces = [grid_hw] if isinstance(grid_hw[0], int) else list(grid_hw)
    grids = check_grid(pieces, mode)
    model = load_vision_model(model_dir, torch.float32)
    reference = load_vision_reference(model_dir, torch.float32)
    pixels = random_pixels(grids, model.cfg.patch_size_px, seed, model.cfg.num_channels)
    return trace_pair(model, reference, pixels, grids, mode)


def run_image_trace(model_dir: Path | str, image_path: Path | str, mode: str = "16x") -> list[dict]:
    """Ours vs transformers on a real image file, through our processor (every piece: overview
    and slices, packed as the reference packs them)."""
    from deltaserve.errors import RequestError
    from deltaserve.multimodal.image import decode_image
    from deltaserve.multimodal.processor import process_image
    from deltaserve.validate.vision_reference import load_vision_reference

    try:
        data = Path(image_path).read_bytes()
    except OSError as exc:
        raise RequestError(f"cannot read image {image_path}: {exc.strerror or exc}") from exc
    processed = process_image(decode_image(data), mode)
    model = load_vision_model(model_dir, torch.float32)
    reference = load_vision_reference(model_dir, torch.float32)
    return trace_pair(model, reference, processed.pixel_values, list(processed.grid_hw), mode)


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, one stage per line."""
    lines = [f"{'stage':<16} {'shape':<14} {'max_abs':>10} {'rel':>10}"]
    for row in rows:
        shape = "x".join(str(d) for d in row["shape"])
        lines.append(f"{row['name']:<16} {shape:<14} {row['max_abs']:>10.3e} {row['rel']:>10.3e}")
    return "\n".join(lines)
