"""The two 2x2 token mergers: the window-attention merger inside the tower (16x mode) and the final
merger that projects into the language model's embedding space.

Shapes: L packed tokens, C tower width, E text hidden size, I encoder MLP width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.multimodal.config import VisionConfig
from deltaserve.multimodal.positions import device_index
from deltaserve.multimodal.siglip import BiasLinear, VisionAttention, make_layer_norm

# transformers builds the final merger's LayerNorm with a literal eps, not the config's
PROJECTOR_NORM_EPS = 1e-6


def block_order(grid_hw: list[tuple[int, int]], block_h: int, block_w: int) -> torch.Tensor:
    """[L] int64: packed row-major tokens regrouped into blocks of block_h x block_w.

    Per piece, blocks run row-major and each block's tokens row-major ((0,0), (0,1), (1,0), (1,1)
    for 2x2): taking L tokens in this order and viewing them as [L / 4, 4, C] groups each block.
    Both mergers gather this way (the reference's window index and its view/permute agree).
    """
    orders, start = [], 0
    for h, w in grid_hw:
        grid = torch.arange(start, start + h * w).view(h // block_h, block_h, w // block_w, block_w)
        orders.append(grid.permute(0, 2, 1, 3).flatten())  # [blocks_h, blocks_w, bh, bw]
        start += h * w
    return torch.cat(orders)


class WindowMerger(nn.Module):
    """The reference's `vit_merger`: attention inside each 2x2 window, then 4 tokens -> 1.

    x [L, C] on grids (h, w) -> [L / 4, C] on grids (h / 2, w / 2), row-major per piece.
    """

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.window = cfg.window_kernel_size
        width, merged_width = cfg.hidden_size, cfg.hidden_size * cfg.window_area
        self.layer_norm1 = make_layer_norm(width, cfg.layer_norm_eps, dtype)
        self.self_attn = VisionAttention(cfg, dtype)
        self.pre_norm = make_layer_norm(merged_width, cfg.layer_norm_eps, dtype)
        self.linear_1 = BiasLinear(merged_width, cfg.window_intermediate_size, dtype)
        self.linear_2 = BiasLinear(cfg.window_intermediate_size, width, dtype)

    def forward(self, x: torch.Tensor, grid_hw: list[tuple[int, int]]) -> torch.Tensor:
        num_tokens, width = x.shape
        window_area = self.window[0] * self.window[1]
        order = device_index(("window", *self.window), grid_hw, x.device,
                             lambda: block_order(grid_hw, *self.window))
        x = x[order]  # [L, C], each window's tokens contiguous
        # the norm is per token, so normalising after the reorder equals the reference's before
        window_lens = [window_area] * (num_tokens // window_area)
        x = self.self_attn(self.layer_norm1(x), window_lens, residual=x)
        windows = x.view(-1, window_area, width)  # [L / 4, 4, C]
        mlp_in = self.pre_norm(windows.flatten(1))  # [L / 4, 4C]
        # residual: the window's mean token
        return self.linear_2(self.linear_1(mlp_in, gelu_tanh=True), windows.mean(dim=1))


class Projector(nn.Module):
    """The reference's `merger.mlp.0`: 2x2 blocks -> LayerNorm(4C) -> linear -> erf GELU -> linear.

    x [L, C] on grids (h, w) -> [L / 4, E]. No residual.
    """

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.kernel = cfg.merge_kernel_size
        merged_width = cfg.hidden_size * cfg.merge_area
        self.pre_norm = make_layer_norm(merged_width, PROJECTOR_NORM_EPS, dtype)
        self.linear_1 = BiasLinear(merged_width, merged_width, dtype)
        self.linear_2 = BiasLinear(merged_width, cfg.text_hidden_size, dtype)

    def forward(self, x: torch.Tensor, grid_hw: list[tuple[int, int]]) -> torch.Tensor:
        merge_area = self.kernel[0] * self.kernel[1]
        order = device_index(("merge", *self.kernel), grid_hw, x.device,
                             lambda: block_order(grid_hw, *self.kernel))
        blocks = x[order].view(-1, merge_area * x.shape[1])  # [L / 4, 4C]
        hidden = F.gelu(self.linear_1(self.pre_norm(blocks)))  # exact (erf) GELU
        return self.linear_2(hidden)
