"""SigLIP2 encoder blocks of the vision tower: patch + position embedding, attention restricted to
segments of the packed token axis, pre-LN encoder layers.

Shapes: L tokens of every piece packed on one axis, C tower width, H heads, D = C / H, I MLP width,
P patch side in pixels, S position-table side (70).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.layers.linear import Linear
from deltaserve.multimodal.config import VisionConfig
from deltaserve.ops import gemm_amx
from deltaserve.ops.dispatch import REFERENCE, Case, Op, case


class BiasLinear(Linear):
    """y = [residual +] [gelu_tanh](x W^T + b). Packed `parts` split the rows of W and of b alike
    (checkpoint_targets); the GELU and residual fuse into the AMX kernel's epilogue where it runs."""

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        dtype: torch.dtype,
        parts: list[str] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, dtype, parts)
        self.bias = nn.Parameter(torch.empty(sum(self.out_sizes), dtype=dtype), False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, gelu_tanh: bool = False
    ) -> torch.Tensor:
        return amx_or_linear(self, x, self.weight, self.bias, residual, gelu_tanh)

    def fuses_prologue(self, x: torch.Tensor) -> bool:
        return False  # forward's second argument is a residual, not a GEMV prologue


VISION_LINEAR = Op("vision_linear", "[residual +] [gelu_tanh](x W^T + b) of the vision tower",
                   ("rows>=AMX MIN_ROWS",))


def amx_or_linear(
    owner: nn.Module,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor | None = None,
    gelu_tanh: bool = False,
) -> torch.Tensor:
    """[residual +] [gelu_tanh](F.linear(x, weight, bias)); on a CPU with AMX and fp32 activations
    of MIN_ROWS+ rows, the bf16x2 split GEMM with the rest in its epilogue (ops/gemm_amx.py: fp32
    results, ~1e-6 relative, 2-4x faster than torch's fp32 GEMM there)."""
    c = case(x, (x.numel() >= gemm_amx.MIN_ROWS * x.shape[-1],))
    return VISION_LINEAR(c, owner, x, weight, bias, residual, gelu_tanh)


def _amx_why_not(c: Case) -> str | None:
    if c.device != "cpu" or c.dtype != torch.float32:
        return "not CPU fp32 activations"
    if not c.shape[0]:
        return f"fewer than {gemm_amx.MIN_ROWS} rows"
    return None if gemm_amx.available() else "no AMX kernel here (or DELTASERVE_AMX=0)"


@VISION_LINEAR.register("amx", 30, _amx_why_not)
def _vision_linear_amx(owner, x, weight, bias, residual, gelu_tanh):
    packed = gemm_amx.packed_for(owner, weight)
    return gemm_amx.gemm_amx(x, packed, bias, residual, gelu_tanh)


@VISION_LINEAR.register(REFERENCE, 0)
def _vision_linear_torch(owner, x, weight, bias, residual, gelu_tanh):
    y = F.linear(x, weight, bias)
    if gelu_tanh:
        y = F.gelu(y, approximate="tanh")
    return y if residual is None else residual + y


def make_layer_norm(dim: int, eps: float, dtype: torch.dtype) -> nn.LayerNorm:
    norm = nn.LayerNorm(dim, eps=eps, dtype=dtype)
    norm.requires_grad_(False)
    return norm


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lens: list[int]
) -> torch.Tensor:
    """Bidirectional attention within each segment. q, k, v [L, H, D] -> [L, H, D].

    Segments of equal length (the 2x2 windows, same-size slices) run as one batched SDPA; mixed
    lengths run one SDPA per segment (a handful of image pieces, never per position).
    """
    num_tokens, num_heads, head_dim = q.shape
    if len(set(segment_lens)) == 1:
        seg_len = segment_lens[0]
        # [L, H, D] -> [segments, H, seg_len, D]
        to_batch = lambda t: t.view(-1, seg_len, num_heads, head_dim).transpose(1, 2)  # noqa: E731
        out = F.scaled_dot_product_attention(to_batch(q), to_batch(k), to_batch(v))
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
    out = torch.empty_like(q)
    start = 0
    for seg_len in segment_lens:
        end = start + seg_len
        # [1, H, seg_len, D]: the 4-D call (3-D inputs took 5-7x longer in torch's CPU SDPA)
        per_head = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
        out[start:end] = F.scaled_dot_product_attention(*per_head)[0].transpose(0, 1)
        start = end
    return out


class VisionAttention(nn.Module):
    """Multi-head attention (no RoPE, no mask inside a segment); q|k|v packed into one GEMM."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv = BiasLinear(width, [width] * 3, dtype, parts=["q_proj", "k_proj", "v_proj"])
        self.out_proj = BiasLinear(width, width, dtype)

    def forward(
        self, x: torch.Tensor, segment_lens: list[int], residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [L, C] -> [residual +] attn(x) [L, C], tokens attending only within their segment."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv.split(self.qkv(x))  # [L, C] each
        heads = (num_tokens, self.num_heads, self.head_dim)
        out = segment_attention(q.reshape(heads), k.reshape(heads), v.reshape(heads), segment_lens)
        return self.out_proj(out.reshape(num_tokens, -1), residual)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = BiasLinear(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.fc2 = BiasLinear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [L, C] -> [residual +] mlp(x) [L, C]."""
        return self.fc2(self.fc1(x, gelu_tanh=True), residual)


class EncoderLayer(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = make_layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.self_attn = VisionAttention(cfg, dtype)
        self.layer_norm2 = make_layer_norm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, piece_lens: list[int]) -> torch.Tensor:
        """x [L, C] -> [L, C]; attention stays inside each image piece."""
        x = self.self_attn(self.layer_norm1(x), piece_lens, residual=x)
        return self.mlp(self.layer_norm2(x), residual=x)


class PatchConv(nn.Module):
    """The stride-P patch convolution, stored as the checkpoint's [C, channels, P, P] kernel."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        p, width = cfg.patch_size_px, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(width, cfg.num_channels, p, p, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(width, dtype=dtype), False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [channels, P, L*P] (patches side by side) -> [L, C].

        Non-overlapping patches make the conv one GEMM over unfolded patches: 45 ms vs 60 ms for
        F.conv2d on 3072 real-width patches here (2 CPU cores), same values within 6e-6.
        """
        channels, p, strip_px = pixel_values.shape
        num_patches = strip_px // p
        # [channels, P, L, P] -> [L, channels, P, P] -> [L, channels*P*P], the kernel's flat order
        patches = pixel_values.view(channels, p, num_patches, p).permute(2, 0, 1, 3)
        patches = patches.reshape(num_patches, channels * p * p)
        return amx_or_linear(self, patches, self.weight.view(self.weight.shape[0], -1), self.bias)


class VisionEmbeddings(nn.Module):
    """Patch embedding + the learned position of each patch's bucket (no class token, no RoPE)."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = PatchConv(cfg, dtype)
        table_size = cfg.num_patches_per_side**2
        self.position_embedding = nn.Embedding(table_size, cfg.hidden_size, dtype=dtype)
        self.position_embedding.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """pixel_values [channels, P, L*P], position_ids [L] -> [L, C]."""
        positions = F.embedding(position_ids, self.position_embedding.weight)  # [L, C]
        return self.patch_embedding(pixel_values) + positions
