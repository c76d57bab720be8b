"""Greedy output with speculation equals greedy output without it, one request or many at once; the
drafters, the adaptive off-switch and the prefix cache around it."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.sampling import SamplingParams
from deltaserve.spec.config import SpeculativeConfig
from deltaserve.spec.ngram import propose_ngram
from tests.engine.test_batching import run_all
from tests.spec.conftest import greedy, make_engine

PROSE = "The history of the city begins with a small settlement on the river, where traders"
CODE = "import os\n\n\ndef list_python_files(path):\n"
REPEAT = "x = 1\ny = 2\n" * 12  # the model keeps the pattern going: drafts get accepted


def encode(llm, texts: dict[str, str]) -> dict[str, list[int]]:
    return {rid: llm.tokenizer.encode(text) for rid, text in texts.items()}


def test_ngram_lookup() -> None:
    ids = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose_ngram(ids, 3, 2, 4) == [8, 9, 1]  # suffix 5 6 7 recurs at 0
    assert propose_ngram(ids, 1, 2, 4) == [8]
    assert propose_ngram([1, 2, 3, 4], 3, 2, 4) == []  # no suffix recurs
    assert propose_ngram([3, 4, 9, 3, 4, 7, 3, 4], 2, 2, 2) == [7, 3]  # the latest match wins
    # a byte pattern that matches across token boundaries is not a token match
    assert propose_ngram([256, 0, 1, 1], 2, 1, 1) == [1]


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_greedy_identical_in_a_batch(default_bf16_llm, method) -> None:
    """Prose, code and a repetitive prompt together, with and without speculation: the same
    tokens; drafts were accepted and rejected in the run."""
    llm = default_bf16_llm
    prompts = encode(llm, {"prose": PROSE, "code": CODE, "repeat": REPEAT})
    params = greedy(32)
    want = run_all(make_engine(llm), prompts, params)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=False)
    engine = make_engine(llm, spec)
    assert run_all(engine, prompts, params) == want
    stats = engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_greedy_identical_fp32_weights(tiny_llm) -> None:
    """fp32 weights: not the bit-exact path (MKL's sgemv vs sgemm), the same tokens all the same."""
    g = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(1, 1000, (n,), generator=g).tolist()
               for i, n in enumerate([5, 40, 90])}
    prompts["loop"] = [7, 8, 9] * 10
    want = run_all(make_engine(tiny_llm), prompts, greedy(20))
    engine = make_engine(tiny_llm, SpeculativeConfig(adaptive=False))
    assert run_all(engine, prompts, greedy(20)) == want
    assert engine.spec.stats.num_drafts > 0


def test_adaptive_switches_a_losing_request_off(tiny_bf16_llm) -> None:
    def always_wrong(engine):
        engine.spec._propose = lambda rid, num: [1] * num
        return engine

    prompts = {"r": list(range(10, 30))}
    on = always_wrong(make_engine(tiny_bf16_llm, SpeculativeConfig(  # acceptance decides alone
        num_speculative_tokens=4, adaptive_min_drafts=8, adaptive_min_acceptance=0.5,
        pace=False)))
    off = always_wrong(make_engine(tiny_bf16_llm, SpeculativeConfig(num_speculative_tokens=4,
                                                                    adaptive=False)))
    assert run_all(on, prompts, greedy(30)) == run_all(off, prompts, greedy(30))
    assert on.spec.stats.num_disabled == 1
    assert on.spec.stats.num_draft_tokens == 8  # two steps of 4, then no more drafts
    assert off.spec.stats.num_draft_tokens > 40


def test_logprobs_requests_never_draft(tiny_bf16_llm) -> None:
    engine = make_engine(tiny_bf16_llm, SpeculativeConfig(adaptive=False))
    run_all(engine, {"s": [7, 8, 9] * 10},
            SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True))
    assert engine.spec.stats.num_drafts == 0


