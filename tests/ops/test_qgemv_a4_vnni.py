"""The 4-bit affine decode GEMV on int8 activations (ds_gemv_a4_vnni: ops/csrc/gemv_vnni.c, or
gemv_q8_avx2.c on AVX2 CPUs)
against its exact reference (qgemv_act_ref) and against the spec, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.env import env
from deltaserve.ops.native import native_lib
from deltaserve.ops.qgemv import (
    SCALE_KINDS,
    a4_is_vnni,
    qgemm_rows,
    qgemv,
    qgemv_act_ref,
    qgemv_ref,
    quantize_act,
)
from deltaserve.quant.schemes import FORMATS, Scheme, quantize, unpack_codes
from tests.isa import needs_int4_act

# every test here calls the kernel; tests/ops/test_isa_paths.py makes sure a CPU with AVX512-VNNI
# or AVX2 builds it, so these skip only where the CPU or DELTASERVE_CPU_MARCH lacks both
pytestmark = needs_int4_act

INT4 = FORMATS["int4"]


def packed_random(rows: int, cols: int, scheme: Scheme) -> dict:
    return quantize(torch.randn(rows, cols), scheme)  # fp16 scales and biases, as loaded


def vnni(x: torch.Tensor, p: dict, group: int = 64) -> torch.Tensor:
    """The kernel itself (qgemv's dispatch may pick the exact one for a shape)."""
    out = torch.empty(1, p["weight"].shape[0])
    native_lib().ds_gemv_a4_vnni(p["weight"].data_ptr(), p["scales"].data_ptr(),
                                 p["biases"].data_ptr(), x.data_ptr(), out.data_ptr(),
                                 p["weight"].shape[0], x.shape[-1], group, 2,
                                 SCALE_KINDS[p["scales"].dtype])
    return out


# 37, 203 and 5 rows end in a partial block of 4; 896 = 7 chunks of 128 (a partial block of 16
# groups); 3584 = 56 groups (three blocks and a half); 320 and 64 end in a half chunk (64 columns),
# 1088 = a whole block of 16 groups and a half chunk
SHAPES = [(37, 384), (203, 896), (1000, 1024), (5, 3584), (37, 320), (6, 64), (19, 1088)]


@pytest.mark.parametrize(("rows", "cols", "group"), [(*s, 64) for s in SHAPES]
                         + [(203, 896, 128), (40, 1024, 512), (37, 576, 192), (9, 320, 320)])
def test_matches_the_int8_activation_reference(rows, cols, group) -> None:
    scheme = Scheme("affine", 4, group)
    torch.manual_seed(rows * cols + group)
    p, x = packed_random(rows, cols, scheme), torch.randn(1, cols)
    out, ref = vnni(x, p, group), qgemv_act_ref(x, p, scheme)
    # the same integers; only fp32 rounding order differs: bounded by the terms' size
    xq, dx = quantize_act(x.reshape(-1), group)
    q = unpack_codes(p["weight"], 4).float().reshape(rows, -1, group)
    terms = (q * xq.abs()).sum(-1) * (p["scales"].float() * dx).abs() \
        + p["biases"].float().abs() * dx * xq.abs().sum(-1)
    assert ((out - ref).abs() <= 1e-6 * terms.sum(-1)).all()
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5


@pytest.mark.parametrize(("rows", "cols"), SHAPES[:3])
def test_is_within_activation_quantization_of_the_spec(rows, cols) -> None:
    """W x^ (x rounded per group): rel-L2 against dequantize-then-F.linear ~0.6% on gaussian
    data, as the int8 kernel's. Measured 30 seeds per shape: mean 0.59-0.61%, worst 0.84%."""
    torch.manual_seed(rows + cols)
    p, x = packed_random(rows, cols, INT4), torch.randn(1, cols)
    ref = qgemv_ref(x, p, INT4)
    assert ((vnni(x, p) - ref).norm() / ref.norm()).item() <= 1.5e-2


def test_survives_zero_groups_huge_dynamic_range_and_nan() -> None:
    torch.manual_seed(3)
    p = packed_random(203, 1024, INT4)
    zero_group = torch.randn(1, 1024)
    zero_group[0, 64:128] = 0.0
    ranged = torch.randn(1, 1024) * torch.tensor([1e30, 1e-30, 1.0, 1e-20]).repeat_interleave(256)
    for x in (zero_group, ranged, torch.zeros(1, 1024)):
        out, ref = vnni(x, p), qgemv_act_ref(x, p, INT4)
        assert torch.isfinite(out).all() and torch.isfinite(ref).all()
        assert ((out - ref).norm() <= 1e-5 * ref.norm()).item()
    assert not vnni(ranged, p).eq(0).all()
    poisoned = torch.randn(1, 1024)
    poisoned[0, 700] = float("nan")  # a NaN activation reaches y, as in the spec
    assert vnni(poisoned, p).isnan().all() and qgemv_ref(poisoned, p, INT4).isnan().all()


def test_dispatch_follows_the_shape_and_the_knob(monkeypatch) -> None:
    """1024 and 320 columns (a half chunk at the end) take the kernel; groups over 512 the exact
    one, as the C entry itself would; DELTASERVE_EXACT_INT8_ACT=1 the exact one everywhere."""
    torch.manual_seed(5)
    p, x = packed_random(1000, 1024, INT4), torch.randn(1, 1024)
    p320, x320 = packed_random(100, 320, INT4), torch.randn(1, 320)
    big = Scheme("affine", 4, 1024)
    p_big = packed_random(10, 1024, big)
    monkeypatch.delenv("DELTASERVE_EXACT_INT8_ACT", raising=False)
    env.cache_clear()
    try:
        assert a4_is_vnni(native_lib(), 1000, 1024, 64)
        assert torch.equal(qgemv(x, p, INT4), vnni(x, p))
        assert a4_is_vnni(native_lib(), 100, 320, 64)
        assert torch.equal(qgemv(x320, p320, INT4), vnni(x320, p320))
        assert not a4_is_vnni(native_lib(), 10, 1024, 1024)
        assert torch.equal(qgemv(x, p_big, big), vnni(x, p_big, 1024))  # the C entry falls back
        rel_big = (qgemv(x, p_big, big) - qgemv_ref(x, p_big, big)).norm()
        assert (rel_big / qgemv_ref(x, p_big, big).norm()).item() <= 1e-5
        monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")
        env.cache_clear()
        exact = qgemv(x, p, INT4)
        multi = qgemm_rows(x.repeat(3, 1), p, INT4)
    finally:
        env.cache_clear()
    assert not torch.equal(exact, vnni(x, p))
    assert ((exact - qgemv_ref(x, p, INT4)).norm() / exact.norm()).item() <= 1e-5
    assert torch.equal(multi, exact.repeat(3, 1))


@pytest.mark.parametrize(("cols", "cut"), [(128, 64), (1024, 512), (384, 320)])
def test_a_row_in_two_parts_sums_to_the_whole_row(cols, cut) -> None:
    """What a tensor-parallel shard of a row-parallel layer computes: each part quantizes its own
    groups of x as the whole row does, so the parts' results (a half chunk at a cut of 64 mod
    128) sum to the whole row's within fp32 rounding."""
    torch.manual_seed(cols + cut)
    p, x = packed_random(53, cols, INT4), torch.randn(3, cols)

    def part(lo: int, hi: int) -> dict:
        return {"weight": p["weight"][:, lo // 8 : hi // 8].contiguous(),
                "scales": p["scales"][:, lo // 64 : hi // 64].contiguous(),
                "biases": p["biases"][:, lo // 64 : hi // 64].contiguous()}

    whole = qgemm_rows(x, p, INT4)
    parts = qgemm_rows(x[:, :cut].contiguous(), part(0, cut), INT4) \
        + qgemm_rows(x[:, cut:].contiguous(), part(cut, cols), INT4)
    assert a4_is_vnni(native_lib(), 53, cut, 64) and a4_is_vnni(native_lib(), 53, cols - cut, 64)
    assert ((parts - whole).norm() / whole.norm()).item() <= 1e-6


@pytest.mark.parametrize("num_rows", [2, 5])
def test_multi_row_kernel_gives_each_row_its_gemv_bits(num_rows) -> None:
    torch.manual_seed(num_rows)
    p = packed_random(203, 1024, INT4)
    x = torch.randn(num_rows, 1024) * torch.logspace(-3, 2, num_rows)[:, None]
    got = qgemm_rows(x, p, INT4)
    assert torch.equal(got, torch.cat([vnni(x[r : r + 1], p) for r in range(num_rows)]))
