"""Logits processing against a plain reference of the OpenAI / vLLM formulas, token by token, on
fresh random logits and random histories; and the engine's greedy output where it must change."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.processors import Processor, Staging, apply, process
from deltaserve.errors import RequestError

V = 64


class _Tok:
    """Bad words as tokens: each character one id (ord % V), a leading space id 1."""

    def encode(self, text: str) -> list[int]:
        return [1 if c == " " else ord(c) % V for c in text]


def _reference(x: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int],
               eos: set[int]) -> torch.Tensor:
    """One row, one token at a time, as the formulas read."""
    x = x.clone()
    tail = out
    for t in range(V):
        if p.allowed_token_ids is not None and t not in p.allowed_token_ids:
            x[t] = float("-inf")
    for word in p.bad_words or ():
        for seq in {tuple(_Tok().encode(word.lstrip())), tuple(_Tok().encode(" " + word.lstrip()))}:
            if len(seq) == 1 or list(tail[len(tail) - len(seq) + 1:]) == list(seq[:-1]):
                x[seq[-1]] = float("-inf")
    if len(out) < p.min_tokens:
        for t in eos | set(p.stop_token_ids):
            x[t] = float("-inf")
    for t, b in p.logit_bias or ():
        x[t] += b
    for t in range(V):
        count = out.count(t)
        if p.repetition_penalty != 1.0 and (count or t in prompt):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randrange(4))}
        or None,
        min_tokens=rng.randrange(4), max_tokens=64,
        bad_words=rng.choice([None, ["ab"], ["c", "de"]]), stop_token_ids=[rng.randrange(V)],
        allowed_token_ids=rng.choice([None, rng.sample(range(V), 20)]))


def test_processing_equals_the_formulas_on_random_rows() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    for trial in range(40):
        params = [_random_params(rng) for _ in range(rng.randint(1, 5))]
        prompts = [[rng.randrange(V) for _ in range(rng.randrange(6))] for _ in params]
        procs = [Processor(p, pr, frozenset({0}), V, torch.device("cpu"), _Tok())
                 for p, pr in zip(params, prompts, strict=True)]
        outs = [[] for _ in params]
        for _ in range(rng.randrange(8)):  # a history of sampled tokens
            for proc, out in zip(procs, outs, strict=True):
                token = rng.randrange(V)
                out.append(token)
                assert proc.accept(token)
        rows = torch.randn(len(params), V) * 5
        got = apply(rows.clone(), procs)
        for i, p in enumerate(params):
            want = _reference(rows[i], p, prompts[i], outs[i], {0})
            torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-5,
                                       msg=f"trial {trial} row {i}: {p}")


def test_staging_reused_across_shapes_equals_a_fresh_one() -> None:
    """The staging buffers' layouts are cached per step shape: steps whose shapes change and come
    back (rows, penalised rows, edits) give exactly what a fresh staging gives."""
    rng = random.Random(1)
    torch.manual_seed(1)
    shared = Staging(pin=False)
    for trial in range(30):
        params = [_random_params(rng) for _ in range(rng.choice([1, 2, 3]))]
        procs = [Processor(p, [rng.randrange(V)], frozenset({0}), V, torch.device("cpu"), _Tok())
                 for p in params]
        for proc in procs:
            for _ in range(rng.randrange(4)):
                proc.accept(rng.randrange(V))
        table = torch.randn(4, V) * 5
        rows = rng.sample(range(4), len(procs))
        got, index = process(table, rows, procs, None, shared)
        want, want_index = process(table, rows, procs, None, Staging(pin=False))
        assert torch.equal(got, want), f"trial {trial}"
        assert index.tolist() == want_index.tolist() == rows


@pytest.mark.parametrize("kwargs, word", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"allowed_token_ids": []}, "allowed"),
    ({"bad_words": [""]}, "bad_words")])
def test_out_of_range_values_are_refused(kwargs, word) -> None:
    with pytest.raises(RequestError, match=word):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(RequestError, match="outside the vocabulary"):
        Processor(SamplingParams(logit_bias={V: 1.0}), [], frozenset(), V, torch.device("cpu"),
                  _Tok())


def test_greedy_output_changes_where_it_must(default_llm) -> None:
    prompt = "def add(a, b):\n    return"
    base = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    plain = base.outputs[0].token_ids
    forced = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=8, logit_bias={plain[3]: 100.0}))[0].outputs[0].token_ids
    assert forced == [plain[3]] * 8
    allowed = (plain[0], plain[1], 42)
    within = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=12, allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert set(within) <= set(allowed)
    repeats = max(plain.count(t) for t in plain)
    assert repeats > 1  # the plain output repeats a token: the penalty must break it
    penal = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0,
        repetition_penalty=2.0))[0].outputs[0].token_ids
    assert penal != plain and max(penal.count(t) for t in penal) <= repeats
    eos = sorted(default_llm.engine.eos_ids)
    early = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=6, min_tokens=6, logit_bias={eos[0]: 100.0}))[0].outputs[0]
    assert len(early.token_ids) == 6 and eos[0] not in early.token_ids
    stopped = default_llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=6, logit_bias={eos[0]: 100.0}))[0].outputs[0]
    assert stopped.token_ids == [eos[0]] and stopped.finish_reason == "stop"


def test_a_processed_request_beside_free_ones_leaves_them_unchanged(default_llm) -> None:
    prompts = ["import os\n", "class A:\n", "for i in range("]
    free = SamplingParams(temperature=0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in default_llm.generate(prompts, free)]
    mixed = default_llm.generate(prompts, [free, SamplingParams(
        temperature=0, max_tokens=16, presence_penalty=1.5, logit_bias={7: 5.0}), free])
    assert mixed[0].outputs[0].token_ids == alone[0]
    assert mixed[2].outputs[0].token_ids == alone[2]


def test_penalty_defaults_come_from_generation_config(tmp_path) -> None:
    """As vLLM: a checkpoint's generation_config sets the default repetition penalty."""
    import json

    from deltaserve import LLM
    from tests.conftest import write_variant

    model = write_variant(tmp_path / "m")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config,
                                                              "repetition_penalty": 1.3}))
    default = LLM(model, dtype="float32").get_default_sampling_params()
    assert default.repetition_penalty == 1.3 and default.presence_penalty == 0.0


@pytest.mark.parametrize("vocab", [31, 64, 1000, 248320])
def test_bitmask_application_equals_xgrammar_on_random_masks(vocab) -> None:
    """mask_rows_ref against xgrammar's own apply_token_bitmask_inplace (the reference), on
    random words (sign bits included), a vocabulary that does not fill the last word, rows left
    unmasked and rows taken out of order."""
    import xgrammar as xgr

    from deltaserve.ops.processing import mask_rows_ref

    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(5, vocab, generator=gen).bfloat16()
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    want = rows.float()
    full = torch.full((5, words), -1, dtype=torch.int32)
    full[[0, 2, 3]] = mask
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab)
    index = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    mask_of = torch.tensor([2, 0, -1, 1], dtype=torch.int32)
    got = mask_rows_ref(rows, index, mask_of, mask)
    assert got.dtype == torch.float32
    assert torch.equal(got, want[[3, 0, 1, 2]])
