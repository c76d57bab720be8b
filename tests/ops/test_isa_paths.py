"""Which vector paths the CPU kernels were built with (ops/native.isa_paths), against the
compiler's target and this CPU: a test of an ISA-specific kernel (tests/isa.py) then skips only
where the machine or DELTASERVE_CPU_MARCH lacks the path, never because a build dropped it. And
the suite's ISA-specific tests pass on an AVX2 build (an AVX2-only CPU), as they once did not."""

from __future__ import annotations

import io
import os
import platform
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from deltaserve.env import env
from deltaserve.ops import native
from deltaserve.ops.native import build, cpu_flags, isa_paths, native_lib

REPO = Path(__file__).resolve().parents[2]


def macros(march: str) -> set[str]:
    """The compiler's predefined macros for -march=`march` (what csrc/*.c test to pick paths)."""
    cc = native._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = subprocess.run(
        [cc, f"-march={march}", "-dM", "-E", "-"],
        input="",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


def paths_of(have: set[str], names: dict[str, str]) -> tuple[str, ...]:
    """The paths csrc/*.c build given the features in `have`, spelled through `names` (feature ->
    macro or cpuinfo flag): the same conditions as simd.h, scales.h, gemv_vnni.c, gemv_blocks_*.c,
    gemm_amx.c."""
    on = {feature for feature, name in names.items() if name in have}
    vector = "avx512" if "avx512f" in on else "avx2" if {"avx2", "fma"} <= on else "scalar"
    paths = [vector, *(["f16c"] if "f16c" in on else [])]
    if {"avx512vnni", "avx512bw"} <= on:
        paths += ["vnni-int8", "vnni-int4", "int8-blocks"]
    elif {"avx2", "fma"} <= on:  # gemv_q8_avx2.c, gemv_blocks_avx2.c
        paths += ["avx2-int8", "avx2-int4", "avx2-q1", "int8-blocks"]
    if {"amx_tile", "amx_bf16", "avx512bf16"} <= on and sys.platform == "linux":
        paths.append("amx-bf16")
    return tuple(paths)


FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vnni",
    "avx512bf16",
    "amx_tile",
    "amx_bf16",
)
MACRO = {f: f"__{f.upper()}__" for f in FEATURES}
FLAG = {**{f: f for f in FEATURES}, "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"}


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx f16c fma avx2 bmi2
bugs\t\t: sysret_ss_attrs
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes crc32 atomics fphp asimdhp asimddp sve
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (X86_CPUINFO, {"avx2", "fma", "f16c"}),
        (ARM_CPUINFO, {"asimd", "asimddp", "sve"}),
        ("", set()),
    ],
    ids=["x86 flags", "arm Features", "none"],
)
def test_cpu_flags_reads_x86_and_arm_cpuinfo(monkeypatch, text, want) -> None:
    monkeypatch.setattr(native, "open", lambda *a, **k: io.StringIO(text), raising=False)
    flags = cpu_flags()
    assert want <= flags and "0x41" not in flags and "sysret_ss_attrs" not in flags
    assert bool(flags) == bool(text)


def test_isa_paths_of_a_library_built_before_ds_simd_isa() -> None:
    """Its vector path is unknown; the ISA-specific kernels still show by their symbols."""
    old = types.SimpleNamespace(ds_simd_lanes=lambda: 16, ds_gemv_q8_vnni=print)
    assert isa_paths(old) == ("unknown", "vnni-int8")


def test_the_loaded_kernels_have_every_path_their_target_allows() -> None:
    lib = native_lib()
    if lib is None:
        pytest.skip("no native kernels (DELTASERVE_NATIVE=0 or no compiler)")
    assert isa_paths(lib) == paths_of(macros(env().cpu_march), MACRO)


def test_a_native_build_has_every_path_this_cpu_has() -> None:
    """Run whatever DELTASERVE_CPU_MARCH says: the -march=native build is checked here either way
    (on a VNNI CPU a missing VNNI kernel fails here rather than skipping its tests)."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    want = paths_of(flags, FLAG) if platform.machine() == "x86_64" else ("scalar",)
    target = paths_of(macros("native"), MACRO)
    if target != want:
        pytest.skip(f"the compiler targets {target} on this CPU, whose flags allow {want}")
    lib = build("native")
    assert lib is not None and isa_paths(lib) == want


def test_the_qgemv_tests_pass_on_an_avx2_build(tmp_path) -> None:
    """The class of failure an AVX2-only CPU (AMD EPYC) once showed: tests asserting that AVX-512
    VNNI kernels exist. The quantized GEMV tests run in a subprocess on an x86-64-v3 build (AVX2 +
    FMA + F16C, no AVX-512) in a fresh cache folder: they pass, the VNNI-only ones skipped."""
    if platform.machine() != "x86_64" or not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU cannot run -march=x86-64-v3 code")
    if native._compiler() is None:
        pytest.skip("no C compiler")
    run_env = {
        **os.environ,
        "DELTASERVE_CPU_MARCH": "x86-64-v3",
        "DELTASERVE_CACHE_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/ops/test_qgemv.py",
            "tests/ops/test_qgemv_a4_vnni.py",
        ],
        cwd=REPO,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "lacks AVX512-VNNI; built paths: avx2, f16c" in proc.stdout, tail
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|skipped|failed)", tail))
    # the AVX2 int8 / int4 / q1 kernels' tests run (82 passed on 12-07); the VNNI-only ones skip (2)
    assert counts.get("failed", 0) == 0 and counts["passed"] > 60 and counts["skipped"] >= 1, tail
