"""The CPU kernels built for other instruction sets than this machine's best: AVX2 + FMA (most
laptops: ops/csrc/simd.h's two-register lanes) and plain x86-64 (the scalar loops), each against
the torch references, and the multi-row kernels against a GEMV per row bit for bit. CI machines
run AVX-512, so without these tests the other paths would never run."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.native import build, cpu_flags, isa_paths
from deltaserve.quant.schemes import FORMATS, dequantize, quantize

P, L = ctypes.c_void_p, ctypes.c_long


ARCHS = {"haswell": {"avx2", "fma"}, "x86-64": set()}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def lib(request, tmp_path_factory):
    if platform.machine() != "x86_64" or not ARCHS[request.param] <= cpu_flags():
        pytest.skip(f"this CPU cannot run -march={request.param} code")
    built = build(request.param, tmp_path_factory.mktemp("native-" + request.param))
    if built is None:
        pytest.skip("no C compiler")
    return built


def ptr(t: torch.Tensor):
    return P(t.data_ptr())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def packed(rows: int, cols: int, name: str) -> dict:
    gen = torch.Generator().manual_seed(rows * cols)
    return {k: (v.float() if v.is_floating_point() else v).contiguous()
            for k, v in quantize(torch.randn(rows, cols, generator=gen), FORMATS[name]).items()}


def test_the_build_reports_its_vector_lanes(lib, request) -> None:
    """16 with AVX2 + FMA (and its int8-activation kernels); 0 for plain x86-64, where the
    multi-row kernels are not preferred."""
    arch = request.node.callspec.params["lib"]
    assert lib.ds_simd_lanes() == (16 if arch == "haswell" else 0)
    avx2 = ("avx2", "f16c", "avx2-int8", "avx2-int4", "avx2-q1", "int8-blocks")
    assert isa_paths(lib) == (avx2 if arch == "haswell" else ("scalar",))


@pytest.mark.parametrize(("rows", "cols"), [(1030, 1024), (13, 100)])
def test_bf16_gemv_and_gemm(lib, rows, cols) -> None:
    """Weight rows off the blocks of 8 / 4, columns off the 32-wide steps: every path."""
    w = torch.randn(rows, cols).bfloat16()
    x = torch.randn(3, cols)
    y1, y3 = torch.empty(1, rows), torch.empty(3, rows)
    lib.ds_gemv_bf16(ptr(w), ptr(x), ptr(y1), rows, cols, 2)
    lib.ds_gemm_bf16(ptr(w), ptr(x), ptr(y3), L(3), L(rows), L(cols), 2)
    want = F.linear(x, w.float())
    assert rel(y1, want[:1]) <= 1e-6 and rel(y3, want) <= 1e-6


SCALE_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _odd_scales(p: dict) -> dict:
    """The first groups' scales set to fp16 subnormals, a signed zero and a value only fp32
    holds (its fp16 and bf16 roundings differ from it): each widening path meets them."""
    s = p["scales"].clone()
    s.view(-1)[:4] = torch.tensor([6e-8, 3.1e-6, -0.0, 1 / 3])
    return {**p, "scales": s}


def _kernel_rows(lib, name: str, p: dict, x: torch.Tensor, group: int) -> torch.Tensor:
    """Each row of x through the GEMV, with p's scales (and biases) in their own dtype."""
    rows, cols = p["weight"].shape[0], x.shape[1]
    kind = SCALE_KINDS[p["scales"].dtype]
    got = torch.empty(x.shape[0], rows)
    for r in range(x.shape[0]):
        args = [ptr(x[r]), ptr(got[r]), L(rows), L(cols), L(group), 2, kind]
        if name == "int8":
            lib.ds_gemv_q8(ptr(p["weight"]), ptr(p["scales"]), *args)
        elif name == "int4":
            lib.ds_gemv_a4(ptr(p["weight"]), ptr(p["scales"]), ptr(p["biases"]), *args)
        else:
            lib.ds_gemv_q1(ptr(p["weight"]), ptr(p["scales"]), *args)
    return got


@pytest.mark.parametrize("name", ["int8", "int4", "q1"])
@pytest.mark.parametrize(("rows", "cols"), [(1030, 1024), (13, 256)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_gemvs(lib, name, rows, cols, scale_dtype) -> None:
    """Against dequantize-then-F.linear; scales held as fp16 / bf16 give the bits of the same
    values widened to fp32 (the widening is exact, subnormals and signed zeros included)."""
    p = _odd_scales(packed(rows, cols, name))
    narrow = {k: v.to(scale_dtype) if v.is_floating_point() else v for k, v in p.items()}
    wide = {k: v.float() if v.is_floating_point() else v for k, v in narrow.items()}
    group = FORMATS[name].group_size
    x = torch.randn(3, cols)
    got = _kernel_rows(lib, name, narrow, x, group)
    assert rel(got, F.linear(x, dequantize(narrow, FORMATS[name], torch.float32))) <= 1e-5
    if scale_dtype != torch.float32:
        assert torch.equal(got, _kernel_rows(lib, name, wide, x, group))
    if name != "q1":  # the multi-row kernels: each row the bits of its own GEMV
        multi = torch.empty(3, rows)
        args = [ptr(x), ptr(multi), L(3), L(rows), L(cols), L(group), 2,
                SCALE_KINDS[scale_dtype]]
        if name == "int8":
            lib.ds_gemm_q8(ptr(narrow["weight"]), ptr(narrow["scales"]), *args)
        else:
            lib.ds_gemm_a4(ptr(narrow["weight"]), ptr(narrow["scales"]), ptr(narrow["biases"]),
                           *args)
        assert torch.equal(multi, got)
    out = torch.empty(rows, cols)  # the prefill dequantizer: dequantize()'s bits
    lib.ds_dequant(["int8", "int4", "q1"].index(name), ptr(narrow["weight"]),
                   ptr(narrow["scales"]), ptr(narrow.get("biases", narrow["scales"])), ptr(out),
                   L(rows), L(cols), L(group), 2, SCALE_KINDS[scale_dtype])
    assert torch.equal(out, dequantize(narrow, FORMATS[name], torch.float32))


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl", "q3_k"])
def test_block_decoders_and_gemm(lib, kind) -> None:
    """GGUF blocks on this build: decoded exactly (the vector decoders of AVX2, the scalar ones
    of plain x86-64) and the multi-row GEMM within rounding, each row its bits at any M."""
    from deltaserve.quant.ggml_blocks import BLOCKS, dequantize_blocks
    from tests.ops.test_blocks import blocks_of

    kid = BLOCKS[kind][0]
    w = blocks_of(kind, 9, 512, seed=5)
    out = torch.empty(9, 512)
    lib.ds_dequant_blocks(ctypes.c_int(kid), ptr(w), ptr(out), L(9), L(512), ctypes.c_int(2))
    assert torch.equal(out, dequantize_blocks(w, kind))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    y = torch.empty(3, 9)
    lib.ds_gemm_blocks(ctypes.c_int(kid), ptr(w), ptr(x), ptr(y), L(3), L(9), L(512),
                       ctypes.c_int(2))
    assert rel(y.double(), x.double() @ out.double().T) <= 1e-6
    one = torch.empty(1, 9)
    lib.ds_gemm_blocks(ctypes.c_int(kid), ptr(w), ptr(x[2:]), ptr(one), L(1), L(9), L(512),
                       ctypes.c_int(2))
    assert torch.equal(one[0], y[2])


@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_block_gemm_on_int8_activations(lib, request, kind) -> None:
    """The int8-activation block GEMM of this build (gemv_blocks_avx2.c on AVX2: VPMADDUBSW; none
    on plain x86-64): x rounded per 32 as blocks_act_ref says, within fp32 rounding of it, rows
    of zeros and a group of zeros, odd row counts, each row its bits at any M; a NaN in x fails
    only its row."""
    from deltaserve.ops.native import _declare
    from deltaserve.ops.qgemv import blocks_act_ref
    from deltaserve.quant.ggml_blocks import BLOCKS, dequantize_blocks
    from deltaserve.quant.schemes import Scheme
    from tests.ops.test_blocks import blocks_of

    if "haswell" not in request.node.callspec.id:
        assert not hasattr(lib, "ds_gemm_blocks_vnni")  # plain x86-64: the exact kernels only
        return
    _declare(lib)
    kid, scheme = BLOCKS[kind][0], Scheme(kind, BLOCKS[kind][3], BLOCKS[kind][1])
    w = blocks_of(kind, 37, 768, seed=11 + len(kind))
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(4)) * 3
    x[1, 40:70] = 0.0  # a group of zeros: its step is zero, not NaN
    x[3] = 0.0
    y = torch.empty(5, 37)
    assert lib.ds_gemm_blocks_vnni(kid, ptr(w), ptr(x), ptr(y), 5, 37, 768, 2) == 1
    assert rel(y.double(), blocks_act_ref(x, {"weight": w}, scheme).double()) <= 1e-6
    exact = x.double() @ dequantize_blocks(w, kind).double().T
    assert 1e-4 < rel(y.double(), exact) < 0.02 and torch.equal(y[3], torch.zeros(37))
    for r in (0, 4):
        one = torch.empty(1, 37)
        lib.ds_gemm_blocks_vnni(kid, ptr(w), ptr(x[r:r + 1].contiguous()), ptr(one), 1, 37, 768, 2)
        assert torch.equal(one[0], y[r])
    x[2, 5] = float("nan")
    lib.ds_gemm_blocks_vnni(kid, ptr(w), ptr(x), ptr(y), 5, 37, 768, 2)
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4]]).all()
    assert lib.ds_gemm_blocks_vnni(kid, ptr(w), ptr(x), ptr(y), 5, 37, 700, 2) == 0  # K % 256


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int8_gemv_on_int8_activations(lib, request, group, scale_dtype) -> None:
    """The int8-activation int8 GEMV of this build (gemv_q8_avx2.c on AVX2; none on plain
    x86-64): qgemv_act_ref's integers within fp32 rounding, codes of -128 included, a zero group,
    the multi-row kernel giving each row its GEMV's bits, a NaN reaching only its row, groups it
    does not take (16) sent to the exact kernel."""
    from deltaserve.ops.qgemv import qgemv_act_ref
    from deltaserve.quant.schemes import Scheme

    if "haswell" not in request.node.callspec.id:
        assert not hasattr(lib, "ds_gemv_q8_vnni")
        return
    scheme = Scheme("int8", 8, group)
    gen = torch.Generator().manual_seed(group)
    rows, cols = 203, 1024
    w = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
    s = (torch.rand(rows, cols // group, generator=gen) * 0.01).to(scale_dtype)
    x = torch.randn(3, cols, generator=gen) * 2
    x[0, 128:256] = 0.0
    ref = torch.cat([qgemv_act_ref(x[r:r + 1], {"weight": w, "scales": s.float()}, scheme)
                     for r in range(3)])
    one = torch.empty(3, rows)
    for r in range(3):
        lib.ds_gemv_q8_vnni(ptr(w), ptr(s), ptr(x[r]), ptr(one[r]), L(rows), L(cols), L(group), 2,
                            SCALE_KINDS[scale_dtype])
    assert rel(one.double(), ref.double()) <= 1e-5
    multi = torch.empty(3, rows)
    lib.ds_gemm_q8_vnni(ptr(w), ptr(s), ptr(x), ptr(multi), L(3), L(rows), L(cols), L(group), 2,
                        SCALE_KINDS[scale_dtype])
    assert torch.equal(multi, one)
    x[1, 7] = float("nan")
    lib.ds_gemm_q8_vnni(ptr(w), ptr(s), ptr(x), ptr(multi), L(3), L(rows), L(cols), L(group), 2,
                        SCALE_KINDS[scale_dtype])
    assert multi[1].isnan().all() and torch.equal(multi[[0, 2]], one[[0, 2]])
    exact, fallback = torch.empty(rows), torch.empty(rows)
    s16 = torch.rand(rows, cols // 16, generator=gen)
    lib.ds_gemv_q8(ptr(w), ptr(s16), ptr(x[2]), ptr(exact), L(rows), L(cols), L(16), 2, 0)
    lib.ds_gemv_q8_vnni(ptr(w), ptr(s16), ptr(x[2]), ptr(fallback), L(rows), L(cols), L(16), 2, 0)
    assert torch.equal(exact, fallback)
