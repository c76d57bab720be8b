"""Quantization schemes: the plain torch reference for packing and unpacking each layout.

Groups run along the input (last) axis. Layouts (docs/formats.md):
  int8    symmetric, w = s * q, q int8 [N, K], one scale per group (ours; GGUF Q8_0 is group 32)
  affine  w = s * q + b, q unsigned `bits`-bit codes packed low-bits-first into little-endian
          uint32 words [N, K * bits / 32] (ours int4 = MLX 4-bit; MLX 8-bit; GGUF Q4_0 mapped here)
  q1      w = s * (2b - 1), bits packed LSB-first into uint8 [N, K / 8] (GGUF Q1_0 semantics)
  q4_k, q6_k, iq4_xs, ...  llama.cpp's blocks as the file holds them, uint8 [N, K / QK * bytes],
          scales inside each block (quant/ggml_blocks.py: the table and the reference decoders)
Scales/biases keep the file's float dtype; dequantization computes in fp32.

The affine encoder searches each group's (scale, bias) for the least squared error (after llama.cpp's
k-quant encoder, `make_qkx2_quants`: codes from a few stretched ranges, each refit by least
squares): ~16% less squared error than MLX's encoder (the group's min and max, where the search
starts and which it never does worse than) on Gaussian and heavy-tailed weights. Same layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltaserve.errors import CheckpointError
from deltaserve.quant.ggml_blocks import BLOCKS, dequantize_blocks

KINDS = ("int8", "affine", "q1", *BLOCKS)


@dataclass(frozen=True, slots=True)
class Scheme:
    kind: str  # one of KINDS
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        ok = {"int8": (8,), "affine": (2, 3, 4, 5, 6, 8), "q1": (1,)}
        if self.kind in BLOCKS:  # a block layout: its own block size and nominal bits
            _, qk, _, bits = BLOCKS[self.kind]
            if (self.bits, self.group_size) != (bits, qk):
                raise CheckpointError(f"{self.kind} blocks are {bits}-bit in groups of {qk}")
            return
        if self.kind not in ok or self.bits not in ok[self.kind]:
            raise CheckpointError(f"unsupported quantization {self.kind} with {self.bits} bits")
        if self.group_size < 8 or self.group_size % 8:
            raise CheckpointError(f"unsupported quantization group size {self.group_size}")
        if self.kind == "affine" and 32 % self.bits:
            raise CheckpointError(f"affine {self.bits}-bit codes do not pack into uint32 words")

    def packed_shape(self, rows: int, cols: int) -> tuple[int, int]:
        if self.is_block():
            return rows, cols // self.group_size * BLOCKS[self.kind][2]
        if self.kind == "int8":
            return rows, cols
        if self.kind == "q1":
            return rows, cols // 8
        return rows, cols * self.bits // 32

    def packed_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "affine": torch.uint32}.get(self.kind, torch.uint8)

    def has_biases(self) -> bool:
        return self.kind == "affine"

    def is_block(self) -> bool:
        """A llama.cpp block layout: scales inside the blocks, no `scales` / `biases` tensors."""
        return self.kind in BLOCKS

    def check_cols(self, cols: int, name: str) -> None:
        if cols % self.group_size:
            raise CheckpointError(
                f"'{name}': {cols} inputs are not a multiple of the group size {self.group_size}"
            )


INT8 = Scheme("int8", 8, 64)
INT4 = Scheme("affine", 4, 64)
Q1 = Scheme("q1", 1, 128)
FORMATS = {"int8": INT8, "int4": INT4, "q1": Q1}


def quantize(w: torch.Tensor, s: Scheme, scale_dtype: torch.dtype = torch.float16,
             search: bool = True, importance: torch.Tensor | None = None,
             progress: Callable[[int], object] | None = None) -> dict:
    """w [N, K] float -> {"weight", "scales"[, "biases"]}: the reference encoder. search=False:
    affine groups take their min/max range (MLX's encoder) instead of the least-squares search;
    importance [K] (quant/calibrate.py) weighs each column's squared error in that search.
    progress(n): told of every n weights encoded (the search over a 248k-row embedding takes
    minutes)."""
    progress = progress or (lambda n: None)
    rows, cols = w.shape
    if s.is_block():
        raise CheckpointError(f"{s.kind} blocks come from llama.cpp's quantizer; deltaserve reads "
                              "them but does not encode them")
    s.check_cols(cols, "weight")
    g = w.float().reshape(rows, cols // s.group_size, s.group_size)
    if s.kind == "int8":
        scale = (g.abs().amax(-1) / 127.0).to(scale_dtype)
        sf = scale.float().unsqueeze(-1)
        q = torch.where(sf > 0, g / sf.clamp_min(1e-30), 0.0).round().clamp(-127, 127)
        progress(w.numel())
        return {"weight": q.to(torch.int8).reshape(rows, cols), "scales": scale}
    if s.kind == "q1":
        scale = g.abs().mean(-1).to(scale_dtype)  # PrismML's encoder: d = mean |x| of the group
        bits = (g >= 0).reshape(rows, cols)
        progress(w.numel())
        return {"weight": _pack_bits(bits), "scales": scale}
    levels = (1 << s.bits) - 1
    imp = None if importance is None else group_weights(importance, cols, s.group_size)
    codes, scales, biases = [], [], []
    for part in g.split(AFFINE_ROWS_PER_PASS):  # the search's temporaries stay a few 100 MB
        scale, bias = affine_fit(part, levels, scale_dtype, imp) if search else _minmax(
            part, levels, scale_dtype)
        codes.append(affine_codes(part, scale.float(), bias.float(), levels))
        scales.append(scale)
        biases.append(bias)
        progress(part.numel())
    q = torch.cat(codes).reshape(rows, cols).to(torch.int64)
    return {"weight": pack_codes(q, s.bits), "scales": torch.cat(scales),
            "biases": torch.cat(biases)}


AFFINE_ROWS_PER_PASS = 2048
# codes per unit of range tried per group: levels + each of these (make_qkx2_quants tries 21 points
# of [-1, 1]; 5 of them and two refits came within 0.3% of its error at a third of its time)
AFFINE_STRETCHES = (-1.0, -0.5, 0.0, 0.5, 1.0)
AFFINE_REFITS = 2  # then: the best pair's nearest codes, refit by least squares, kept if better


def group_weights(importance: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """importance [K] -> [1, G, S] relative to each group's mean (the fit sees relative weights
    only), at least 1e-3; groups without a usable mean (zeros, NaN) weigh every column alike."""
    if importance.shape != (cols,):
        raise ValueError(f"importance has shape {list(importance.shape)}; the weight has "
                         f"{cols} inputs")
    imp = importance.float().nan_to_num(0.0, 0.0, 0.0).clamp_min(0)
    imp = imp.reshape(1, cols // group_size, group_size)
    mean = imp.mean(-1, keepdim=True)
    usable = (mean > 0) & torch.isfinite(mean)
    return torch.where(usable, imp / torch.where(usable, mean, 1.0), 1.0) + 1e-3


def _minmax(g: torch.Tensor, levels: int, scale_dtype: torch.dtype, lo=None, hi=None):
    """MLX's pair: scale (max - min) / levels, bias min (lo, hi [R, G]: the group's, if known)."""
    lo = g.amin(-1) if lo is None else lo
    hi = g.amax(-1) if hi is None else hi
    return ((hi - lo) / levels).clamp_min(1e-12).to(scale_dtype), lo.to(scale_dtype)


def affine_codes(g, scale, bias, levels: int) -> torch.Tensor:
    """The nearest code of each weight for a group's stored (scale, bias) [R, G] (a constant group's
    scale may round to 0 in fp16: its 0 / 0 codes are 0, the bias alone is the weight)."""
    q = ((g - bias.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, levels)
    return q.nan_to_num(0.0)


def _affine_err(g, scale, bias, levels: int, imp=None) -> torch.Tensor:
    q = affine_codes(g, scale, bias, levels)
    err = (q * scale.unsqueeze(-1) + bias.unsqueeze(-1) - g).square()
    return (err if imp is None else err * imp).sum(-1)


def _least_squares(g, q, scale_dtype: torch.dtype, imp=None):
    """(scale, bias, usable) [R, G] minimising sum imp * (scale * q + bias - g)^2 for fixed codes
    q (imp [1, G, S] or None: 1), stored in scale_dtype."""
    if imp is None:
        n, sx, sq = g.shape[-1], g.sum(-1), q.sum(-1)
        sqq, sxq = q.square().sum(-1), (g * q).sum(-1)
    else:
        n, sx, sq = imp.sum(-1), (imp * g).sum(-1), (imp * q).sum(-1)
        sqq, sxq = (imp * q.square()).sum(-1), (imp * g * q).sum(-1)
    det = n * sqq - sq * sq
    scale = ((n * sxq - sq * sx) / det.clamp_min(1e-30)).to(scale_dtype)
    bias = ((sqq * sx - sq * sxq) / det.clamp_min(1e-30)).to(scale_dtype)
    usable = (det > 0) & (scale > 0) & torch.isfinite(scale) & torch.isfinite(bias)
    return scale, bias, usable


def affine_fit(g: torch.Tensor, levels: int, scale_dtype: torch.dtype, imp=None):
    """(scale, bias) [R, G] in scale_dtype for groups g [R, G, S] (fp32): of the min/max range and
    the least-squares fits of the codes of a few stretched ranges (AFFINE_STRETCHES, then
    AFFINE_REFITS), the one whose stored values give the least squared error over its group
    (each column's weighted by imp [1, G, S] where given)."""
    lo, hi = g.amin(-1), g.amax(-1)
    best_s, best_b = _minmax(g, levels, scale_dtype, lo, hi)
    best_err = _affine_err(g, best_s.float(), best_b.float(), levels, imp)
    span = (hi - lo).clamp_min(1e-12)
    for step in range(len(AFFINE_STRETCHES) + AFFINE_REFITS):
        if step < len(AFFINE_STRETCHES):
            per_unit = (levels + AFFINE_STRETCHES[step]) / span
            q = ((g - lo.unsqueeze(-1)) * per_unit.unsqueeze(-1)).round().clamp(0, levels)
        else:
            q = affine_codes(g, best_s.float(), best_b.float(), levels)
        scale, bias, usable = _least_squares(g, q, scale_dtype, imp)
        err = _affine_err(g, scale.float().clamp_min(1e-30), bias.float(), levels, imp)
        better = usable & (err < best_err)
        best_s, best_b = torch.where(better, scale, best_s), torch.where(better, bias, best_b)
        best_err = torch.where(better, err, best_err)
    return best_s, best_b


def dequantize(t: dict, s: Scheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """{"weight", "scales"[, "biases"]} (any leading rows) -> w [N, K] in `dtype`, computed in fp32."""
    if s.is_block():
        return dequantize_blocks(t["weight"], s.kind, dtype)
    scales = t["scales"].float()
    rows, num_groups = scales.shape
    if s.kind == "int8":
        q = t["weight"].float()
    elif s.kind == "q1":
        q = _unpack_bits(t["weight"]).float() * 2.0 - 1.0
    else:
        q = unpack_codes(t["weight"], s.bits).float()
    q = q.reshape(rows, num_groups, s.group_size)
    w = q * scales.unsqueeze(-1)
    if s.has_biases():
        w = w + t["biases"].float().unsqueeze(-1)
    return w.reshape(rows, num_groups * s.group_size).to(dtype)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (0 <= q < 2^bits) -> uint32 [N, K*bits/32], element j at bits (j % per)*bits."""
    per = 32 // bits
    rows, cols = q.shape
    q = q.to(torch.int64).reshape(rows, cols // per, per)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    words = (q << shifts).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    return words.to(torch.uint32)


def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=words.device) * bits
    # int32 view: an arithmetic shift's sign bits land above the mask, so the codes are exact
    q = (words.view(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(words.shape[0], -1)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    rows, cols = bits.shape
    b = bits.to(torch.int32).reshape(rows, cols // 8, 8)
    return (b << torch.arange(8, dtype=torch.int32, device=b.device)).sum(-1).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], -1)
