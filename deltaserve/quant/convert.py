"""`deltaserve quantize`: a checkpoint folder -> the same folder quantized in our format.

Every language-model Linear (packed projections quantized per checkpoint tensor) and the
embedding (the tied head reads it) are quantized where their input width is a multiple of the
group; everything else (norms, conv, A_log, dt_bias, MTP, vision) is copied unchanged, under the
original tensor names. config.json gains a `quantization` block.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.checkpoint.reader import TensorIndex, lm_name, read_config
from deltaserve.errors import CheckpointError, ConfigError
from deltaserve.progress import bar
from deltaserve.quant.gptq import gptq_quantize, inverse_factor
from deltaserve.quant.loading import module_checkpoint_names, quant_block
from deltaserve.quant.schemes import FORMATS, Scheme, quantize

SCALE_DTYPE = torch.float16


def quantizable_names(model_dir: Path) -> set[str]:
    """Our names (`model.layers.0.mlp.down_proj`) of the modules `quantize` packs."""
    from deltaserve.models.registry import text_config_for, text_model_class

    raw = read_config(model_dir)
    cfg = text_config_for(raw)
    with torch.device("meta"):
        model = text_model_class(raw["model_type"])(cfg, torch.bfloat16, torch.float32)
    return {n for _, names in module_checkpoint_names(model) for n in names}


def check_request(model_dir: Path, fmt: str, out_dir: Path, search: bool = True,
                  calibrated: bool = False, gptq: bool = False) -> tuple[Scheme, dict]:
    """(scheme, config.json) of a valid request, else a clear error before any work is done."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format '{fmt}' (choose {', '.join(FORMATS)})")
    scheme = FORMATS[fmt]
    if gptq and (scheme.kind != "affine" or not calibrated):
        raise ConfigError("the gptq encoder needs --format int4 and --calibration TEXT (its input "
                          "covariances come from that text)")
    if calibrated and (scheme.kind != "affine" or not search):
        raise ConfigError("calibration weighs the int4 encoder's search: use it with --format int4 "
                          "and the search or gptq encoder")
    raw = read_config(model_dir)
    if quant_block(raw):
        raise CheckpointError(f"{model_dir} is already quantized; start from the float checkpoint")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"output folder {out_dir} is not empty")
    return scheme, raw


def quantize_checkpoint(model_dir: Path, fmt: str, out_dir: Path, search: bool = True,
                        importance: dict[str, torch.Tensor] | None = None) -> dict:
    """search: affine (int4) groups take the least-squares encoder (quant/schemes.py); False:
    their min and max, as MLX's encoder. importance: module name -> [K] input importance
    (quant/calibrate.py) weighing that search's errors, or [K, K] input covariance: that module
    takes GPTQ (quant/gptq.py)."""
    gptq = any(v.dim() == 2 for v in (importance or {}).values())
    scheme, raw = check_request(model_dir, fmt, out_dir, search, importance is not None, gptq)
    targets = quantizable_names(model_dir)
    index = TensorIndex.scan(model_dir)  # also validates the folder
    files = sorted({f for f, _ in index.locations.values()})
    tensors: dict[str, torch.Tensor] = {}
    num_quantized, kept_float, targets_quantized, by_gptq = 0, [], set(), set()
    factors: dict[int, torch.Tensor] = {}  # id(covariance) -> its inverse factor, shared by parts
    shown = bar(_num_weights(files), f"quantizing to {fmt}", "weights", unit_scale=True)
    try:  # a failure (a NaN weight, an interrupt) must not leave the bar drawn
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    shown.set_postfix_str(key, refresh=False)
                    t = handle.get_tensor(key)
                    ours = lm_name(key)
                    module = ours.removesuffix(".weight") if ours and ours.endswith(".weight") else None
                    if module in targets and t.dim() == 2:
                        if t.shape[1] % scheme.group_size:
                            kept_float.append(key)
                        else:
                            base = key.removesuffix(".weight")
                            stat = (importance or {}).get(module)
                            if stat is not None and stat.dim() == 2:
                                packed = _gptq(t, scheme, module, stat, factors, shown.update)
                                by_gptq.add(module)
                            else:
                                packed = quantize(t, scheme, SCALE_DTYPE, search, stat,
                                                  progress=shown.update)
                            for leaf, v in packed.items():
                                tensors[f"{base}.{leaf}"] = v.contiguous()
                            num_quantized += 1
                            targets_quantized.add(module)
                            continue
                    tensors[key] = t.contiguous()
                    shown.update(t.numel())
        out_dir.mkdir(parents=True, exist_ok=True)
        shown.set_postfix_str("saving model.safetensors")
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    finally:
        shown.close()
    raw["quantization"] = _block(fmt, scheme)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
            "config.json", "model.safetensors.index.json"):
            shutil.copy(f, out_dir / f.name)
    encoder = ("gptq" if gptq else "search" if search else "minmax")
    return {"format": fmt, "encoder": encoder if scheme.kind == "affine" else None,
            "gptq": sorted(by_gptq),
            "calibrated": sorted(set(importance or ()) & targets_quantized),
            "num_quantized": num_quantized, "kept_float": kept_float,
            "bytes": (out_dir / "model.safetensors").stat().st_size, "out": str(out_dir)}


def _num_weights(files: list[Path]) -> int:
    """Every tensor's element count, from the headers (nothing is read)."""
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                total += math.prod(handle.get_slice(key).get_shape())
    return total


def _gptq(t: torch.Tensor, scheme: Scheme, module: str, cov: torch.Tensor,
          factors: dict[int, torch.Tensor], progress) -> dict:
    """GPTQ of one checkpoint tensor; a covariance it cannot use is a clear error naming the
    module (the calibration run's inputs overflowed, or were not positive definite)."""
    try:
        if id(cov) not in factors:
            factors[id(cov)] = inverse_factor(cov)
        return gptq_quantize(t, scheme, cov, SCALE_DTYPE, factors[id(cov)], progress)
    except ValueError as exc:
        raise ConfigError(f"GPTQ cannot encode {module}: {exc}") from None


def _block(fmt: str, s: Scheme) -> dict:
    return {"format": f"deltaserve-{fmt}", "kind": s.kind, "bits": s.bits,
            "group_size": s.group_size, "scale_dtype": "float16"}
