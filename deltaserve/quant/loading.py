"""Which modules of a checkpoint are quantized, with which scheme, and the MLX layout fixes.

A module is quantized when the checkpoint holds `<name>.scales` for it (MLX's rule too), or when
the `quantization` block names it with a llama.cpp block kind (q4_k, ...: scales inside the
blocks, quant/ggml_blocks.py); the scheme comes from config.json's `quantization` block (ours:
kind/bits/group_size; MLX: bits/group_size/mode, with optional per-module overrides keyed by the
module's MLX path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltaserve.errors import CheckpointError
from deltaserve.quant.ggml_blocks import BLOCKS
from deltaserve.quant.linear import quantize_module_, quantize_parts_
from deltaserve.quant.schemes import Scheme

# norms whose checkpoint weight w is used as (1 + w); MLX files store them with the +1 folded in
_SHIFTED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                  "k_norm.weight", "model.norm.weight")


def quant_block(raw: dict[str, Any]) -> dict[str, Any] | None:
    for cfg in (raw, raw.get("text_config") or {}):
        block = cfg.get("quantization") or cfg.get("quantization_config")
        if block:
            return block
    return None


def scheme_from(block: dict[str, Any], module_name: str) -> Scheme:
    mlx_path = "language_model." + module_name
    override = block.get(mlx_path) or block.get(module_name)
    spec = {**block, **override} if isinstance(override, dict) else block
    try:
        bits, group = int(spec["bits"]), int(spec["group_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json quantization block is malformed: {block}") from exc
    kind = spec.get("kind") or ("affine" if spec.get("mode", "affine") == "affine" else None)
    if kind is None:
        raise CheckpointError(f"unsupported quantization mode '{spec.get('mode')}'")
    return Scheme(kind, bits, group)


def module_checkpoint_names(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """(module, checkpoint names it loads) for every module that could hold a quantized weight."""
    from deltaserve.layers.linear import Linear

    out = []
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            parent = name.rpartition(".")[0]
            parts = module.parts or [name.rpartition(".")[2]]
            out.append((module, [f"{parent}.{p}" if parent else p for p in parts]))
        elif isinstance(module, nn.Embedding):
            out.append((module, [name]))
    return out


def quantize_model_(model: nn.Module, raw: dict[str, Any], index) -> int:
    """Pack every module whose checkpoint tensors are quantized (on meta); returns how many."""
    block, count = quant_block(raw), 0
    for module, names in module_checkpoint_names(model):
        has = [f"{n}.scales" in index.locations or _named_block(block, n) for n in names]
        if not any(has):
            continue
        if block is None:
            raise CheckpointError(
                f"'{names[0]}' is quantized but config.json has no quantization block"
            )
        schemes = [scheme_from(block, n) if q else None for n, q in zip(names, has, strict=True)]
        for n, scheme in zip(names, schemes, strict=True):
            if scheme is not None:
                _check_layout(index, n, scheme, module.weight.shape[-1])
        if len(set(schemes)) > 1:  # a GGUF mix (Q4_K_M: v in Q6_K; F32 parts): a Linear per part
            quantize_parts_(module, names, schemes)
        else:
            quantize_module_(module, schemes[0])
        if len(names) == 1 and f"{names[0]}.input_order" in index.locations:
            cols = module.in_cols
            module.input_order = nn.Parameter(torch.empty(cols, dtype=torch.int64,
                                                          device=module.weight.device), False)
        count += 1
    return count


def quantized_scheme(block: dict[str, Any], index, name: str) -> Scheme | None:
    """The scheme of checkpoint module `name` if the checkpoint holds it quantized, else None."""
    if f"{name}.scales" in index.locations or _named_block(block, name):
        return scheme_from(block, name)
    return None


def _named_block(block: dict[str, Any] | None, name: str) -> bool:
    """The block names this module itself with a llama.cpp block kind (never by default: a float
    module has no tensor that would tell it apart)."""
    override = (block or {}).get(name)
    return isinstance(override, dict) and override.get("kind") in BLOCKS


def _check_layout(index, name: str, scheme: Scheme, cols: int) -> None:
    wshape, wdtype = index.meta(f"{name}.weight")
    if scheme.is_block():  # (whole blocks: a tensor-parallel rank holds a part of the row,
        # checked against the module once sharded)
        block = scheme.packed_shape(1, scheme.group_size)[1]
        if cols % scheme.group_size or len(wshape) != 2 or wshape[1] % block \
                or wdtype != scheme.packed_dtype():
            raise CheckpointError(f"'{name}': {list(wshape)} {wdtype} is not {cols} inputs in "
                                  f"{scheme.kind} blocks")
        return
    sshape, _ = index.meta(f"{name}.scales")
    if len(wshape) != 2 or len(sshape) != 2 or wshape[0] != sshape[0]:
        raise CheckpointError(f"'{name}': packed weight {wshape} and scales {sshape} do not match")
    cols = sshape[1] * scheme.group_size
    if tuple(wshape) != scheme.packed_shape(wshape[0], cols) or wdtype != scheme.packed_dtype():
        raise CheckpointError(
            f"'{name}': packed weight {list(wshape)} {wdtype} does not fit {scheme.bits}-bit "
            f"{scheme.kind} codes in groups of {scheme.group_size} (wrong group size or packing?)"
        )
    if scheme.has_biases() and f"{name}.biases" not in index.locations:
        raise CheckpointError(f"'{name}': affine quantization needs '{name}.biases'")


def is_mlx_layout(index) -> bool:
    """mlx-lm's own test: a GDN conv weight stored [C, 4, 1] instead of HF's [C, 1, 4]."""
    for name in index.locations:
        if name.endswith("linear_attn.conv1d.weight"):
            shape, _ = index.meta(name)
            return len(shape) == 3 and shape[-1] == 1 and shape[1] > 1
    return False


def from_mlx(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An MLX-saved tensor in HF's convention: conv back to [C, 1, 4], +1 norms unshifted."""
    if name.endswith("linear_attn.conv1d.weight"):
        return tensor.permute(0, 2, 1)
    if name.endswith(_SHIFTED_NORMS):
        return tensor.float() - 1.0
    return tensor
