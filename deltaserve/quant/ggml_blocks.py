"""llama.cpp's block-quantized layouts kept as their own bytes: the plain torch reference.

A weight of one of these types is held as the file's blocks, row after row: uint8 [N, K / QK *
bytes] (the scheme kinds below; quant/schemes.py). Every block carries its own scales, so such a
module has no `scales` / `biases` tensors. The native kernels (ops/csrc/gemv_blocks.c) decode the
same bytes; this module is their spec and the path of devices without a kernel. Each decoder
computes in fp32 in the order of the `gguf` package's reference dequantizer (every product here is
exact in fp32, so the values are the file's bit for bit); the layouts are in formats.md section 6.

  q2_k   256 / 84 B   scales[16] (4-bit scale | 4-bit min << 4), qs[64] 2-bit, d, dmin
  q3_k   256 / 110 B  hmask[32], qs[64] 2-bit, scales[12] (16 x 6-bit, -32), d
  q4_k   256 / 144 B  d, dmin, scales[12] (8 x 6-bit scale, 8 x 6-bit min), qs[128] 4-bit
  q5_k   256 / 176 B  d, dmin, scales[12], qh[32] (5th bits), qs[128]
  q6_k   256 / 210 B  ql[128], qh[64], scales[16] int8, d
  iq4_xs 256 / 136 B  d, scales_h (u16), scales_l[4], qs[128] codebook indices
  iq4_nl  32 / 18 B   d, qs[16] codebook indices
  q5_0    32 / 22 B   d, qh (u32), qs[16]        w = d (q - 16)
  q5_1    32 / 24 B   d, m, qh (u32), qs[16]     w = d q + m
"""

from __future__ import annotations

import torch

# kind -> (C type id in gemv_blocks.c, weights per block, bytes per block, nominal bits)
BLOCKS = {
    "q2_k": (0, 256, 84, 2), "q3_k": (1, 256, 110, 3), "q4_k": (2, 256, 144, 4),
    "q5_k": (3, 256, 176, 5), "q6_k": (4, 256, 210, 6), "iq4_xs": (5, 256, 136, 4),
    "iq4_nl": (6, 32, 18, 4), "q5_0": (7, 32, 22, 5), "q5_1": (8, 32, 24, 5),
}
# GGUF tensor type name -> kind
GGUF_TYPES = {name.upper(): name for name in BLOCKS}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block [n, bytes] -> fp32 [n, 1]."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _shifts(x: torch.Tensor, shifts, dim: int) -> torch.Tensor:
    """x (uint8 or int32) with a new axis at `dim` holding x >> s for each s (shifts: a range,
    built on x's device by arange: a host tensor's copy cannot be captured in a CUDA graph)."""
    s = torch.arange(shifts.start, shifts.stop, shifts.step, dtype=x.dtype, device=x.device)
    shape = [1] * (x.dim() + 1)
    shape[dim] = len(shifts)
    return x.unsqueeze(dim) >> s.reshape(shape)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [n, 12] -> (8 six-bit scales, 8 six-bit mins) as fp32."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 63, (hi & 15) | ((a >> 2) & 48)], -1)
    mn = torch.cat([m & 63, (hi >> 4) | ((m >> 2) & 48)], -1)
    return sc.float(), mn.float()


def _nibbles32(qs: torch.Tensor, chunks: int) -> torch.Tensor:
    """[n, chunks * 32] bytes -> [n, 2 * chunks, 32] 4-bit codes: per 32 bytes, low nibbles then
    high nibbles (the K-quants' order)."""
    n = qs.shape[0]
    return (_shifts(qs.reshape(n, chunks, 32), range(0, 8, 4), 2) & 15).reshape(n, 2 * chunks, 32)


def _q2_k(b):
    n = b.shape[0]
    sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 15).float()).unsqueeze(-1)
    ml = (dmin * (sc >> 4).float()).unsqueeze(-1)
    q = (_shifts(qs.reshape(n, 2, 32), range(0, 8, 2), 2) & 3).reshape(n, 16, 16).float()
    return dl * q - ml


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, s, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b, 108)
    low = (_shifts(s[:, :8], range(0, 8, 4), 1) & 15).reshape(n, 16)
    high = (_shifts(s[:, 8:12], range(0, 8, 2), 1) & 3).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int32) - 32).float()
    ql = (_shifts(qs.reshape(n, 2, 32), range(0, 8, 2), 2) & 3).reshape(n, 16, 16)
    qh = (_shifts(hmask.reshape(n, 1, 32), range(8), 2) & 1).reshape(n, 16, 16)
    q = ql.to(torch.int32) - ((qh ^ 1).to(torch.int32) << 2)
    return (d * sc).unsqueeze(-1) * q.float()


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _nibbles32(b[:, 16:144], 4).float()
    return (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    ql = _nibbles32(b[:, 48:176], 4)
    qh = (_shifts(b[:, 16:48].reshape(n, 1, 32), range(8), 2) & 1).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)


