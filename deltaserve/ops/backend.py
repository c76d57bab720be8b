"""The GPU backend: "triton" (our Triton kernels: quantized GEMV, GDN decode, norms, rotary; needs
compute capability 8.0+) or "portable" (torch ops and cuBLAS only: any CUDA GPU torch supports, and
the reference the Triton path is checked against). DELTASERVE_GPU_BACKEND=auto|triton|portable.
"""

from __future__ import annotations

import functools

import torch

from deltaserve.env import env

try:  # the one place that imports triton: the kernel modules take it (or None) from here
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None
from deltaserve.errors import ConfigError

BACKENDS = ("auto", "triton", "portable")
TRITON_MIN_CAPABILITY = (8, 0)


def _triton_importable() -> bool:
    return triton is not None


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


@functools.cache
def _resolve(requested: str) -> str:
    if requested not in BACKENDS:
        raise ConfigError(f"DELTASERVE_GPU_BACKEND must be one of {', '.join(BACKENDS)}, got "
                          f"{requested!r}")
    if requested == "portable" or not torch.cuda.is_available():
        return "portable"
    capable = _capability() >= TRITON_MIN_CAPABILITY and _triton_importable()
    if requested == "triton" and not capable:
        major, minor = _capability()
        raise ConfigError(
            f"the triton GPU backend needs compute capability >= 8.0 and the triton package; this "
            f"GPU is sm_{major}{minor}{'' if _triton_importable() else ' and triton is missing'}: "
            "use DELTASERVE_GPU_BACKEND=portable (or auto)"
        )
    return "triton" if capable else "portable"


def gpu_backend() -> str:
    """The backend CUDA tensors run on, resolved once per requested value."""
    return _resolve(env().gpu_backend)


def triton_enabled() -> bool:
    """Triton importable, a CUDA GPU, and the triton backend selected."""
    # _resolve answers "portable" without CUDA; is_available() itself costs ~5 us per call, and
    # this runs before every Triton launch
    return triton is not None and gpu_backend() == "triton"
