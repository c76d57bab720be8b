"""Decode steps replayed from CUDA graphs against eager steps (run on the H200)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_batching import capture, make_engine, prompts_of, rel, run_all

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_decode_equals_eager(tiny_dir, monkeypatch) -> None:
    from deltaserve import LLM
    from deltaserve.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = prompts_of([5, 150, 70, 1, 33, 9])  # 6 sequences: the graph pads to 8
    results = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("DELTASERVE_CUDA_GRAPHS", graphs)
        llm = LLM(tiny_dir, dtype="float32", device="cuda")
        engine = make_engine(llm, num_slots=8, prefix_bytes=0)
        assert (engine.runner.graphs is not None) == (graphs == "1")
        seen = capture(engine)
        results[graphs] = (run_all(engine, prompts, params), seen)
        if graphs == "1":
            assert engine.runner.graphs.graphs, "no step was replayed from a graph"
    (tok0, seen0), (tok1, seen1) = results["0"], results["1"]
    assert tok0 == tok1
    for rid in prompts:
        assert rel(torch.stack(seen1[rid]).cpu(), torch.stack(seen0[rid]).cpu()) <= 1e-5, rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("value_heads", [4, 2])  # grouped (separate conv kernel) / fused conv
def test_triton_backend_equals_portable_backend(tmp_path, monkeypatch, value_heads) -> None:
    """The whole Triton decode step (fused norms, GDN, attention, graphs) against torch ops only,
    fp32 on CUDA, steps mixing prefill chunks and decodes."""
    from deltaserve import LLM
    from deltaserve.engine.sampling import SamplingParams
    from deltaserve.env import env
    from tests.conftest import write_variant

    model = write_variant(tmp_path / "m", 0, linear_num_value_heads=value_heads)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = prompts_of([5, 150, 70, 1, 33])
    results = {}
    for backend in ("portable", "triton"):
        monkeypatch.setenv("DELTASERVE_GPU_BACKEND", backend)
        env.cache_clear()
        engine = make_engine(LLM(model, dtype="float32", device="cuda"), num_slots=8,
                             prefix_bytes=0)
        seen = capture(engine)
        results[backend] = (run_all(engine, prompts, params), seen)
    (tok_p, seen_p), (tok_t, seen_t) = results["portable"], results["triton"]
    assert tok_p == tok_t
    for rid in prompts:
        assert rel(torch.stack(seen_t[rid]).cpu(), torch.stack(seen_p[rid]).cpu()) <= 1e-5, rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_greedy_head_gives_the_argmax_tokens(tiny_dir) -> None:
    """fp32: both heads see the same logits (in bf16 the sampled path rounds logits to bf16, where
    near-ties collapse, while the fused head compares fp32 sums: they may then differ)."""
    from deltaserve import LLM
    from deltaserve.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [ids for ids in prompts_of([5, 40, 9]).values()]
    outs = {}
    for greedy_head in (False, True):
        llm = LLM(tiny_dir, dtype="float32", device="cuda", greedy_head=greedy_head)
        outs[greedy_head] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
    assert outs[True] == outs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("greedy_head", [False, True])
def test_overlapped_graph_decode_equals_the_plain_engine(tiny_dir, greedy_head) -> None:
    """Steps launched before the previous tokens are read back (ids fed on the device into the
    graph) give the plain engine's outputs: staggered lengths, a stop id, a late arrival."""
    from dataclasses import replace

    from deltaserve import LLM
    from deltaserve.engine.sampling import SamplingParams
    from tests.engine.test_overlap import drive, overlapped

    llm = LLM(tiny_dir, dtype="float32", device="cuda", greedy_head=greedy_head)
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = prompts_of([5, 150, 70, 1, 33, 9])
    params = [replace(base, max_tokens=n) for n in (16, 3, 9, 16, 1, 12)]
    params[3] = replace(base, stop_token_ids=(7, 11, 13, 17, 19, 23))
    arrivals = {0: [], 4: []}
    for i, (rid, ids) in enumerate(prompts.items()):
        arrivals[0 if i < 4 else 4].append((rid, ids, params[i]))
    plain = drive(make_engine(llm, num_slots=8, prefix_bytes=0), arrivals)
    engine = overlapped(llm, num_slots=8, prefix_bytes=0)
    assert drive(engine, arrivals) == plain
    assert engine.runner.graphs.graphs, "no step was replayed from a graph"


def _int8_runs(model_dir, monkeypatch, dtype: str, knob: str, spy=None) -> dict:
    """Greedy tokens and per-step logits of three prompts through a one-slot engine (batch-1
    decode rows, CUDA graphs) with env `knob` = "0" and "1"; spy(setting) after each run."""
    from deltaserve import LLM
    from deltaserve.engine.sampling import SamplingParams
    from deltaserve.env import env

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = prompts_of([5, 150, 33])
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(knob, setting)
        env.cache_clear()
        engine = make_engine(LLM(model_dir, dtype=dtype, device="cuda"), num_slots=1,
                             prefix_bytes=0)
        seen = capture(engine)
        results[setting] = (run_all(engine, prompts, params), seen)
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        if spy is not None:
            spy(setting)
    return results


def _assert_runs_agree(results, dtype: str) -> None:
    (tok0, seen0), (tok1, seen1) = results["0"], results["1"]
    if dtype == "float32":
        assert tok0 == tok1
    bound = 1e-5 if dtype == "float32" else 2e-2
    for rid in tok0:  # bf16: up to the first token that differs (a near-tie), inputs are equal
        pairs = zip(tok0[rid], tok1[rid], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(tok0[rid]))
        steps = min(same + 1, len(seen0[rid]))
        assert rel(torch.stack(seen1[rid][:steps]).cpu(),
                   torch.stack(seen0[rid][:steps]).cpu()) <= bound, rid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_prologue_decode_equals_the_separate_kernels(tiny_dir, tmp_path, monkeypatch,
                                                         dtype) -> None:
    """Batch-1 decode rows on int8 weights: the MLP as two GEMVs that compute the add + norm and
    silu * mul themselves (ops/gemv_prologue) against the five separate kernels, in CUDA graphs."""
    from deltaserve.ops import gemv_prologue
    from deltaserve.quant.convert import quantize_checkpoint

    quantize_checkpoint(tiny_dir, "int8", tmp_path / "q")
    modes = []
    kernel_args = gemv_prologue.kernel_args
    monkeypatch.setattr(gemv_prologue, "kernel_args",
                        lambda x, p: modes.append(kernel_args(x, p)["XMODE"]) or kernel_args(x, p))

    def took_the_prologues(setting: str) -> None:
        assert ({1, 2} <= set(modes)) == (setting == "1"), set(modes)
        modes.clear()

    results = _int8_runs(tmp_path / "q", monkeypatch, dtype, "DELTASERVE_GEMV_PROLOGUE",
                         took_the_prologues)
    _assert_runs_agree(results, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_decode_equals_plain_launches(tiny_dir, tmp_path, monkeypatch) -> None:
    """Programmatic dependent launch changes when kernels start, never what they compute: fp32,
    int8 weights (GEMVs with their weights loaded before the wait), tokens identical."""
    from deltaserve.ops.backend import pdl_supported
    from deltaserve.quant.convert import quantize_checkpoint

    if not pdl_supported():
        pytest.skip("PDL needs an sm_90+ GPU, CUDA 12.3+ and Triton 3.4+")
    quantize_checkpoint(tiny_dir, "int8", tmp_path / "q")
    _assert_runs_agree(_int8_runs(tmp_path / "q", monkeypatch, "float32", "DELTASERVE_PDL"),
                       "float32")