def test_sampling_requests_draft_exactly(tiny_bf16_llm) -> None:
    """Sampling with top_k=1 is greedy decoding in disguise, so exact speculative sampling must
    give the greedy tokens whatever is drafted (a right draft passes with probability 1, a wrong
    one never, and the residual is the argmax). A seeded request never drafts: its tokens are
    those of a run without speculation."""
    prompts = {"a": [7, 8, 9] * 10, "b": list(range(30, 70))}
    want = run_all(make_engine(tiny_bf16_llm), prompts, greedy(24))
    top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=24, ignore_eos=True)
    for proposer in (None, lambda rid, num: [1] * num):  # n-gram drafts, then always-wrong ones
        engine = make_engine(tiny_bf16_llm, SpeculativeConfig(adaptive=False))
        if proposer is not None:
            engine.spec._propose = proposer
        assert run_all(engine, prompts, top1) == want
        assert engine.spec.stats.num_drafts > 0
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny_bf16_llm, SpeculativeConfig(adaptive=False))
    engine.spec._propose = lambda rid, num: [1] * num
    assert run_all(engine, prompts, seeded) == run_all(make_engine(tiny_bf16_llm), prompts, seeded)
    assert engine.spec.stats.num_drafts == 0


def test_drafts_stay_within_the_token_budget(tiny_bf16_llm) -> None:
    """Sixteen decoding requests with 4 drafts each would want 80 rows; the budget is 64."""
    engine = make_engine(tiny_bf16_llm, SpeculativeConfig(num_speculative_tokens=4,
                                                          adaptive=False), num_slots=16, budget=64)
    engine.spec._propose = lambda rid, num: [1] * num
    sizes = []
    execute = engine.runner.execute
    engine.runner.execute = lambda plan, *a, **kw: (sizes.append(plan.num_tokens),
                                                    execute(plan, *a, **kw))[1]
    prompts = {f"r{i}": list(range(10 + i, 16 + i)) for i in range(16)}
    run_all(engine, prompts, greedy(12))
    assert max(sizes) == 64 and engine.spec.stats.num_drafts > 0


def test_prefix_snapshots_never_hold_drafts(tiny_bf16_llm) -> None:
    """Snapshots come from prefill chunks only: the same entries, bit for bit, with and without
    speculation; a later hit decodes the same tokens."""
    g = torch.Generator().manual_seed(6)
    base = torch.randint(1, 1000, (150,), generator=g).tolist()
    params = greedy(40)
    plain = make_engine(tiny_bf16_llm, prefix_bytes=1 << 26)
    spec = make_engine(tiny_bf16_llm, SpeculativeConfig(adaptive=False), prefix_bytes=1 << 26)
    spec.spec._propose = lambda rid, num: [1] * num  # rejected: the rows after t0 are undone
    first = {"a": base[:100]}
    assert run_all(spec, first, params) == run_all(plain, first, params)
    assert spec.spec.stats.num_drafts > 0
    want, got = plain.cache.prefix.entries, spec.cache.prefix.entries
    assert list(got) == list(want) and want
    for key, snap in want.items():
        for a, b in zip(snap.states, got[key].states, strict=True):
            assert (a is None and b is None) or all(
                torch.equal(x, y) for x, y in zip(a, b, strict=True))
    second = {"b": base[:64] + base[100:150]}
    assert run_all(spec, second, params) == run_all(plain, second, params)
    assert spec.cache.prefix.hits >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_greedy_identical_on_cuda_fp32(method) -> None:
    """The trained default model on CUDA, fp32 with TF32 off: prose, code and a repetitive prompt
    in one batch give the same tokens with and without speculation (verify rows take GEMMs where a
    decode takes GEMVs: the same argmax unless two logits tie within fp32 rounding), with drafts
    accepted and rejected. bf16 on CUDA is not batch-invariant (cuBLAS picks kernels by row count,
    so a verify row's logits differ from a decode row's in the last bits): there the share of
    identical tokens is printed, not asserted."""
    from deltaserve import LLM

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for dtype in ("float32", "bfloat16"):
            llm = LLM(None, dtype=dtype, device="cuda")
            prompts = encode(llm, {"prose": PROSE, "code": CODE, "repeat": REPEAT})
            want = run_all(make_engine(llm), prompts, greedy(48))
            spec = SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=False)
            engine = make_engine(llm, spec)
            got = run_all(engine, prompts, greedy(48))
            stats = engine.spec.stats
            same = sum(a == b for rid in want for a, b in zip(got[rid], want[rid], strict=True))
            print(f"{method} {dtype}: {same}/{sum(map(len, want.values()))} tokens identical, "
                  f"accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts")
            if dtype == "float32":
                assert got == want
                assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