def _q6_k(b):
    n = b.shape[0]
    ql = (_shifts(b[:, :128].reshape(n, 2, 64), range(0, 8, 4), 2) & 15).reshape(n, 8, 32)
    qh = (_shifts(b[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 2) & 3).reshape(n, 8, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    q = ((ql | (qh << 4)).to(torch.int32) - 32).reshape(n, 16, 16).float()
    return (_f16(b, 208) * sc).unsqueeze(-1) * q


_PINNED: list[torch.Tensor] = []  # IQ4_VALUES in pinned host memory, made on first CUDA use


def _codebook(idx: torch.Tensor) -> torch.Tensor:
    """IQ4 codebook values of idx. On CUDA the table is copied from pinned memory: a CUDA graph
    may capture that copy (an embedding row decoded inside a decode step), not one from pageable
    memory."""
    if idx.device.type != "cuda":
        return torch.tensor(IQ4_VALUES, dtype=torch.float32)[idx.long()]
    if not _PINNED:
        _PINNED.append(torch.tensor(IQ4_VALUES, dtype=torch.float32).pin_memory())
    return _PINNED[0].to(idx.device, non_blocking=True)[idx.long()]


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b, 0)
    high_bits = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    low = (_shifts(b[:, 4:8], range(0, 8, 4), 2) & 15).reshape(n, 8).to(torch.int32)
    high = _shifts(high_bits, range(0, 16, 2), 1) & 3
    sc = ((low | (high << 4)) - 32).float()
    q = (_shifts(b[:, 8:136].reshape(n, 8, 16), range(0, 8, 4), 2) & 15).reshape(n, 8, 32)
    return (d * sc).unsqueeze(-1) * _codebook(q)


def _iq4_nl(b):
    q = (_shifts(b[:, 2:18], range(0, 8, 4), 1) & 15).reshape(b.shape[0], 32)
    return _f16(b, 0) * _codebook(q)


def _five_bit(b, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 codes 0..31 [n, 32]: qh (4 bytes at `at`, element j's bit j) over 16 bytes of
    nibbles (elements 0-15 low, 16-31 high)."""
    n = b.shape[0]
    qh = b[:, at:at + 4].to(torch.int32)
    qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
    high = _shifts(qh, range(32), 1) & 1
    low = (_shifts(b[:, at + 4:at + 20], range(0, 8, 4), 1) & 15).reshape(n, 32).to(torch.int32)
    return low | (high << 4)


def _q5_0(b):
    return _f16(b, 0) * (_five_bit(b, 2) - 16).float()


def _q5_1(b):
    return _f16(b, 0) * _five_bit(b, 4).float() + _f16(b, 2)


_DECODERS = {"q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
             "iq4_xs": _iq4_xs, "iq4_nl": _iq4_nl, "q5_0": _q5_0, "q5_1": _q5_1}


def dequantize_blocks(raw: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32,
                      rows_per_pass: int = 4096) -> torch.Tensor:
    """raw uint8 [N, K / QK * bytes] -> w [N, K] in `dtype` (computed in fp32), a few thousand
    rows at a time so a vocabulary table's temporaries stay small."""
    _, qk, nbytes, _ = BLOCKS[kind]
    rows, width = raw.shape
    if width % nbytes:
        raise ValueError(f"{kind}: a row of {width} bytes is not whole {nbytes}-byte blocks")
    out = torch.empty(rows, width // nbytes * qk, dtype=dtype, device=raw.device)
    for start in range(0, rows, rows_per_pass):
        part = raw[start:start + rows_per_pass]
        blocks = part.reshape(-1, nbytes)
        out[start:start + part.shape[0]] = _DECODERS[kind](blocks).reshape(part.shape[0], -1)
    return out
