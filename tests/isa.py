"""Markers for tests of ISA-specific CPU kernels: each runs where the loaded kernels have its path
(ops/native.isa_paths, read from the library) and skips, saying why, where they do not. A skip
cannot hide a broken build: tests/ops/test_isa_paths.py checks that the build has every path its
CPU and -march allow."""

from __future__ import annotations

import pytest

from deltaserve.ops import gemm_amx
from deltaserve.ops.native import isa_paths

PATHS = isa_paths()
SKIP_PREFIX = "the loaded CPU kernels have no"  # conftest's summary counts these skips
_WHY = (
    SKIP_PREFIX + " {} (the CPU, or DELTASERVE_CPU_MARCH, lacks {}; "
    f"built paths: {', '.join(PATHS) or 'none'})"
)

needs_vnni_int8 = pytest.mark.skipif(
    "vnni-int8" not in PATHS, reason=_WHY.format("int8-activation int8 GEMV", "AVX512-VNNI")
)
needs_vnni_int4 = pytest.mark.skipif(
    "vnni-int4" not in PATHS, reason=_WHY.format("int8-activation int4 GEMV", "AVX512-VNNI")
)
# the int8 GEMV on int8 activations of either build (AVX512-VNNI, or AVX2's maddubs)
needs_int8_act = pytest.mark.skipif(
    not {"vnni-int8", "avx2-int8"} & set(PATHS),
    reason=_WHY.format("int8-activation int8 GEMV", "AVX512-VNNI and AVX2"),
)
# the 4-bit affine GEMV on int8 activations of either build
needs_int4_act = pytest.mark.skipif(
    not {"vnni-int4", "avx2-int4"} & set(PATHS),
    reason=_WHY.format("int8-activation int4 GEMV", "AVX512-VNNI and AVX2"),
)
# the 1-bit GEMV on int8 activations (VNNI builds have it with their int8 one)
needs_q1_act = pytest.mark.skipif(
    not {"vnni-int8", "avx2-q1"} & set(PATHS),
    reason=_WHY.format("int8-activation 1-bit GEMV", "AVX512-VNNI and AVX2"),
)
without_int8_act = pytest.mark.skipif(
    bool({"vnni-int8", "avx2-int8"} & set(PATHS)),
    reason="an int8-activation int8 GEMV is built here: the fallback is not used",
)
# built and granted by Linux (ops/gemm_amx._kernel asks for the tile state)
needs_amx = pytest.mark.skipif(
    gemm_amx._kernel() is None,
    reason=_WHY.format("AMX-BF16 GEMM (or Linux refused its tiles)", "AMX-BF16"),
)
