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
