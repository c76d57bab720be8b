"""Small C kernels for the CPU, compiled on first use with the system C compiler and loaded by ctypes.

No torch headers (a build takes well under a second); built with -march=native into the cache
folder, keyed by source and flags. The vector paths take AVX-512 or, on CPUs without it (most
laptops), AVX2 + FMA (csrc/simd.h); elsewhere their scalar loops run. If no compiler works,
callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from deltaserve.env import env

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """The CPU's feature flags (Linux), else the machine name."""
    try:
        with open("/proc/cpuinfo") as lines:  # the first CPU's entry: the rest is generated lazily
            for line in lines:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def build(march: str = "native", cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The kernels compiled for -march=`march` (tests build the AVX2 and scalar paths this way on
    an AVX-512 machine), cached under cache_dir (default: the cache folder) by source and flags;
    None if no compiler works."""
    cc = _compiler()
    if cc is None:
        return None
    flags = [*_FLAGS, f"-march={march}"]
    source = b"".join(f.read_bytes() for f in (*_SOURCES, *_HEADERS))
    # -march=native means this CPU: a cache folder shared with another machine (NFS, an image)
    # must not hand an AVX-512 build to an AVX2 one
    host = _cpu_signature() if march == "native" else ""
    key = hashlib.sha256(source + " ".join([cc, *flags, host]).encode()).hexdigest()[:16]
    out = (cache_dir or env().cache_dir) / "native" / key / "libdeltaserve_cpu.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        proc = subprocess.run(
            [cc, *flags, *map(str, _SOURCES), "-o", str(tmp), "-lm"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            print(
                f"deltaserve: building CPU kernels failed; using torch's path ({proc.stderr.strip()[:200]})",
                file=sys.stderr,
            )
            return None
        tmp.replace(out)
    return _declare(ctypes.CDLL(str(out)))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types of the kernels called from several places (others register beside their
    one caller)."""
    lib.ds_gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.ds_gemv_bf16.restype = None
    lib.ds_gdn_decode.argtypes = (
        [ctypes.c_void_p] * 11 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_int]
    )
    lib.ds_gdn_decode.restype = None
    lib.ds_rmsnorm.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float] * 2 + [ctypes.c_int]
    )
    lib.ds_rmsnorm.restype = None
    for name, num_ptrs in (("ds_gemv_q8", 4), ("ds_gemv_a4", 5), ("ds_gemv_q1", 4)):
        fn = getattr(lib, name)  # ..., num_threads, scale_kind (ops/qgemv.scale_kind)
        fn.argtypes = [ctypes.c_void_p] * num_ptrs + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
        fn.restype = None
    for name, like in (("ds_gemv_q8_vnni", "ds_gemv_q8"), ("ds_gemv_a4_vnni", "ds_gemv_a4")):
        if hasattr(lib, name):  # built only where the compiler targets AVX512-VNNI
            getattr(lib, name).argtypes = getattr(lib, like).argtypes
            getattr(lib, name).restype = None
    lib.ds_dequant.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [
        ctypes.c_int
    ] * 2
    lib.ds_dequant.restype = None
    return lib


def native_lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None when disabled (DELTASERVE_NATIVE=0) or unbuildable here."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:  # another thread asking meanwhile waits for the build, not None
        if not _tried:
            try:
                _lib = build() if env().native else None
            except OSError as exc:
                print(f"deltaserve: CPU kernels unavailable ({exc}); using torch's path",
                      file=sys.stderr)
                _lib = None
            _tried = True
    return _lib


def simd_lanes() -> int:
    """16 where the kernels' vector paths are built (AVX-512, or AVX2 + FMA), else 0 (their scalar
    loops run; no kernels: 0)."""
    lib = native_lib()
    fn = getattr(lib, "ds_simd_lanes", None) if lib is not None else None
    return int(fn()) if fn is not None else 0
