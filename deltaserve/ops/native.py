"""Small C kernels for the CPU, compiled on first use with the system C compiler and loaded by ctypes.

No torch headers (a build takes well under a second); built with -march=native (or
DELTASERVE_CPU_MARCH) into the cache folder, keyed by source and flags (ops/native_cache.py checks
a build before loading it). The vector paths take AVX-512 or, on CPUs without it (most laptops),
AVX2 + FMA (csrc/simd.h); elsewhere their scalar loops run; `isa_paths()` says which were built. If
no compiler works, callers fall back to torch.
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
from deltaserve.ops import native_cache

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
_LAYOUT = "sha256-v2"  # cache layout: builds from before the recorded hash get a new key, unread
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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (avx2, avx512_vnni, amx_bf16; ARM: asimd, ...);
    empty where /proc/cpuinfo has none."""
    line = _cpu_signature()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def _compile(cc: str, flags: list[str], out: Path) -> bool:
    proc = subprocess.run(
        [cc, *flags, *map(str, _SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(
            f"deltaserve: building CPU kernels failed; using torch's path ({proc.stderr.strip()[:200]})",
            file=sys.stderr,
        )
    return proc.returncode == 0


def build(march: str | None = None, cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The kernels compiled for -march=`march` (default DELTASERVE_CPU_MARCH, else native; tests
    build the AVX2 and scalar paths this way on an AVX-512 machine), cached under cache_dir
    (default: the cache folder) by source and flags; None if no compiler works. A cached build
    is loaded only if it passes ops/native_cache's checks, else rebuilt."""
    cc = _compiler()
    if cc is None:
        return None
    march = march or env().cpu_march
    flags = [*_FLAGS, f"-march={march}"]
    source = b"".join(f.read_bytes() for f in (*_SOURCES, *_HEADERS))
    # -march=native means this CPU: a cache folder shared with another machine (NFS, an image)
    # must not hand an AVX-512 build to an AVX2 one
    host = _cpu_signature() if march == "native" else ""
    key = hashlib.sha256(source + " ".join([cc, *flags, host, _LAYOUT]).encode()).hexdigest()[:16]
    key_dir = (cache_dir or env().cache_dir) / "native" / key
    with native_cache.locked(key_dir):
        path, why = native_cache.verified(key_dir)
        if why is not None:
            print(f"deltaserve: not loading the cached CPU kernels ({why}); rebuilding",
                  file=sys.stderr)
        if path is None:
            path = native_cache.install(key_dir, lambda out: _compile(cc, flags, out))
            if path is None:
                return None
        lib = ctypes.CDLL(str(path))
    if path.parent != key_dir:  # a private copy (install's fallback): loaded, so no longer needed
        shutil.rmtree(path.parent, ignore_errors=True)
    return _declare(lib)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types of the kernels called from several places (others register beside their
    one caller)."""
    lib.ds_gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.ds_gemv_bf16.restype = None
    lib.ds_rmsnorm.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_float] * 2 + [ctypes.c_int]
    )
    lib.ds_rmsnorm.restype = None
    for name, num_ptrs in (("ds_gemv_q8", 4), ("ds_gemv_a4", 5), ("ds_gemv_q1", 4)):
        fn = getattr(lib, name)  # ..., num_threads, scale_kind (ops/qgemv.scale_kind)
        fn.argtypes = [ctypes.c_void_p] * num_ptrs + [ctypes.c_long] * 3 + [ctypes.c_int] * 2
        fn.restype = None
    for name, like in (("ds_gemv_q8_vnni", "ds_gemv_q8"), ("ds_gemv_a4_vnni", "ds_gemv_a4"),
                       ("ds_gemv_q1_vnni", "ds_gemv_q1")):
        if hasattr(lib, name):  # built only where the compiler targets AVX512-VNNI
            getattr(lib, name).argtypes = getattr(lib, like).argtypes
            getattr(lib, name).restype = None
    lib.ds_dequant.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [
        ctypes.c_int
    ] * 2
    lib.ds_dequant.restype = None
    lib.ds_dequant_blocks.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_long, ctypes.c_long, ctypes.c_int]
    lib.ds_dequant_blocks.restype = None
    lib.ds_gemm_blocks.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [
        ctypes.c_int]
    lib.ds_gemm_blocks.restype = None
    if getattr(lib, "ds_gemm_blocks_vnni", None) is not None:  # AVX512-VNNI or AVX2 builds
        lib.ds_gemm_blocks_vnni.argtypes = lib.ds_gemm_blocks.argtypes
        lib.ds_gemm_blocks_vnni.restype = ctypes.c_int
    if getattr(lib, "ds_set_vnni_rows", None) is not None:
        lib.ds_set_vnni_rows.argtypes = [ctypes.c_int]
        lib.ds_set_vnni_rows.restype = None
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
                if _lib is not None:
                    from deltaserve.ops import gemv_rows

                    gemv_rows.configure(_lib)  # rows per block: measured once per CPU
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


# the kernels whose symbols exist only where their instruction set was built
_ISA_SYMBOLS = {"vnni-int8": "ds_gemv_q8_vnni", "vnni-int4": "ds_gemv_a4_vnni",
                "int8-blocks": "ds_gemm_blocks_vnni", "amx-bf16": "ds_gemm_amx"}


def isa_paths(lib: ctypes.CDLL | None = None) -> tuple[str, ...]:
    """The vector paths in the loaded kernels (or `lib`), read from the library itself: "avx512",
    "avx2" or "neon" (the 16-lane loops, csrc/simd.h) else "scalar"; "f16c" (fp16 scales widened by the
    hardware); "vnni-int8" / "vnni-int4" (the int8-activation GEMVs, the 1-bit one with the
    first; "avx2-int8" / "avx2-int4" / "avx2-q1": the same on AVX2's maddubs; "neon-int8": the
    int8 one on ARM's SDOT); "int8-blocks" (the GGUF
    block GEMMs on int8 activations: VNNI, or AVX2's maddubs); "amx-bf16" (the AMX GEMM,
    which also needs the kernel's grant at run time: ops/gemm_amx.available). () without kernels;
    "unknown" first for a library without ds_simd_isa (built before it)."""
    lib = lib if lib is not None else native_lib()
    if lib is None:
        return ()
    isa = getattr(lib, "ds_simd_isa", None)
    if isa is None:  # a library built before ds_simd_isa: its vector path is not recorded
        vector, bits = "unknown", 0
    else:
        bits = int(isa())  # csrc/gemv_quant.c: 1 AVX2 + FMA, 2 AVX-512, 4 F16C, 8 NEON
        vector = "avx512" if bits & 2 else "avx2" if bits & 1 else "neon" if bits & 8 else \
            "scalar"
    paths = [name for name, symbol in _ISA_SYMBOLS.items() if hasattr(lib, symbol)]
    if hasattr(lib, "ds_int8_act_sdot"):  # ARM's SDOT kernel under the same symbol
        paths[paths.index("vnni-int8")] = "neon-int8"
    if hasattr(lib, "ds_int8_act_avx2"):  # the int8 GEMV's symbol is gemv_q8_avx2.c's
        paths[paths.index("vnni-int8")] = "avx2-int8"
    if hasattr(lib, "ds_int4_act_avx2"):  # and the 4-bit one's
        paths[paths.index("vnni-int4")] = "avx2-int4"
    if hasattr(lib, "ds_q1_act_avx2"):  # the 1-bit one (VNNI builds: part of "vnni-int8")
        paths.insert(paths.index("avx2-int4") + 1, "avx2-q1")
    return (vector, *(["f16c"] if bits & 4 else []), *paths)
