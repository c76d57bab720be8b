"""The MiniCPM-V-4.6 vision path's time: our tower + mergers against transformers' (its default
sdpa attention) on the same real-shape random weights, in the same run, per image:

    python -m deltaserve.bench.vision [--device cpu|cuda] [--dtype float32|bfloat16] --out JSON

Images: one 448x448 piece, and an 896x672 image the processor cuts into an overview + 2x2 slices
(5 pieces). Each figure is the median of --repeats calls after one warm-up; outputs are checked to
agree (relative L2) so a fast wrong path cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _images():
    from PIL import Image

    from deltaserve.multimodal.processor import process_image

    rng = np.random.default_rng(0)
    out = {}
    for name, (w_px, h_px) in (("448x448", (448, 448)), ("896x672 (5 pieces)", (896, 672))):
        img = Image.fromarray(rng.integers(0, 256, (h_px, w_px, 3), dtype=np.uint8))
        out[name] = process_image(img)
    return out


def _time_s(fn, repeats: int, device: str) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(device: str, dtype_name: str, repeats: int) -> dict:
    from deltaserve.bench.record import device_info, flags, git_commit
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.synthetic import write_vision_checkpoint
    from deltaserve.multimodal.loader import load_vision_model
    from deltaserve.validate.vision_reference import load_vision_reference, reference_forward

    dtype = DTYPES[dtype_name]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_vision_checkpoint(Path(tmp) / "v", preset("minicpm-v-4.6").config)
        ours = load_vision_model(model_dir, dtype, device)
        ref = load_vision_reference(model_dir, dtype, "sdpa", device)
    rows = []
    for name, img in _images().items():
        pixels = img.pixel_values.to(device, dtype)
        with torch.inference_mode():
            ours_s, mine = _time_s(lambda p=pixels, g=img.grid_hw: ours(p, list(g), "16x"),
                                   repeats, device)
            ref_s, theirs = _time_s(
                lambda p=pixels, g=img.grid_hw: reference_forward(ref, p, list(g), "16x"),
                repeats, device)
        rel = ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item()
        rows.append({"image": name, "pieces": len(img.grid_hw), "tokens": img.total_tokens,
                     "ours_ms": ours_s * 1e3, "transformers_ms": ref_s * 1e3,
                     "speedup": ref_s / ours_s, "output_rel_l2": rel})
        if device == "cuda":  # kernel time vs wall time: is the tower GPU- or host-bound?
            from deltaserve.bench.attribution import profile_call

            with torch.inference_mode():
                rows[-1]["attribution"] = profile_call(
                    lambda p=pixels, g=img.grid_hw: ours(p, list(g), "16x"))
        print(f"{name:<20} ours {ours_s * 1e3:9.1f} ms  transformers {ref_s * 1e3:9.1f} ms  "
              f"x{ref_s / ours_s:.2f}  rel {rel:.1e}", flush=True)
    return {"kind": "vision-tower", "git_commit": git_commit(), "device": device_info(device),
            "dtype": dtype_name, "flags": flags(), "repeats": repeats,
            "threads": torch.get_num_threads(), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    record = run(args.device, args.dtype, args.repeats)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
