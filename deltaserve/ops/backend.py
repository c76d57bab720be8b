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


if triton is not None:
    try:  # Hopper grid-dependency control (Triton >= 3.4); without it PDL stays off
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
        HAS_GDC = True
    except ImportError:  # the no-ops keep kernels' ASTs resolvable; pdl_supported() says no
        HAS_GDC = False

        @triton.jit
        def gdc_wait():
            pass

        @triton.jit
        def gdc_launch_dependents():
            pass
else:
    HAS_GDC = False


@functools.cache
def pdl_supported() -> bool:
    """Programmatic dependent launch needs Triton's launch_pdl (3.4+), CUDA 12.3+ and an sm_90+
    NVIDIA GPU (griddepcontrol is PTX)."""
    if triton is None or not HAS_GDC or not torch.cuda.is_available() or torch.version.hip:
        return False
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    # PDL edges survive CUDA-graph capture from CUDA 12.3
    return (major, minor) >= (3, 4) and cuda >= (12, 3) and _capability() >= (9, 0)


def pdl_enabled() -> bool:
    """Whether our Triton kernels launch with programmatic dependent launch (sm_90+ GPUs, unless
    DELTASERVE_PDL=0): each kernel may start while its predecessor finishes, runs what reads no
    predecessor output (a GEMV's weight loads) and waits (gdc_wait) before the rest. On the
    H200 this took batch-1 int8 decode from 1,250 to 1,528 tok/s
    (docs/journal/2026-11-29-issue-6-gpu-decode.md)."""
    return env().pdl and pdl_supported()


def pdl_launch(on: bool) -> dict:
    """The launch keywords for a kernel whose PDL constexpr is `on` (no keyword when off)."""
    return {"launch_pdl": True} if on else {}


def pdl_args() -> dict:
    """A decode kernel's PDL constexpr and launch keyword, as pdl_enabled() says."""
    on = pdl_enabled()
    return {"PDL": on, **pdl_launch(on)}
