"""Where Triton kernel tests run: the CUDA GPU, or the CPU under Triton's interpreter
(TRITON_INTERPRET=1, set before the kernels are imported), or nowhere (the test skips)."""

from __future__ import annotations

import os

import pytest

from deltaserve.ops.backend import triton, triton_enabled


def kernel_device() -> str | None:
    if triton_enabled():
        return "cuda"
    if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


KDEV = kernel_device()
needs_kernels = pytest.mark.skipif(KDEV is None, reason="needs CUDA and Triton, or TRITON_INTERPRET=1")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
