"""SamplingParams validation, the sampler's filters, and stop handling (pure CPU, no model)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.sampling import SamplingParams, make_generator, sample
from deltaserve.engine.stopping import StopChecker
from deltaserve.errors import RequestError


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_params_raise_clear_errors(kwargs, word) -> None:
    with pytest.raises(RequestError, match=word):
        SamplingParams(**kwargs)


def _logits() -> torch.Tensor:
    return torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])


def test_greedy_and_top_k_one_pick_the_argmax() -> None:
    assert sample(_logits(), SamplingParams(temperature=0), None) == 1
    params = SamplingParams(temperature=1.0, top_k=1, seed=0)
    assert {
        sample(_logits(), params, make_generator(params, torch.device("cpu"))) for _ in range(20)
    } == {1}


def test_seed_makes_sampling_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=123)
    draws = []
    for _ in range(2):
        gen = make_generator(params, torch.device("cpu"))
        draws.append(
            [
                sample(torch.randn(50, generator=torch.Generator().manual_seed(i)), params, gen)
                for i in range(30)
            ]
        )
    assert draws[0] == draws[1]


def test_top_p_and_min_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    gen = make_generator(p, torch.device("cpu"))
    assert {sample(logits, p, gen) for _ in range(200)} == {0, 1}
    m = SamplingParams(temperature=1.0, min_p=0.5, seed=1)
    gen = make_generator(m, torch.device("cpu"))
    assert {sample(logits, m, gen) for _ in range(200)} == {0, 1}  # 0.3 >= 0.5*0.5, 0.15 is not


def test_stop_string_split_across_tokens_is_held_back_then_cut() -> None:
    checker = StopChecker(SamplingParams(stop=("STOP",)), frozenset())
    emitted = []
    for delta in ["hello S", "TO", "P tail"]:
        text, stop = checker.add_text(delta)
        emitted.append(text)
        if stop:
            break
    assert "".join(emitted) == "hello "
    assert stop == "STOP"


def test_partial_stop_prefix_is_released_when_it_does_not_complete() -> None:
    checker = StopChecker(SamplingParams(stop=("STOP",)), frozenset())
    assert checker.add_text("ab ST") == ("ab ", None)
    assert checker.add_text("X") == ("STX", None)


def test_without_stop_strings_every_delta_goes_straight_out() -> None:
    checker = StopChecker(SamplingParams(), frozenset())
    deltas = ["ab", "", "S", "TOP", " é"]
    assert [checker.add_text(d) for d in deltas] == [(d, None) for d in deltas]
    assert checker.finish() == ""  # nothing was held back


def test_stop_ids_and_eos() -> None:
    checker = StopChecker(SamplingParams(stop_token_ids=(7,)), frozenset({2}))
    assert checker.token_stop(7) == ("stop", 7)
    assert checker.token_stop(2) == ("stop", None)
    assert checker.token_stop(3) is None
    ignoring = StopChecker(SamplingParams(ignore_eos=True), frozenset({2}))
    assert ignoring.token_stop(2) is None


def test_batched_rows_draw_exactly_what_one_row_at_a_time_draws() -> None:
    """Mixed filters per row, each row seeded: sample_rows equals sample() row by row."""
    from deltaserve.engine.sampling import make_generator, sample, sample_rows

    torch.manual_seed(0)
    logits = torch.randn(6, 500) * 3
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.8, seed=3),
              SamplingParams(temperature=0.9, min_p=0.05, seed=4),
              SamplingParams(temperature=1.1, top_k=40, top_p=0.9, min_p=0.01, seed=5),
              SamplingParams(temperature=2.0, top_k=1, seed=6)]
    for _ in range(20):  # the generators advance identically on both sides
        gens_a = [make_generator(p, torch.device("cpu")) for p in params]
        gens_b = [make_generator(p, torch.device("cpu")) for p in params]
        one_by_one = [sample(logits[i], p, gens_a[i]) for i, p in enumerate(params)]
        assert sample_rows(logits, params, gens_b) == one_by_one
        assert one_by_one[5] == int(logits[5].argmax())  # top_k=1 is the argmax
        logits = torch.randn(6, 500) * 3
