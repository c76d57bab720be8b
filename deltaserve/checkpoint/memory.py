"""Transparent huge pages under large CPU weight tensors (Linux, THP in `madvise` mode).

Decode streams every weight once per token; on 4 KiB pages that is a TLB miss every 4 KiB. Advised
before the checkpoint is copied in, the weights land on 2 MiB pages: 0.8B bf16 decode measured
~9.0 -> ~9.9 tok/s on the 2-core Xeon (docs/journal/2026-11-29-issue-2-cpu-engine.md).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024
MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(tensors: list[torch.Tensor], min_bytes: int = 2 * HUGE_PAGE_BYTES) -> int:
    """madvise(MADV_HUGEPAGE) the whole 2 MiB pages inside each large CPU tensor; returns how many
    tensors were advised (0 where unsupported). Must run before the memory is first written."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for t in tensors:
        num_bytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or num_bytes < min_bytes:
            continue
        start = -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # round the start up
        end = (t.data_ptr() + num_bytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end > start and libc.madvise(start, end - start, MADV_HUGEPAGE) == 0:
            advised += 1
    return advised
