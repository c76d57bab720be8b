"""MLX 4- and 8-bit checkpoints as mlx-community publishes them, loaded directly.

The writer here follows MLX's published rules (formats.md section 4) with numpy only, sharing no
code with our reader: `language_model.model.*` names, no MTP, conv [C,4,1], (1+w) norms stored +1,
uint32 words low-bits-first, bf16 scales/biases from MLX's encoder (the larger-magnitude edge is
exact, so scales may be negative). The reference is the same weights dequantized by this writer.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import LLM
from deltaserve.cache.sequence import prompt_logits
from deltaserve.checkpoint.default import default_model_dir
from deltaserve.env import env
from deltaserve.errors import CheckpointError
from deltaserve.ops.native import isa_paths

SHIFTED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
           "k_norm.weight", "model.norm.weight")
PROMPT_IDS = [[5, 300, 41, 7, 900, 12, 1000, 77, 3]]


def mlx_quantize(w: np.ndarray, bits: int, group: int):
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    lo, hi = g.min(-1), g.max(-1)
    levels = 2**bits - 1
    scale = (hi - lo) / levels
    edge = np.where(np.abs(lo) > np.abs(hi), lo, hi)
    scale = np.where(edge == hi, -scale, scale)  # q = 0 lands on the larger-magnitude edge
    scale = np.where(scale == 0, 1e-8, scale)
    scale_bf16 = torch.from_numpy(scale.astype(np.float32)).bfloat16()
    bias_bf16 = torch.from_numpy(edge.astype(np.float32)).bfloat16()
    s, b = scale_bf16.float().numpy()[..., None], bias_bf16.float().numpy()[..., None]
    q = np.clip(np.rint((g - b) / s), 0, levels).astype(np.uint64).reshape(rows, cols)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint64) * bits)[None, None, :]
    words = (q.reshape(rows, cols // per, per) << shifts).sum(-1).astype(np.uint32)
    deq = (q.reshape(rows, cols // group, group) * s + b).reshape(rows, cols)
    return words, scale_bf16, bias_bf16, deq.astype(np.float32)


def write_mlx(src, out, bits: int, group: int = 64):
    """(MLX folder, float folder holding the values the MLX one encodes) from an HF checkpoint."""
    tensors = load_file(str(src / "model.safetensors"))
    mlx, ref = {}, {}
    for name, t in tensors.items():
        if name.startswith("mtp."):
            continue
        new = "language_model." + name if name.startswith("model.") else name
        a = t.float().numpy()
        if name.endswith(".weight") and a.ndim == 2 and a.shape[1] % group == 0:
            words, s, b, deq = mlx_quantize(a, bits, group)
            base = new.removesuffix(".weight")
            mlx.update({f"{base}.weight": torch.from_numpy(words.view(np.int32)).view(torch.uint32),
                        f"{base}.scales": s, f"{base}.biases": b})
            ref[name] = torch.from_numpy(deq)
        elif name.endswith("linear_attn.conv1d.weight"):
            mlx[new] = torch.from_numpy(np.ascontiguousarray(np.moveaxis(a, 2, 1))).bfloat16()
            ref[name] = t.bfloat16().float()
        elif name.endswith(SHIFTED):
            mlx[new] = (t.float() + 1.0).bfloat16()
            ref[name] = mlx[new].float() - 1.0
        else:
            keep = torch.float32 if name.endswith("A_log") else torch.bfloat16
            mlx[new], ref[name] = t.to(keep), t.to(keep).float()
    for folder, data, meta in ((out / "mlx", mlx, "mlx"), (out / "ref", ref, "pt")):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(data, str(folder / "model.safetensors"), metadata={"format": meta})
    cfg = json.loads((src / "config.json").read_text())
    block = {"group_size": group, "bits": bits, "mode": "affine"}
    cfg.update(quantization=block, quantization_config=block)
    (out / "mlx" / "config.json").write_text(json.dumps(cfg))
    return out / "mlx", out / "ref"


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_checkpoint_runs_like_its_dequantized_weights(tmp_path, bits, monkeypatch) -> None:
    """On the exact kernels (fp32 activations) to fp32 rounding. This short prompt's rows take the
    decode GEMV, which for 4-bit affine where the kernels have an int8-activation form (AVX512-VNNI
    or AVX2) rounds x per group to int8 by default (ops/qgemv.py): that stays within the
    rounding's ~1% (MLX 8-bit affine has no such kernel). Without one (scalar builds) the default
    is the exact kernel: the same bits."""
    mlx_dir, ref_dir = write_mlx(default_model_dir(), tmp_path, bits)
    ids = torch.tensor(PROMPT_IDS)
    ref = LLM(ref_dir, dtype="float32")
    lr = prompt_logits(ref.model, ids)[None]
    errors = {}
    for exact in ("1", "0"):
        monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", exact)
        env.cache_clear()
        try:
            ours = LLM(mlx_dir, dtype="float32")
            assert ours.model.model.layers[0].mlp.down_proj.scheme.bits == bits
            lo = prompt_logits(ours.model, ids)[None]
        finally:
            env.cache_clear()
        errors[exact] = ((lo - lr).norm() / lr.norm()).item()
    assert errors["1"] <= 1e-5
    if bits == 4 and {"vnni-int4", "avx2-int4"} & set(isa_paths()):  # its rounding shows
        assert 100 * errors["1"] < errors["0"] <= 3e-2
    else:
        assert errors["0"] == errors["1"]


def test_mlx_file_with_wrong_packing_is_a_clear_error(tmp_path) -> None:
    mlx_dir, _ = write_mlx(default_model_dir(), tmp_path, 4)
    cfg = json.loads((mlx_dir / "config.json").read_text())
    cfg["quantization"]["bits"] = 8  # the words hold 4-bit codes
    (mlx_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not fit 8-bit affine codes"):
        LLM(mlx_dir)
