"""The vision ground truth: transformers' MiniCPM-V-4.6 vision tower and merger on the same
checkpoint tensors, and their per-stage outputs captured with forward hooks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltaserve.checkpoint.reader import TensorIndex
from deltaserve.errors import DeltaserveError
from deltaserve.multimodal.loader import vision_name
from deltaserve.multimodal.tower import check_grid


@dataclass(frozen=True, slots=True)
class VisionReference:
    tower: nn.Module  # MiniCPMV4_6VisionModel: `model.vision_tower.*`
    merger: nn.Module  # MiniCPMV4_6Merger: `model.merger.*`
    config: Any  # MiniCPMV4_6Config


def load_vision_reference(model_dir: Path | str, dtype: torch.dtype = torch.float32,
                          attn_implementation: str = "eager", device: str = "cpu"):
    """transformers' tower + merger, built from config.json with the checkpoint's tensors.
    eager attention (plain matmul + fp32 softmax) for parity; "sdpa" (its default) as a peer."""
    try:
        from transformers import MiniCPMV4_6Config
        from transformers.models.minicpmv4_6.modeling_minicpmv4_6 import (
            MiniCPMV4_6Merger,
            MiniCPMV4_6VisionModel,
        )
    except ImportError as exc:
        raise DeltaserveError(
            "the vision reference needs transformers: pip install 'deltaserve[validate]'"
        ) from exc
    model_dir = Path(model_dir)
    config = MiniCPMV4_6Config.from_pretrained(model_dir)
    config.vision_config._attn_implementation = attn_implementation
    with torch.device("meta"):
        tower = MiniCPMV4_6VisionModel(config.vision_config)
        merger = MiniCPMV4_6Merger(config)
    tower = tower.to_empty(device=device).to(dtype)
    merger = merger.to_empty(device=device).to(dtype)
    index = TensorIndex.scan(model_dir, vision_name, "vision")
    parts = {"vision_tower.": tower.state_dict(), "merger.": merger.state_dict()}
    expected = {prefix + name for prefix, state in parts.items() for name in state}
    if expected != set(index.locations):
        odd = sorted(expected ^ set(index.locations))
        raise DeltaserveError(f"transformers and the checkpoint disagree on tensors: {odd[:3]}")
    with torch.no_grad():
        for name, tensor in index.tensors(sorted(expected)):
            prefix, _, rest = name.partition(".")
            parts[prefix + "."][rest].copy_(tensor)
    return VisionReference(tower.eval(), merger.eval(), config)


def reference_forward(ref: VisionReference, pixel_values: torch.Tensor, grid_hw,
                      mode: str) -> torch.Tensor:
    """transformers' image features [tokens, text width] (get_image_features' glue)."""
    return reference_trace(ref, pixel_values, grid_hw, mode, hooks=False)[-1][1]


def reference_trace(
    ref: VisionReference, pixel_values: torch.Tensor, grid_hw, mode: str, hooks: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """transformers' stage outputs, named and ordered as `VisionModel.trace` names them.

    The glue is `MiniCPMV4_6Model.get_image_features`: tower (window merger unless 4x), then
    the merger on the grid the tower ended with.
    """
    grids = check_grid(grid_hw, mode)
    param = next(ref.tower.parameters())
    target_sizes = torch.tensor(grids, dtype=torch.int32, device=param.device)
    pixel_values = pixel_values.to(param.device, param.dtype)
    stages: list[tuple[str, torch.Tensor]] = []
    named = [("embeddings", ref.tower.embeddings)]
    named += [(f"layers.{i}", layer) for i, layer in enumerate(ref.tower.encoder.layers)]
    named += [("vit_merger", ref.tower.vit_merger), ("post_layernorm", ref.tower.post_layernorm)]
    handles = [
        module.register_forward_hook(
            lambda _m, _args, out, name=name: stages.append((name, out[0]))  # drop batch dim 1
        )
        for name, module in (named if hooks else [])
    ]
    try:
        with torch.no_grad():
            use_vit_merger = mode != "4x"
            out = ref.tower(pixel_values, target_sizes=target_sizes, use_vit_merger=use_vit_merger)
            merged_sizes = target_sizes // 2 if use_vit_merger else target_sizes
            features = ref.merger(out.last_hidden_state, merged_sizes)  # one tensor per piece
    finally:
        for handle in handles:
            handle.remove()
    stages.append(("projector", torch.cat(features, dim=0)))
    return stages
