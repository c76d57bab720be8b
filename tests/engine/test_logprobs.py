"""Per-token logprobs from the engine's own step logits (what a streamed response carries) against
teacher-forced scoring of the same tokens (the non-streamed path), on fresh prompts."""

from __future__ import annotations

import pytest

from deltaserve import SamplingParams
from deltaserve.errors import RequestError
from deltaserve.server.logprobs import score


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_step_logprobs_equal_teacher_forced_ones(tiny_llm, temperature) -> None:
    prompt = [5, 17, 99, 3, 250, 41, 7]
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=8, ignore_eos=True,
                            logprobs=3)
    out = tiny_llm.generate([prompt], params)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    forced, tops = score(tiny_llm, prompt + out.token_ids, 3)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert tok in entry and entry[tok] <= 0
        # the raw model distribution (temperature does not reshape the reported values)
        assert entry[tok] == pytest.approx(forced[len(prompt) + i], abs=1e-4)
        top = sorted(entry.values(), reverse=True)[:3]  # the alternatives, maybe with tok
        assert top == pytest.approx(list(tops[len(prompt) + i].values()), abs=1e-4)
        if temperature == 0:  # greedy picks the most likely token
            assert entry[tok] == pytest.approx(max(entry.values()), abs=1e-6)


def test_logprobs_bounds_and_the_greedy_head_contract(tiny_llm) -> None:
    with pytest.raises(RequestError, match="logprobs must be in"):
        SamplingParams(logprobs=21)
    from deltaserve.engine.engine import Engine, EngineConfig

    engine = Engine(tiny_llm.model, tiny_llm.tokenizer, tiny_llm.eos_token_ids,
                    tiny_llm.max_model_len, EngineConfig(greedy_head=True), "test")
    with pytest.raises(RequestError, match="logprobs are not available"):
        engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, logprobs=2))
    assert not engine.has_work
