"""Prompt logprobs scored by the engine's own prefill (SamplingParams.prompt_logprobs) against
teacher-forced scoring of the same ids on a sequence of its own (server/logprobs.score), on fresh
random prompts split into several prefill chunks, beside requests that do not ask for them."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.errors import RequestError
from deltaserve.server.logprobs import score


@pytest.fixture(scope="module")
def chunked(tiny_dir):
    """The tiny model with 64-token prefill chunks: a 150-token prompt takes three steps."""
    return LLM(tiny_dir, dtype="float32", max_num_batched_tokens=64)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(llm, prompt: list[int], got, k: int) -> None:
    forced, tops = score(llm, prompt, k)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        assert got[i][prompt[i]] == pytest.approx(forced[i], abs=1e-5), i
        if k == 0:
            assert list(got[i]) == [prompt[i]]  # the token alone, no alternatives
            continue
        top = sorted(got[i].values(), reverse=True)[:k]  # the alternatives, maybe the token
        assert top == pytest.approx(sorted(tops[i].values(), reverse=True), abs=1e-5), i


@pytest.mark.parametrize("k", [0, 3])
def test_prefill_scores_the_prompt_as_teacher_forcing_does(chunked, k) -> None:
    prompt = _prompt(k, 150)
    out = chunked.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                    prompt_logprobs=k))[0]
    _check(chunked, prompt, out.prompt_logprobs, k)
    assert len(out.outputs[0].token_ids) == 2


def test_a_cached_prompt_is_still_scored_whole_and_others_are_untouched(chunked) -> None:
    """The same prompt twice (its prefix snapshots cached by the first run): both scored in
    full; a free request in the same steps gets the tokens it gets alone."""
    prompt, other = _prompt(7, 140), _prompt(8, 90)
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = chunked.generate([other], free)[0].outputs[0].token_ids
    chunked.generate([prompt], free)  # its snapshots enter the prefix cache
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    both = chunked.generate([prompt, other], [scored, free])
    _check(chunked, prompt, both[0].prompt_logprobs, 2)
    assert both[1].prompt_logprobs is None
    assert both[1].outputs[0].token_ids == alone
    again = chunked.generate([prompt], scored)[0].prompt_logprobs
    for i in range(1, len(prompt)):  # a third run: the same values, not a resumed tail
        assert again[i] == pytest.approx(both[0].prompt_logprobs[i], abs=1e-6), i


def test_bounds_and_engines_that_cannot(tiny_llm) -> None:
    with pytest.raises(RequestError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)
    from deltaserve.engine.engine import Engine, EngineConfig

    engine = Engine(tiny_llm.model, tiny_llm.tokenizer, tiny_llm.eos_token_ids,
                    tiny_llm.max_model_len, EngineConfig(greedy_head=True), "test")
    with pytest.raises(RequestError, match="prompt_logprobs: this engine runs the greedy-only"):
        engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, prompt_logprobs=1))
    assert not engine.has_work


@pytest.mark.gpu
def test_on_cuda_beside_graph_decodes(tiny_dir) -> None:
    """On CUDA (decode graphs captured, overlapped greedy decode): the scored request's steps
    run eagerly with its hidden rows, the free one's tokens are what it gets alone."""
    llm = LLM(tiny_dir, dtype="float32", device="cuda", max_num_batched_tokens=64)
    prompt, other = _prompt(11, 150), _prompt(12, 70)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([other], free)[0].outputs[0].token_ids
    scored = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3)
    both = llm.generate([prompt, other], [scored, free])
    assert both[1].outputs[0].token_ids == alone
    forced, _ = score(llm, prompt, 3)
    for i in range(1, len(prompt)):
        assert both[0].prompt_logprobs[i][prompt[i]] == pytest.approx(forced[i], abs=1e-4), i
