"""`VisionModel`: pixels of packed image pieces -> language-model embeddings (MiniCPM-V-4.6).

Stages, in order: embeddings, encoder layers 0..insert_layer_id, the window merger (16x mode only),
the remaining layers on the halved grid, post_layernorm, the projector. `trace` returns each one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from deltaserve.env import env
from deltaserve.errors import RequestError
from deltaserve.multimodal.config import DOWNSAMPLE_MODES, MERGE_SIDE_PATCHES, VisionConfig
from deltaserve.multimodal.merger import Projector, WindowMerger
from deltaserve.multimodal.positions import device_index, position_ids
from deltaserve.multimodal.siglip import (
    EncoderLayer,
    VisionEmbeddings,
    make_layer_norm,
)

GridSizes = Sequence[tuple[int, int]] | torch.Tensor  # per piece (h, w) in patches
StageRecorder = Callable[[str, torch.Tensor], None]


class VisionTower(nn.Module):
    """The checkpoint's `model.vision_tower.*` (SigLIP2 encoder, window merger, final norm)."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg, dtype)
        # ModuleDict only so parameter names read `encoder.layers.N.*`, as in the checkpoint
        layers = [EncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers)]
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(layers)})
        self.post_layernorm = make_layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.vit_merger = WindowMerger(cfg, dtype)


class VisionModel(nn.Module):
    """Tower + projector. Parameter names are the checkpoint's without the leading `model.`."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg, dtype)
        # the checkpoint's `model.merger.mlp.0.*`: one merge round (merger_times 1)
        self.merger = nn.ModuleDict({"mlp": nn.ModuleList([Projector(cfg, dtype)])})
        self._graphs = None  # multimodal/graphs.TowerGraphs, made at the first call on CUDA

    @property
    def projector(self) -> Projector:
        return self.merger["mlp"][0]

    def forward(
        self, pixel_values: torch.Tensor, grid_hw: GridSizes, mode: str | None = None
    ) -> torch.Tensor:
        """pixel_values [1, channels, P, L*P] (the processor's packed strip; the leading 1 may be
        dropped), grid_hw (h, w) per piece in patches -> features [L / 16 (16x) or L / 4 (4x), E],
        pieces in order. `mode` defaults to the config's downsample_mode. On CUDA a grid seen
        before replays a captured graph (multimodal/graphs.py; DELTASERVE_CUDA_GRAPHS=0: never)."""
        mode = self.cfg.downsample_mode if mode is None else mode
        weight = self.vision_tower.embeddings.patch_embedding.weight
        if weight.is_cuda and env().cuda_graphs:
            if self._graphs is None:
                from deltaserve.multimodal.graphs import TowerGraphs

                self._graphs = TowerGraphs(self)
            grids = check_grid(grid_hw, mode)
            return self._graphs.run(self._check_pixels(pixel_values, grids), grids, mode)
        return self._run(pixel_values, grid_hw, mode, None)

    def trace(
        self, pixel_values: torch.Tensor, grid_hw: GridSizes, mode: str | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """`forward`, keeping every stage's output: (name, [tokens, width]) in execution order."""
        stages: list[tuple[str, torch.Tensor]] = []
        self._run(pixel_values, grid_hw, mode, lambda name, x: stages.append((name, x)))
        return stages

    @torch.no_grad()
    def _run(
        self,
        pixel_values: torch.Tensor,
        grid_hw: GridSizes,
        mode: str | None,
        record: StageRecorder | None,
    ) -> torch.Tensor:
        cfg, tower = self.cfg, self.vision_tower
        mode = cfg.downsample_mode if mode is None else mode
        grids = check_grid(grid_hw, mode)
        pixels = self._check_pixels(pixel_values, grids)
        record = record or (lambda name, x: None)
        pos_ids = device_index("positions", grids, pixels.device,
                               lambda: position_ids(grids, cfg.num_patches_per_side))
        x = tower.embeddings(pixels, pos_ids)  # [L, C]
        record("embeddings", x)
        for layer_idx, layer in enumerate(tower.encoder["layers"]):
            x = layer(x, [h * w for h, w in grids])
            record(f"layers.{layer_idx}", x)
            if mode == "16x" and layer_idx == cfg.insert_layer_id:
                x = tower.vit_merger(x, grids)  # [L / 4, C]
                grids = [(h // 2, w // 2) for h, w in grids]
                record("vit_merger", x)
        x = tower.post_layernorm(x)
        record("post_layernorm", x)
        x = self.projector(x, grids)  # [tokens, E]
        record("projector", x)
        return x

    def _check_pixels(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]
    ) -> torch.Tensor:
        """The packed strip as [channels, P, L*P] in the weights' dtype and device."""
        cfg, weight = self.cfg, self.vision_tower.embeddings.patch_embedding.weight
        p = cfg.patch_size_px
        expected = (cfg.num_channels, p, sum(h * w for h, w in grids) * p)
        batched = pixel_values.dim() == 4 and pixel_values.shape[0] == 1
        pixels = pixel_values[0] if batched else pixel_values
        if tuple(pixels.shape) != expected:
            raise RequestError(
                f"pixel_values has shape {list(pixel_values.shape)}; the pieces {grids} need "
                f"[1, {expected[0]}, {expected[1]}, {expected[2]}]"
            )
        return pixels.to(device=weight.device, dtype=weight.dtype)


def check_grid(grid_hw: GridSizes, mode: str) -> list[tuple[int, int]]:
    """Per-piece (h, w) as ints, checked for the mode's merges (2x2 twice in 16x, once in 4x)."""
    if mode not in DOWNSAMPLE_MODES:
        raise RequestError(f"downsample mode '{mode}' is not one of {', '.join(DOWNSAMPLE_MODES)}")
    rows = grid_hw.tolist() if isinstance(grid_hw, torch.Tensor) else list(grid_hw)
    grids = [(int(h), int(w)) for h, w in rows]
    if not grids:
        raise RequestError("no image pieces given")
    multiple = MERGE_SIDE_PATCHES[mode]
    for h, w in grids:
        if h <= 0 or w <= 0 or h % multiple or w % multiple:
            raise RequestError(
                f"image piece of {h}x{w} patches: {mode} mode needs both sides a positive "
                f"multiple of {multiple}"
            )
    return grids
