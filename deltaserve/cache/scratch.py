"""A scratch arena: one reused buffer per (device, dtype) for a step's temporaries (a narrow weight
widened for a prefill GEMM, a packed weight dequantized), so a projection never allocates (and
page-faults) a fresh weight-sized tensor. The engine's lives in its CacheManager, a Sequence has
its own; the step's arena rides on its StepBatch into ops/dispatch.stepping."""

from __future__ import annotations

import math

import torch

MAX_SCRATCH_NUMEL = 64 * 1024 * 1024  # larger (an all-positions vocabulary head): own tensor


class Scratch:
    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A view of the (device, dtype) buffer, grown as needed; valid until the next call (one
        forward at a time uses an arena). Over MAX_SCRATCH_NUMEL: a tensor of its own, so the
        arena never pins a gigabyte."""
        numel = math.prod(shape)
        if numel > MAX_SCRATCH_NUMEL:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def release(self) -> None:
        self._buffers.clear()
