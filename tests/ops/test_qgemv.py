"""Quantized decode GEMVs against dequantize-then-F.linear, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from deltaserve.env import env
from deltaserve.errors import ConfigError
from deltaserve.ops.native import native_lib, simd_lanes
from deltaserve.ops.qgemv import (
    SCALE_KINDS,
    a4_is_vnni,
    dequantize_into,
    q8_is_vnni,
    qgemv,
    qgemv_act_ref,
    qgemv_ref,
    quantize_act,
)
from deltaserve.quant.schemes import FORMATS, INT8, Scheme, dequantize, quantize
from tests.isa import needs_int8_act, needs_q1_act, needs_vnni_int8, without_int8_act

SCHEMES = {**FORMATS, "int8-g32": Scheme("int8", 8, 32), "affine8": Scheme("affine", 8, 64)}


@pytest.fixture
def exact_int8(monkeypatch):
    """int8 decode on fp32 activations (the exact kernel), for comparisons with the spec."""
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")
    env.cache_clear()
    yield
    env.cache_clear()


def packed_random(rows: int, cols: int, scheme: Scheme) -> dict:
    return {k: v.float() if v.is_floating_point() else v
            for k, v in quantize(torch.randn(rows, cols), scheme).items()}


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize(("rows", "cols"), [(1, 128), (37, 384), (203, 896), (1000, 1024)])
def test_qgemv_matches_the_reference(name, rows, cols, exact_int8) -> None:
    scheme = SCHEMES[name]
    torch.manual_seed(rows + cols)
    packed = {k: v.float() if v.is_floating_point() else v
              for k, v in quantize(torch.randn(rows, cols), scheme).items()}
    x = torch.randn(1, cols)
    out, ref = qgemv(x, packed, scheme), qgemv_ref(x, packed, scheme)
    assert out.shape == (1, rows)
    # fp32 sums in another order: bounded by the size of the terms, not of their (cancelling) sum
    dense = dequantize(packed, scheme)
    magnitude = torch.nn.functional.linear(x.abs(), dense.abs())
    assert ((out - ref).abs() <= 1e-6 * magnitude + 1e-7).all()
    if rows > 1:  # one output can cancel to near zero; many cannot all do so
        assert ((out - ref).norm() / ref.norm()).item() <= 1e-4


def test_native_quantized_kernels_are_built_here() -> None:
    """CI has a compiler: the parity test above must exercise the C kernels, not the fallback."""
    lib = native_lib()
    assert lib is not None and all(hasattr(lib, f) for f in ("ds_gemv_q8", "ds_gemv_a4", "ds_gemv_q1"))


def vnni(x: torch.Tensor, p: dict, group: int = 64) -> torch.Tensor:
    """The int8-activation kernel itself, VNNI or AVX2 (qgemv's dispatch may pick the exact one
    for a shape)."""
    out = torch.empty(1, p["weight"].shape[0])
    native_lib().ds_gemv_q8_vnni(p["weight"].data_ptr(), p["scales"].data_ptr(), x.data_ptr(),
                                 out.data_ptr(), p["weight"].shape[0], x.shape[-1], group, 2,
                                 SCALE_KINDS[p["scales"].dtype])
    return out


# 37, 203 and 5 rows end in a partial block of 4 (the one-row tail path); 1000 fills whole blocks
VNNI_SHAPES = [(37, 384), (203, 896), (1000, 1024), (5, 3584)]


@needs_int8_act
@pytest.mark.parametrize(("rows", "cols", "group"), [(*s, 64) for s in VNNI_SHAPES] + [(203, 896, 128)])
def test_vnni_kernel_matches_the_int8_activation_reference(rows, cols, group) -> None:
    scheme = Scheme("int8", 8, group)
    torch.manual_seed(rows * cols)
    p, x = packed_random(rows, cols, scheme), torch.randn(1, cols)
    out, ref = vnni(x, p, group), qgemv_act_ref(x, p, scheme)
    # the same integers; only fp32 rounding order differs. Lanes hold (w + 128) * xq, so the
    # terms' size is that, not |w| * |xq|
    xq, dx = quantize_act(x.reshape(-1), group)
    w = p["weight"].float().reshape(rows, -1, group)
    terms = ((w.abs() + 128) * xq.abs()).sum(-1) * (p["scales"] * dx)
    assert ((out - ref).abs() <= 1e-6 * terms.sum(-1)).all()
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5


@needs_int8_act
@pytest.mark.parametrize(("rows", "cols"), VNNI_SHAPES[:3])
def test_vnni_kernel_is_within_activation_quantization_of_the_spec(rows, cols) -> None:
    """x rounded to 1/127 of its group's absmax: rel-L2 ~0.6% on gaussian data (rms of a uniform
    rounding error over a 64-sample gaussian absmax). Measured 30 seeds: mean 0.6%, worst 0.95%
    (37 rows); 1.5% leaves margin. Few outputs (5 rows) wander further, so they are not here."""
    torch.manual_seed(rows + cols)
    p, x = packed_random(rows, cols, INT8), torch.randn(1, cols)
    ref = qgemv_ref(x, p, INT8)
    assert ((vnni(x, p) - ref).norm() / ref.norm()).item() <= 1.5e-2


@needs_int8_act
def test_vnni_kernel_survives_zero_groups_and_huge_dynamic_range() -> None:
    torch.manual_seed(3)
    p = packed_random(203, 1024, INT8)
    zero_group = torch.randn(1, 1024)
    zero_group[0, 64:128] = 0.0
    ranged = torch.randn(1, 1024) * torch.tensor([1e30, 1e-30, 1.0, 1e-20]).repeat_interleave(256)
    for x in (zero_group, ranged, torch.zeros(1, 1024)):
        out, ref = vnni(x, p), qgemv_act_ref(x, p, INT8)
        assert torch.isfinite(out).all() and torch.isfinite(ref).all()
        assert ((out - ref).norm() <= 1e-5 * ref.norm()).item()
    assert not vnni(ranged, p).eq(0).all()
    poisoned = torch.randn(1, 1024)
    poisoned[0, 700] = float("nan")  # a NaN activation reaches y, as in the spec
    assert vnni(poisoned, p).isnan().all() and qgemv_ref(poisoned, p, INT8).isnan().all()


@needs_int8_act
def test_int8_decode_dispatch_follows_the_knob(monkeypatch) -> None:
    torch.manual_seed(5)
    p, x = packed_random(1000, 1024, INT8), torch.randn(1, 1024)
    g32 = SCHEMES["int8-g32"]
    p32 = packed_random(1000, 1024, g32)
    monkeypatch.delenv("DELTASERVE_EXACT_INT8_ACT", raising=False)
    env.cache_clear()
    try:
        assert torch.equal(qgemv(x, p, INT8), vnni(x, p))  # 1000x1024: VNNI won there
        # GGUF Q8_0's groups of 32: two per 64-byte chunk (block_vnni32), x rounded per 32
        assert torch.equal(qgemv(x, p32, g32), vnni(x, p32, 32))
        ref32 = qgemv_act_ref(x, p32, g32)
        assert ((qgemv(x, p32, g32) - ref32).norm() / ref32.norm()).item() <= 1e-6
        # groups of 16 fill no chunk: the exact kernel, as the C entry would take
        g16 = Scheme("int8", 8, 16)
        p16 = packed_random(1000, 1024, g16)
        assert torch.equal(qgemv(x, p16, g16), vnni(x, p16, 16))
        assert ((qgemv(x, p16, g16) - qgemv_ref(x, p16, g16)).norm()
                / qgemv_ref(x, p16, g16).norm()).item() <= 1e-5
        monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")
        env.cache_clear()
        exact = qgemv(x, p, INT8)
    finally:
        env.cache_clear()
    assert not torch.equal(exact, vnni(x, p))
    assert ((exact - qgemv_ref(x, p, INT8)).norm() / exact.norm()).item() <= 1e-5


Q1 = FORMATS["q1"]


@needs_q1_act
@pytest.mark.parametrize(("rows", "cols"), [(7, 256), (203, 896), (1000, 1024), (66, 5120)])
def test_q1_vnni_kernel_matches_the_int8_activation_reference(rows, cols) -> None:
    """1-bit codes (GGUF Q1_0) on int8 activations: the bits of W x^ (x rounded per group of 128,
    the reference's exact integer dots); within the activation rounding of the spec; and what
    the dispatcher runs unless DELTASERVE_EXACT_INT8_ACT=1."""
    from deltaserve.ops.qgemv import q1_is_vnni

    torch.manual_seed(rows * cols)
    p = {"weight": torch.randint(0, 256, (rows, cols // 8), dtype=torch.uint8),
         "scales": torch.rand(rows, cols // 128) * 0.02}
    x = torch.randn(1, cols) * torch.logspace(-2, 1, cols)[None, :]
    assert q1_is_vnni(native_lib(), rows, cols, 128)
    out, ref = qgemv(x, p, Q1), qgemv_act_ref(x, p, Q1)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-6
    spec = qgemv_ref(x, p, Q1)
    assert ((out - spec).norm() / spec.norm()).item() <= 1.5e-2
    assert not torch.equal(out, spec)  # the activation rounding is there: the kernel ran


@needs_q1_act
def test_q1_vnni_kernel_follows_the_knob_and_keeps_zero_and_nan_groups(monkeypatch) -> None:
    p = {"weight": torch.randint(0, 256, (64, 32), dtype=torch.uint8),
         "scales": torch.rand(64, 2).half()}
    x = torch.randn(1, 256)
    x[0, :128] = 0.0  # a zero group: d = 0, no 0 * inf
    fast = qgemv(x, p, Q1)
    assert torch.isfinite(fast).all()
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")
    env.cache_clear()
    try:
        exact = qgemv(x, p, Q1)
    finally:
        env.cache_clear()
    assert torch.allclose(exact, qgemv_ref(x, p, Q1), rtol=1e-5, atol=1e-6)
    assert not torch.equal(exact, fast)
    x[0, 200] = float("nan")
    assert qgemv(x, p, Q1).isnan().all()


@needs_vnni_int8
def test_rows_per_block_never_change_a_bit(monkeypatch) -> None:
    """4 weight rows per block or 1 (ops/gemv_rows.py, measured per machine): every
    int8-activation kernel gives the same bits, GEMV and multi-row, rows off the blocks of 4."""
    from deltaserve.ops import gemv_rows
    from deltaserve.ops.qgemv import qgemm_rows

    lib = native_lib()
    g32 = Scheme("int8", 8, 32)
    cases = [(INT8, 1024, packed_random(203, 1024, INT8)),
             (g32, 896, packed_random(203, 896, g32)),
             (FORMATS["int4"], 1024, packed_random(203, 1024, FORMATS["int4"])),
             (Q1, 1024, {"weight": torch.randint(0, 256, (203, 128), dtype=torch.uint8),
                         "scales": torch.rand(203, 8)})]
    x = torch.randn(3, 1024)
    got = {}
    try:
        for rows in (1, 4):
            lib.ds_set_vnni_rows(rows)
            got[rows] = [(qgemv(x[:1, :k], p, s), qgemm_rows(x[:, :k], p, s))  # (q1: no multi)
                         for s, k, p in cases]
    finally:
        gemv_rows.configure(lib)
    for (a1, m1), (a4, m4) in zip(got[1], got[4], strict=True):
        assert torch.equal(a1, a4)
        assert (m1 is None and m4 is None) or torch.equal(m1, m4)
    monkeypatch.setenv("DELTASERVE_CPU_GEMV_ROWS", "1")
    env.cache_clear()
    try:
        assert gemv_rows.configure(lib) == 1
        monkeypatch.setenv("DELTASERVE_CPU_GEMV_ROWS", "3")
        env.cache_clear()
        with pytest.raises(ConfigError, match="choose 1, 4 or auto"):
            env()
    finally:
        monkeypatch.delenv("DELTASERVE_CPU_GEMV_ROWS")
        env.cache_clear()
        gemv_rows.configure(lib)


@without_int8_act
def test_int8_decode_without_vnni_is_exact_whatever_the_knob(monkeypatch) -> None:
    """A build without an int8-activation kernel (scalar) never picks one: int8 decode keeps fp32
    activations with DELTASERVE_EXACT_INT8_ACT unset, the bits it gives with the knob set."""
    torch.manual_seed(5)
    p, x = packed_random(1000, 1024, INT8), torch.randn(1, 1024)
    outs = []
    for knob in ("0", "1"):
        monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", knob)
        env.cache_clear()
        assert not q8_is_vnni(native_lib(), 1000, 1024, 64)
        outs.append(qgemv(x, p, INT8))
    env.cache_clear()
    assert torch.equal(outs[0], outs[1])
    assert ((outs[0] - qgemv_ref(x, p, INT8)).norm() / outs[0].norm()).item() <= 1e-5


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_native_dequantizer_matches_the_reference(name) -> None:
    scheme = SCHEMES[name]
    torch.manual_seed(7)
    packed = {k: v.float() if v.is_floating_point() else v
              for k, v in quantize(torch.randn(203, 896), scheme).items()}
    ref = dequantize(packed, scheme)
    out = dequantize_into(packed, scheme, torch.empty(203, 896))
    # the C path may fuse q*s + b into one FMA: at most one rounding apart
    assert torch.allclose(out, ref, rtol=2e-7, atol=1e-9)
    assert not torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("name", ["int8", "int4", "q1"])
def test_narrow_scales_give_the_bits_of_fp32_scales(name) -> None:
    """The model holds scales (and biases) as fp16 / bf16 where exact (quant/linear.narrow_scales_):
    this machine's kernels (VNNI int8 included) widen them to the very bits the fp32 copy gives,
    for the GEMV, the multi-row kernel and the prefill dequantizer; a pair held in two dtypes is
    widened for the call."""
    from deltaserve.ops.qgemv import qgemm_rows

    scheme = FORMATS[name]
    torch.manual_seed(11)
    half = quantize(torch.randn(203, 1024), scheme)  # the file's dtype: fp16
    assert half["scales"].dtype == torch.float16
    x = torch.randn(3, 1024)
    forms = {dtype: {k: v.to(dtype) if v.is_floating_point() else v for k, v in half.items()}
             for dtype in (torch.float32, torch.float16)}
    if scheme.has_biases():
        forms["mixed"] = {**forms[torch.float16], "biases": forms[torch.float32]["biases"]}
    outs = {}
    for dtype, p in forms.items():
        multi = qgemm_rows(x, p, scheme)
        outs[dtype] = (qgemv(x[:1], p, scheme), None if multi is None else multi,
                       dequantize_into(p, scheme, torch.empty(203, 1024)))
    for dtype, got in outs.items():
        for a, b in zip(got, outs[torch.float32], strict=True):
            assert (a is None and b is None) or torch.equal(a, b), dtype
    bf = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in half.items()}
    wide = {k: v.float() if v.is_floating_point() else v for k, v in bf.items()}
    assert torch.equal(qgemv(x[:1], bf, scheme), qgemv(x[:1], wide, scheme))
    assert not torch.equal(outs[torch.float16][0], torch.zeros(1, 203))


MULTI_ROW = {"int8": INT8, "int8-g32": Scheme("int8", 8, 32), "int4": FORMATS["int4"],
             "int4-g16": Scheme("affine", 4, 16)}


@pytest.mark.parametrize("name", sorted(MULTI_ROW))
@pytest.mark.parametrize(("num_rows", "rows", "cols"), [(2, 203, 1024), (5, 4096, 256),
                                                         (16, 7, 320), (3, 66, 128)])
def test_multi_row_gemm_is_a_gemv_per_row_bit_for_bit(name, num_rows, rows, cols) -> None:
    """Decode batches and draft rows stream the codes once (ds_gemm_q8_vnni, ds_gemm_q8, ds_gemm_a4)
    and must give each row the very bits its own GEMV gives: batch == singles, spec verify ==
    plain decode. int8 with 32-wide groups takes the exact fp32 kernel (VNNI wants 64); odd row
    counts (the kernels pair rows), weight rows off their blocks of 4, and 16-wide groups (the
    4-bit kernel's scalar path)."""
    from deltaserve.ops.qgemv import qgemm_rows

    scheme = MULTI_ROW[name]
    packed = packed_random(rows, cols, scheme)
    x = torch.randn(num_rows, cols) * torch.logspace(-3, 2, num_rows)[:, None]
    got = qgemm_rows(x, packed, scheme)
    assert got is not None, "the multi-row kernel did not run"
    want = torch.cat([qgemv(x[r : r + 1], packed, scheme) for r in range(num_rows)])
    assert torch.equal(got, want)
    exact = not (a4_is_vnni if scheme.kind == "affine" else q8_is_vnni)(native_lib(), rows, cols,
                                                                         scheme.group_size)
    if exact:  # fp32 x: the spec within rounding
        spec = x @ dequantize(packed, scheme, torch.float32).T
        assert torch.allclose(got, spec, rtol=1e-4, atol=1e-4 * spec.abs().max().item())
    else:  # x rounded per group: the int8-activation reference, row by row
        spec = torch.cat([qgemv_act_ref(x[r : r + 1], packed, scheme) for r in range(num_rows)])
        assert ((got - spec).norm() / spec.norm()).item() <= 1e-5


def test_decode_steps_take_the_multi_row_kernel_further_than_prefill() -> None:
    """20 int8 rows: in a decode-only step (ops/dispatch.stepping(True)) each row gets its GEMV's
    bits through the multi-row kernel; in a prefill chunk the weight is dequantized and the fp32
    GEMM runs. The scalar build (no vector paths) keeps the GEMV per row to 16 rows: 20 take the
    prefill path."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from deltaserve.ops.dispatch import stepping
    from deltaserve.quant.linear import CPU_GEMV_MAX_ROWS, quant_linear

    packed = packed_random(300, 256, INT8)
    module = SimpleNamespace(weight=packed["weight"], scales=packed["scales"], scheme=INT8,
                             in_cols=256)
    x = torch.randn(CPU_GEMV_MAX_ROWS + 4, 256)
    singles = torch.cat([qgemv(x[r : r + 1], packed, INT8) for r in range(x.shape[0])])
    with stepping(True):
        decode = quant_linear(x, module)
    prefill = quant_linear(x, module)
    assert torch.equal(decode, singles if simd_lanes() else prefill)
    assert torch.allclose(prefill, F.linear(x, dequantize(packed, INT8)), rtol=1e-5, atol=1e-4)
    assert not torch.equal(prefill, singles)  # activation rounding: the other path ran
