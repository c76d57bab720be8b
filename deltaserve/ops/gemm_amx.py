"""fp32 GEMMs on the CPU's AMX bf16 tiles with fp32 results (csrc/gemm_amx.c).

torch's fp32 GEMM runs ~0.3 TFLOP/s on a 2-core Xeon with AMX, its bf16 GEMM ~2 TFLOP/s but rounds
the output to bf16 (and has no fp32-output kernel on CPU). The split keeps fp32 accuracy: x = hi +
lo as two bf16 parts (16 significant bits), W as one bf16 part when its values are bf16 (MiniCPM-V's
vision weights ship as bf16) or hi + lo otherwise; every bf16 product is exact in fp32 and AMX sums
in fp32. Relative error ~1e-6 (fp32 GEMM: ~2e-7); `gemm_amx_ref` is the math in torch.
Non-finite inputs differ from F.linear where W has a lo part: inf * 0 in the xh.Wl product gives
NaN where F.linear gives inf, and |x| within half a bf16 step of fp32's maximum rounds to inf.
Activations of a working model are far from either (bf16-valued weights have no lo part).
With a lo part the packed tiles are W's size in bytes again, next to W.

Shapes: M rows, K input width, N output width; packed weights [Np/16, Kp/32, 16, 32] bf16 with
Np, Kp rounded up to 32 (one 16 x 32 AMX B tile per [16, 32] block).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops.native import native_lib

TILE = 32  # row, column and K granularity of the kernel's blocks
# Below this many rows torch's fp32 GEMM is as fast (measured 2026-11-30 on the 2-core Xeon with a
# scratch script, never committed: a 1152 x 1152 product at 16 rows ties; the tower runs 64+ rows)
MIN_ROWS = 32


@functools.cache
def _kernel():
    """The native AMX GEMM, or None where not built (no AMX-BF16 target) or not granted."""
    lib = native_lib()
    fn = getattr(lib, "ds_gemm_amx", None) if lib is not None else None
    if fn is None or not lib.ds_amx_init():
        return None
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
    fn.restype = None
    return fn


def available() -> bool:
    """Whether the AMX kernel runs here and is allowed (DELTASERVE_AMX)."""
    return env().amx and _kernel() is not None


def _round_up(n: int) -> int:
    return -(-n // TILE) * TILE


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t fp32 -> (hi, lo) bf16 with hi = bf16(t), lo = bf16(t - hi) (round to nearest even; lo = 0
    where hi is infinite)."""
    hi = t.bfloat16()
    rest = t - hi.float()
    return hi, torch.where(hi.float().isinf(), 0.0, rest).bfloat16()


@dataclass(frozen=True)
class PackedWeight:
    """W [N, K] as AMX B tiles: `hi` and, unless W's values are bf16, `lo`."""

    hi: torch.Tensor
    lo: torch.Tensor | None
    out_features: int
    in_features: int


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> [Np/16, Kp/32, 16, 32]: tile (n/16, k/32) row r holds the pairs (k = 2r,
    2r + 1) of its 16 columns, as TDPBF16PS reads B."""
    n, k = w.shape
    padded = F.pad(w, (0, _round_up(k) - k, 0, _round_up(n) - n))
    num_n, num_k = padded.shape[0] // 16, padded.shape[1] // 32
    tiles = padded.view(num_n, 16, num_k, 16, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(num_n, num_k, 16, 32)


def pack_weight(w: torch.Tensor) -> PackedWeight:
    """W [N, K] (any float dtype) -> its tiles; the lo part only where W is not bf16-exact."""
    hi, lo = split_bf16(w.detach().float())
    exact = not bool(lo.float().any())
    return PackedWeight(_tiles(hi), None if exact else _tiles(lo), w.shape[0], w.shape[1])


def packed_for(owner: object, weight: torch.Tensor) -> PackedWeight:
    """The tiles of `weight` [N, K], packed at first use and kept on `owner` (the module holding
    it) until the weight's storage or version changes (a reload writes it in place)."""
    stamp = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = getattr(owner, "_amx_packed", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, pack_weight(weight))
        object.__setattr__(owner, "_amx_packed", cached)
    return cached[1]


def gemm_amx(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gelu_tanh: bool = False,
) -> torch.Tensor:
    """residual + act(x W^T + bias) with act = tanh GELU or none: x fp32 [..., K], residual fp32
    [..., N] -> fp32 [..., N] on the AMX kernel (the caller checks `available()`). The epilogue
    runs while each output block is in cache: no extra passes over [M, N]."""
    fn = _kernel()
    x2 = x.reshape(-1, w.in_features).contiguous()
    rows = x2.shape[0]
    y = torch.empty(rows, w.out_features, dtype=torch.float32)
    scratch = torch.empty(2, _round_up(rows), _round_up(w.in_features), dtype=torch.bfloat16)
    b = bias.contiguous().float() if bias is not None else None
    r = residual.reshape(rows, w.out_features).contiguous().float() if residual is not None else None
    fn(
        x2.data_ptr(), w.hi.data_ptr(), w.lo.data_ptr() if w.lo is not None else None,
        b.data_ptr() if b is not None else None, r.data_ptr() if r is not None else None,
        y.data_ptr(), scratch.data_ptr(), rows, w.out_features, w.in_features, int(gelu_tanh),
        torch.get_num_threads(),
    )
    return y.view(*x.shape[:-1], w.out_features)


def gemm_amx_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gelu_tanh: bool = False,
) -> torch.Tensor:
    """The kernel's math in torch (fp64 sums of the same split products, then torch's own fp32
    GELU and add): x fp32 [..., K], W [N, K] -> fp32 [..., N]."""
    xh, xl = (p.double() for p in split_bf16(x.float()))
    wh, wl = (p.double() for p in split_bf16(w.float()))
    y = xh @ wh.T + xl @ wh.T + xh @ wl.T
    y = (y + bias.double() if bias is not None else y).float()
    if gelu_tanh:
        y = F.gelu(y, approximate="tanh")
    return y if residual is None else residual + y
