"""Synthetic checkpoints with the exact names, shapes, dtypes and file layout of the real ones."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deltaserve.checkpoint.presets import Preset

BF16, F32 = torch.bfloat16, torch.float32


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str  # normal | zeros_centred | ones_noisy | a_log | dt_bias | zeros

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == BF16 else 4)


def _lm_layer(prefix: str, t: dict[str, Any], is_full: bool, small_f32: bool) -> list[TensorSpec]:
    h, inter = t["hidden_size"], t["intermediate_size"]
    f32 = F32 if small_f32 else BF16
    s = lambda n, shape, dt=BF16, init="normal": TensorSpec(prefix + n, shape, dt, init)  # noqa: E731
    out = [
        s("input_layernorm.weight", (h,), init="zeros_centred"),
        s("post_attention_layernorm.weight", (h,), init="zeros_centred"),
        s("mlp.gate_proj.weight", (inter, h)),
        s("mlp.up_proj.weight", (inter, h)),
        s("mlp.down_proj.weight", (h, inter)),
    ]
    if is_full:
        q, kv, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        out += [
            s("self_attn.q_proj.weight", (2 * q * d, h)),
            s("self_attn.k_proj.weight", (kv * d, h)),
            s("self_attn.v_proj.weight", (kv * d, h)),
            s("self_attn.o_proj.weight", (h, q * d)),
            s("self_attn.q_norm.weight", (d,), init="zeros_centred"),
            s("self_attn.k_norm.weight", (d,), init="zeros_centred"),
        ]
        return out
    hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv
    out += [
        s("linear_attn.in_proj_qkv.weight", (conv, h)),
        s("linear_attn.in_proj_z.weight", (hv * dv, h)),
        s("linear_attn.in_proj_b.weight", (hv, h)),
        s("linear_attn.in_proj_a.weight", (hv, h)),
        s("linear_attn.conv1d.weight", (conv, 1, t["linear_conv_kernel_dim"]), init="conv"),
        s("linear_attn.dt_bias", (hv,), init="dt_bias"),
        s("linear_attn.A_log", (hv,), f32, "a_log"),
        s("linear_attn.norm.weight", (dv,), f32, "ones_noisy"),
        s("linear_attn.out_proj.weight", (h, hv * dv)),
    ]
    return out


def lm_specs(t: dict[str, Any], prefix: str, small_f32: bool) -> list[TensorSpec]:
    """Language-model tensors; `prefix` is 'model.language_model.' (nested) or 'model.' (flat)."""
    specs = [
        TensorSpec(
            prefix + "embed_tokens.weight", (t["vocab_size"], t["hidden_size"]), BF16, "normal"
        )
    ]
    for i, kind in enumerate(t["layer_types"]):
        specs += _lm_layer(f"{prefix}layers.{i}.", t, kind == "full_attention", small_f32)
    specs.append(TensorSpec(prefix + "norm.weight", (t["hidden_size"],), BF16, "zeros_centred"))
    if not t["tie_word_embeddings"]:
        specs.append(
            TensorSpec("lm_head.weight", (t["vocab_size"], t["hidden_size"]), BF16, "normal")
        )
    return specs


def mtp_specs(t: dict[str, Any]) -> list[TensorSpec]:
    h = t["hidden_size"]
    specs = [TensorSpec("mtp.fc.weight", (h, 2 * h), BF16, "normal")]
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        specs.append(TensorSpec(f"mtp.{n}.weight", (h,), BF16, "zeros_centred"))
    return specs + _lm_layer("mtp.layers.0.", t, True, False)


def qwen_vision_specs(v: dict[str, Any]) -> list[TensorSpec]:
    vh, vi, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    p, tp, merged = v["patch_size"], v["temporal_patch_size"], vh * v["spatial_merge_size"] ** 2
    s = lambda n, shape: TensorSpec("model.visual." + n, shape, BF16, "normal")  # noqa: E731
    specs = [
        s("patch_embed.proj.weight", (vh, v["in_channels"], tp, p, p)),
        s("patch_embed.proj.bias", (vh,)),
        s("pos_embed.weight", (v["num_position_embeddings"], vh)),
    ]
    for i in range(v["depth"]):
        b = f"blocks.{i}."
        specs += [
            s(b + "norm1.weight", (vh,)),
            s(b + "norm1.bias", (vh,)),
            s(b + "norm2.weight", (vh,)),
            s(b + "norm2.bias", (vh,)),
            s(b + "attn.qkv.weight", (3 * vh, vh)),
            s(b + "attn.qkv.bias", (3 * vh,)),
            s(b + "attn.proj.weight", (vh, vh)),
            s(b + "attn.proj.bias", (vh,)),
            s(b + "mlp.linear_fc1.weight", (vi, vh)),
            s(b + "mlp.linear_fc1.bias", (vi,)),
            s(b + "mlp.linear_fc2.weight", (vh, vi)),
            s(b + "mlp.linear_fc2.bias", (vh,)),
        ]
    return specs + [
        s("merger.norm.weight", (vh,)),
        s("merger.norm.bias", (vh,)),
        s("merger.linear_fc1.weight", (merged, merged)),
        s("merger.linear_fc1.bias", (merged,)),
        s("merger.linear_fc2.weight", (out, merged)),
        s("merger.linear_fc2.bias", (out,)),
    ]


def _linear_pair(prefix: str, out_dim: int, in_dim: int) -> list[TensorSpec]:
    return [
        TensorSpec(prefix + ".weight", (out_dim, in_dim), BF16, "normal"),
        TensorSpec(prefix + ".bias", (out_dim,), BF16, "normal"),
    ]


def minicpm_vision_specs(v: dict[str, Any], text_hidden: int) -> list[TensorSpec]:
    vh, vi, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    grid = (v["image_size"] // p) ** 2
    vt = "model.vision_tower."
    specs = [
        TensorSpec(
            vt + "embeddings.patch_embedding.weight", (vh, v["num_channels"], p, p), BF16, "normal"
        ),
        TensorSpec(vt + "embeddings.patch_embedding.bias", (vh,), BF16, "normal"),
        TensorSpec(vt + "embeddings.position_embedding.weight", (grid, vh), BF16, "normal"),
    ]
    for i in range(v["num_hidden_layers"]):
        b = f"{vt}encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            specs += [TensorSpec(f"{b}{ln}.{w}", (vh,), BF16, "normal") for w in ("weight", "bias")]
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += _linear_pair(f"{b}self_attn.{proj}", vh, vh)
        specs += _linear_pair(b + "mlp.fc1", vi, vh) + _linear_pair(b + "mlp.fc2", vh, vi)
    specs += [
        TensorSpec(f"{vt}post_layernorm.{w}", (vh,), BF16, "normal") for w in ("weight", "bias")
    ]
    vm = vt + "vit_merger."
    specs += [TensorSpec(f"{vm}layer_norm1.{w}", (vh,), BF16, "normal") for w in ("weight", "bias")]
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        specs += _linear_pair(f"{vm}self_attn.{proj}", vh, vh)
    specs += [
        TensorSpec(f"{vm}pre_norm.{w}", (4 * vh,), BF16, "normal") for w in ("weight", "bias")
    ]
    vm_inner = 4 * vi  # transformers' window_intermediate_size: 17216 published (formats.md 3.2)
    specs += _linear_pair(vm + "linear_1", vm_inner, 4 * vh) + _linear_pair(
        vm + "linear_2", vh, vm_inner
    )
    mm = "model.merger.mlp.0."
    specs += [
        TensorSpec(f"{mm}pre_norm.{w}", (4 * vh,), BF16, "normal") for w in ("weight", "bias")
    ]
    return (
        specs
        + _linear_pair(mm + "linear_1", 4 * vh, 4 * vh)
        + _linear_pair(mm + "linear_2", text_hidden, 4 * vh)
    )


def preset_specs(p: Preset) -> list[TensorSpec]:
    cfg = p.config
    if cfg["model_type"] == "qwen3_5_text":
        return lm_specs(cfg, "model.", True) + mtp_specs(cfg)
    text = cfg["text_config"]
    if cfg["model_type"] == "minicpmv4_6":  # every tensor BF16, no mtp, no lm_head
        return lm_specs(text, "model.language_model.", False) + minicpm_vision_specs(
            cfg["vision_config"], text["hidden_size"]
        )
    return (
        lm_specs(text, "model.language_model.", True)
        + qwen_vision_specs(cfg["vision_config"])
        + mtp_specs(text)
    )


def vision_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Sane random values: GEMM weights ~ N(0, 1/fan_in), LayerNorm gains ~ 1, small biases.

    The preset writer's N(0, 0.02) everywhere (LayerNorm gains included) would shrink every
    block's output towards zero, leaving the attention near uniform and the parity test weak.
    """
    noise = torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return noise * 0.05
    if name.endswith("position_embedding.weight"):
        return noise * 0.5
    if len(shape) == 1:  # LayerNorm weight
        return 1.0 + noise * 0.1
    return noise / math.sqrt(math.prod(shape[1:]))


def write_vision_checkpoint(
    out_dir: Path, cfg: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """config.json + model.safetensors holding only `model.vision_tower.*` and `model.merger.*`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    specs = minicpm_vision_specs(cfg["vision_config"], cfg["text_config"]["hidden_size"])
    tensors = {s.name: vision_init(s.name, s.shape, gen).to(dtype) for s in specs}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir
