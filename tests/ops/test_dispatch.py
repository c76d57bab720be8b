"""ops/dispatch: one choice per (op, case, knobs), the reference under DELTASERVE_REFERENCE_OPS, the
reasons `deltaserve ops` prints; and the real ops' choices for GPU cases, decided here without a
GPU (the verifiers read a Case, never a tensor)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.env import env
from deltaserve.ops import backend, dispatch
from deltaserve.ops.dispatch import OPS, REFERENCE, Case, Op


@pytest.fixture
def toy():
    calls = []
    op = Op("toy_test_op", "a test op", ("big",))

    @op.register("fast", 20, lambda c: calls.append(c) or (None if c.shape[0] else "small"))
    def fast(x):
        return ("fast", x)

    @op.register(REFERENCE, 0)
    def ref(x):
        return ("ref", x)

    yield op, calls
    del OPS[op.name]


def test_the_first_runnable_implementation_by_priority_is_chosen_once(toy) -> None:
    op, calls = toy
    big, small = Case("cpu", torch.float32, (True,)), Case("cpu", torch.float32, (False,))
    assert op(big, 1) == ("fast", 1) and op(big, 2) == ("fast", 2)
    assert op(small, 3) == ("ref", 3)
    assert calls == [big, small]  # each case verified once, then cached
    assert op.explain(small) == [("fast", "small"), (REFERENCE, None)]


def test_reference_ops_takes_the_reference_and_a_knob_change_re_chooses(toy, monkeypatch) -> None:
    op, _ = toy
    big = Case("cpu", torch.float32, (True,))
    assert op.chooses(big, "fast")
    monkeypatch.setenv("DELTASERVE_REFERENCE_OPS", "1")
    env.cache_clear()
    try:
        assert op.chooses(big, REFERENCE)
        assert op.explain(big)[0] == ("fast", "DELTASERVE_REFERENCE_OPS=1")
    finally:
        monkeypatch.delenv("DELTASERVE_REFERENCE_OPS")
        env.cache_clear()
    assert op.chooses(big, "fast")


def test_names_are_unique_and_every_op_has_a_reference(toy) -> None:
    op, _ = toy
    with pytest.raises(ValueError, match="already has"):
        op.register("fast", 5)(lambda x: x)
    import deltaserve.models.qwen3_5  # noqa: F401  (the ops register where they are defined)
    import deltaserve.multimodal.siglip  # noqa: F401

    for name, each in OPS.items():
        assert each.named(REFERENCE).why_not(Case("cpu", torch.float32)) is None, name
    assert {"rms_norm", "gdn_prefill", "gdn_decode", "linear", "quant_linear", "attention",
            "decode_step", "causal_conv1d", "greedy_head"} <= set(OPS)


@pytest.fixture
def fake_triton(monkeypatch):
    """The triton backend on as far as the verifiers ask (no kernel is launched here)."""
    import deltaserve.ops.triton_conv1d as conv

    monkeypatch.setattr(backend, "triton_enabled", lambda: True)
    monkeypatch.setattr(conv, "available", lambda: True)
    dispatch.forget()
    yield
    monkeypatch.undo()
    dispatch.forget()


@pytest.mark.parametrize("tokens,fla,want", [
    (64, False, "triton_recurrent"), (128, True, "triton_recurrent"),
    (129, True, "fla_stages_qkv_conv"), (8192, True, "fla_stages_qkv_conv"),
    (8192, False, REFERENCE)])
def test_gdn_prefill_choice_on_a_gpu(fake_triton, monkeypatch, tokens, fla, want) -> None:
    """The 0.8B shape in bf16 on CUDA: the one-launch recurrent scan up to SCAN_MAX_TOKENS, fla's
    stages beyond (the conv writing normalised q, k), the reference without fla-core."""
    from deltaserve.ops import fla_scan, gdn_prefill

    monkeypatch.setattr(gdn_prefill, "fla_installed", lambda: fla)
    monkeypatch.setattr(fla_scan, "stages_available", lambda: True)
    case = Case("cuda", torch.bfloat16, (tokens <= gdn_prefill.SCAN_MAX_TOKENS, True, 16, 128, 128))
    assert gdn_prefill.GDN_PREFILL.choose(case).name == want


def test_gdn_prefill_knobs_and_fp32(fake_triton, monkeypatch) -> None:
    from deltaserve.ops import fla_scan, gdn_prefill

    monkeypatch.setattr(gdn_prefill, "fla_installed", lambda: True)
    monkeypatch.setattr(fla_scan, "stages_available", lambda: True)
    long16 = Case("cuda", torch.bfloat16, (False, True, 16, 128, 128))
    long32 = Case("cuda", torch.float32, (False, True, 16, 128, 128))
    assert gdn_prefill.GDN_PREFILL.choose(long32).name == REFERENCE  # fp32 stays exact
    monkeypatch.setenv("DELTASERVE_CONV_QKV", "0")
    env.cache_clear()
    assert gdn_prefill.GDN_PREFILL.choose(long16).name == "fla_stages"
    monkeypatch.setenv("DELTASERVE_FLA", "0")
    env.cache_clear()
    assert gdn_prefill.GDN_PREFILL.choose(long16).name == REFERENCE
    monkeypatch.delenv("DELTASERVE_FLA")
    monkeypatch.delenv("DELTASERVE_CONV_QKV")
    env.cache_clear()


def test_row_ops_on_a_gpu(fake_triton) -> None:
    """Norms: Triton for decode-sized or 16-bit rows; fp32 prefill keeps torch's reduction."""
    from deltaserve.ops.norm import RMS_NORM

    assert RMS_NORM.choose(Case("cuda", torch.float32, (False, True))).name == "triton"
    assert RMS_NORM.choose(Case("cuda", torch.float32, (False, False))).name == REFERENCE
    assert RMS_NORM.choose(Case("cuda", torch.bfloat16, (False, False))).name == "triton"


