"""Quantization schemes: the plain torch reference for packing and unpacking each layout.

Groups run along the input (last) axis. Layouts (docs/formats.md):
  int8    symmetric, w = s * q, q int8 [N, K], one scale per group (ours; GGUF Q8_0 is group 32)
  affine  w = s * q + b, q unsigned `bits`-bit codes packed low-bits-first into little-endian
          uint32 words [N, K * bits / 32] (ours int4 = MLX 4-bit; MLX 8-bit; GGUF Q4_0 mapped here)
  q1      w = s * (2b - 1), bits packed LSB-first into uint8 [N, K / 8] (GGUF Q1_0 semantics)
Scales/biases keep the file's float dtype; dequantization computes in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.errors import CheckpointError

KINDS = ("int8", "affine", "q1")


@dataclass(frozen=True, slots=True)
class Scheme:
    kind: str  # one of KINDS
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        ok = {"int8": (8,), "affine": (2, 3, 4, 5, 6, 8), "q1": (1,)}
        if self.kind not in ok or self.bits not in ok[self.kind]:
            raise CheckpointError(f"unsupported quantization {self.kind} with {self.bits} bits")
        if self.group_size < 8 or self.group_size % 8:
            raise CheckpointError(f"unsupported quantization group size {self.group_size}")
        if self.kind == "affine" and 32 % self.bits:
            raise CheckpointError(f"affine {self.bits}-bit codes do not pack into uint32 words")

    def packed_shape(self, rows: int, cols: int) -> tuple[int, int]:
        if self.kind == "int8":
            return rows, cols
        if self.kind == "q1":
            return rows, cols // 8
        return rows, cols * self.bits // 32

    def packed_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "q1": torch.uint8, "affine": torch.uint32}[self.kind]

    def has_biases(self) -> bool:
        return self.kind == "affine"

    def check_cols(self, cols: int, name: str) -> None:
        if cols % self.group_size:
            raise CheckpointError(
                f"'{name}': {cols} inputs are not a multiple of the group size {self.group_size}"
            )


INT8 = Scheme("int8", 8, 64)
INT4 = Scheme("affine", 4, 64)
Q1 = Scheme("q1", 1, 128)
FORMATS = {"int8": INT8, "int4": INT4, "q1": Q1}


def quantize(w: torch.Tensor, s: Scheme, scale_dtype: torch.dtype = torch.float16) -> dict:
    """w [N, K] float -> {"weight", "scales"[, "biases"]}: the reference encoder."""
    rows, cols = w.shape
    s.check_cols(cols, "weight")
    g = w.float().reshape(rows, cols // s.group_size, s.group_size)
    if s.kind == "int8":
        scale = (g.abs().amax(-1) / 127.0).to(scale_dtype)
        sf = scale.float().unsqueeze(-1)
        q = torch.where(sf > 0, g / sf.clamp_min(1e-30), 0.0).round().clamp(-127, 127)
        return {"weight": q.to(torch.int8).reshape(rows, cols), "scales": scale}
    if s.kind == "q1":
        scale = g.abs().mean(-1).to(scale_dtype)  # PrismML's encoder: d = mean |x| of the group
        bits = (g >= 0).reshape(rows, cols)
        return {"weight": _pack_bits(bits), "scales": scale}
    levels = (1 << s.bits) - 1
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / levels).clamp_min(1e-12).to(scale_dtype)
    bias = lo.to(scale_dtype)
    q = ((g - bias.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round().clamp(0, levels)
    return {"weight": pack_codes(q.reshape(rows, cols).to(torch.int64), s.bits),
            "scales": scale, "biases": bias}


def dequantize(t: dict, s: Scheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """{"weight", "scales"[, "biases"]} (any leading rows) -> w [N, K] in `dtype`, computed in fp32."""
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
