"""Decode GEMV: fp32 activations times bf16/fp16 weights, fp32 accumulation, weights read once.

torch's bf16 GEMV on CPUs without AMX both rounds the activations/outputs to bf16 and reaches only
~11 GB/s in the model; an inductor-generated loop that widens each weight on the fly reads the
narrow weight at ~20-25 GB/s and keeps everything else fp32 (bf16 decode == fp32 math on bf16 weights).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from deltaserve.env import env

_compiled = None
_failed = False


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M,K] fp32; weight [N,K] any float dtype -> [M,N] fp32."""
    return F.linear(x.float(), weight.float())


def _widened_dot(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight.float() * x.float().unsqueeze(-2)).sum(-1)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1,K] fp32; weight [N,K] bf16/fp16 on CPU -> [1,N] fp32 (reference path on request/failure)."""
    global _compiled, _failed
    if _failed or not env().compile or env().reference_ops:
        return gemv_ref(x, weight)
    if _compiled is None:
        _compiled = torch.compile(_widened_dot, dynamic=True)
    try:
        return _compiled(x, weight)
    except Exception as exc:  # no C++ compiler, unsupported platform: stay correct, just slower
        _failed = True
        print(
            f"deltaserve: compiled GEMV unavailable ({type(exc).__name__}); using torch's path",
            file=sys.stderr,
        )
        return gemv_ref(x, weight)
