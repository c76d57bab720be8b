"""The pace gate: drafting continues only while steps with drafts are measured faster."""

from __future__ import annotations

from deltaserve.spec.config import SpeculativeConfig
from deltaserve.spec.pace import PaceGate
from tests.engine.test_batching import run_all
from tests.spec.conftest import greedy, make_engine


def drive(gate: PaceGate, steps: int, draft_rate: float, plain_rate: float) -> list[bool]:
    """Runs `steps` decode-only steps at the given tokens/s per way; returns the choices."""
    choices = []
    for _ in range(steps):
        drafted = gate.choose()
        choices.append(drafted)
        gate.record(drafted, 4 if drafted else 1, (4 if drafted else 1) / (
            draft_rate if drafted else plain_rate))
    return choices


def test_a_losing_drafter_is_turned_off_and_probed() -> None:
    gate = PaceGate(probe_every=16, warmup_steps=8)
    choices = drive(gate, 200, draft_rate=50.0, plain_rate=100.0)
    assert not gate.drafting
    late = choices[64:]
    assert sum(late) == len([i for i in range(65, 201) if i % 16 == 0])  # only the probes draft


def test_a_winning_drafter_stays_on_and_a_slowdown_turns_it_off() -> None:
    gate = PaceGate(probe_every=16, warmup_steps=8)
    choices = drive(gate, 100, draft_rate=300.0, plain_rate=100.0)
    assert gate.drafting and sum(choices[20:]) == 80 - len([i for i in range(21, 101)
                                                            if i % 16 == 0])
    drive(gate, 200, draft_rate=60.0, plain_rate=100.0)  # the context grew: verify now loses
    assert not gate.drafting and gate.num_switches == 1


def test_a_way_is_measured_before_it_is_judged() -> None:
    gate = PaceGate()
    assert [gate.choose() for _ in range(2)] == [True, True]  # drafts' first step is not a rate
    gate.ways[1].rates[True] = 10.0
    assert gate.choose() is False


def test_each_batch_size_is_judged_on_its_own_rates() -> None:
    gate = PaceGate(probe_every=16, warmup_steps=8)
    for _ in range(60):  # batch 8: drafting loses
        d = gate.choose(8)
        gate.record(d, 8 * (2 if d else 1), 0.01 * (4 if d else 1), 8)
    assert not gate.ways[8].drafting
    assert gate.choose(1) is True  # a single sequence starts unmeasured: drafts are tried


def test_paced_engine_gives_the_same_tokens_and_reports_its_state(tiny_bf16_llm) -> None:
    prompts = {"r": [7, 8, 9, 10] * 8}
    want = run_all(make_engine(tiny_bf16_llm), prompts, greedy(40))
    engine = make_engine(tiny_bf16_llm, SpeculativeConfig(num_speculative_tokens=3))
    assert run_all(engine, prompts, greedy(40)) == want
    pace = engine.spec.stats.as_dict()["pace"]
    assert set(pace["tok_s"][1]) == {"draft", "plain"} and engine.spec.stats.num_drafts > 0


def test_a_step_without_drafts_is_recorded_under_its_own_batch_size() -> None:
    """The speculator hands the gate each timed step's number of sequences, skipped drafts too."""
    from types import SimpleNamespace

    from deltaserve.spec.verify import Speculator

    spec = Speculator(SpeculativeConfig(), engine=None)
    spec.pace.choose = lambda num_seqs: False  # drafting measured not to pay: no drafts
    for num_seqs in (3, 3, 5):
        plan = SimpleNamespace(chunks=[SimpleNamespace(token_ids=(1,))] * num_seqs)
        assert spec.draft(plan) is plan
        spec.timed(num_seqs, 0.01)
    assert spec.pace.ways[3].num_seen == {True: 0, False: 2}
    assert spec.pace.ways[5].num_seen == {True: 0, False: 1} and 1 not in spec.pace.ways