def test_reference_ops_runs_only_references_in_a_real_model(tiny_dir, monkeypatch) -> None:
    """DELTASERVE_REFERENCE_OPS=1 through a whole generation: every op the model ran chose its
    reference (ops/dispatch.report, what `deltaserve ops` prints)."""
    from deltaserve import LLM, SamplingParams

    monkeypatch.setenv("DELTASERVE_REFERENCE_OPS", "1")
    env.cache_clear()
    try:
        llm = LLM(tiny_dir, dtype="bfloat16")
        llm.generate(["def f(x):\n" * 5, "x"], SamplingParams(temperature=0, max_tokens=4))
        rows = dispatch.report()
    finally:
        monkeypatch.delenv("DELTASERVE_REFERENCE_OPS")
        env.cache_clear()
    assert {r["op"] for r in rows} >= {"rms_norm", "gdn_prefill", "gdn_decode", "attention",
                                        "linear", "silu_mul"}
    assert all(r["chosen"] == REFERENCE for r in rows), [r for r in rows if r["chosen"] != REFERENCE]


def test_quant_linear_on_a_gpu(fake_triton, monkeypatch) -> None:
    """Packed weights on CUDA: the int8 batch GEMM for 2..MAX_ROWS rows, the GEMV for one row
    (and for int4, which the GEMM does not read), dequantize + GEMM for prefill-sized rows."""
    from deltaserve.ops import triton_qgemm, triton_qgemv
    from deltaserve.quant.linear import QUANT_LINEAR
    from deltaserve.quant.schemes import Scheme

    monkeypatch.setattr(triton_qgemm, "available", lambda: True)
    monkeypatch.setattr(triton_qgemv, "available", lambda: True)
    dispatch.forget()
    int8, int4 = Scheme("int8", 8, 64), Scheme("affine", 4, 64)
    pick = lambda scheme, *rows: QUANT_LINEAR.choose(Case("cuda", torch.bfloat16,  # noqa: E731
                                                          (scheme, *rows))).name
    assert pick(int8, False, True, True) == "triton_qgemm"
    assert pick(int8, True, False, True) == "triton_qgemv"
    assert pick(int4, False, True, True) == "triton_qgemv"
    assert pick(int8, False, False, False) == "dequantize_gemm"
