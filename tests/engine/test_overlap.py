"""Overlapped decode (engine/overlap.py) against the plain engine on the same workloads: the same
tokens, text and finish reasons per request, whatever stops them and whenever they arrive, and
every slot and block back in the pools. On CPU the launched step runs eagerly; the bookkeeping is the
same code the GPU runs (there with CUDA graphs, checked in tests/engine/test_cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from deltaserve.engine.sampling import SamplingParams
from tests.engine.test_batching import make_engine, prompts_of, solo


def overlapped(llm, **kw):
    engine = make_engine(llm, **kw)
    engine.config = replace(engine.config, overlap=True)
    return engine


def drive(engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          abort_at: dict[int, str] | None = None) -> dict[str, tuple]:
    """Add requests at the given step numbers, abort some later; (tokens, text, reason, stop)."""
    got: dict[str, list] = {}
    step = 0
    while step <= max(arrivals) or engine.has_work:
        for rid, ids, params in arrivals.get(step, []):
            engine.add_request(rid, ids, params)
            got[rid] = [[], "", None, None]
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        for ev in engine.step():
            out = got[ev.request_id]
            out[0].extend(ev.token_ids)
            out[1] += ev.text
            if ev.finished:
                out[2], out[3] = ev.finish_reason, ev.stop_reason
        step += 1
        assert step < 2000
    usage = engine.cache.usage()
    assert usage["slots_used"] == 0 and usage["blocks_held_by_requests"] == 0
    return {rid: tuple(v) for rid, v in got.items()}


def workload(llm) -> dict[int, list]:
    """Greedy requests stopped by a stop id, a stop string, the length limit; one sampling
    request (runs unoverlapped); late arrivals. Stops are taken from a free run's own output."""
    prompts = prompts_of([37, 5, 130, 12, 20, 9], seed=41)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = {rid: solo(llm.model, ids, 12)[0] for rid, ids in prompts.items()}
    stop_text = llm.tokenizer.decode(ref["r1"][3:5])
    params = {
        "r0": replace(free, stop_token_ids=(ref["r0"][4],)),
        "r1": replace(free, stop=(stop_text,)) if stop_text.strip() else free,
        "r2": replace(free, max_tokens=3),
        "r3": SamplingParams(temperature=0.9, seed=5, max_tokens=7, ignore_eos=True),
        "r4": free,
        "r5": replace(free, max_tokens=1),
    }
    when = {"r0": 0, "r1": 0, "r2": 0, "r3": 2, "r4": 5, "r5": 6}
    arrivals: dict[int, list] = {}
    for rid, ids in prompts.items():
        arrivals.setdefault(when[rid], []).append((rid, ids, params[rid]))
    return arrivals


def test_overlapped_engine_equals_the_plain_one(tiny_llm) -> None:
    arrivals = workload(tiny_llm)
    plain = drive(make_engine(tiny_llm), arrivals)
    ahead = drive(overlapped(tiny_llm), arrivals)
    assert ahead == plain
    assert plain["r0"][2] == "stop" and plain["r2"][2] == "length" and len(plain["r2"][0]) == 3


def test_overlap_with_aborts_and_greedy_only_batches(tiny_llm) -> None:
    prompts = prompts_of([9, 9, 9, 9], seed=43)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    arrivals = {0: [(rid, ids, params) for rid, ids in prompts.items()]}
    engine = overlapped(tiny_llm)
    launches = []
    from deltaserve.engine import overlap

    launch = overlap.launch

    def counting(*args):
        launches.append(1)
        return launch(*args)

    overlap.launch = counting
    try:
        got = drive(engine, arrivals, abort_at={4: "r1"})
    finally:
        overlap.launch = launch
    assert len(launches) >= 8  # the decode steps really ran ahead
    for rid in ("r0", "r2", "r3"):
        assert got[rid][0] == solo(tiny_llm.model, prompts[rid], 10)[0]
    assert len(got["r1"][0]) < 10 and got["r1"][2] is None  # aborted: no finish event


def test_overlap_under_kv_pressure_preempts_and_recomputes_exactly(tiny_llm) -> None:
    engine = overlapped(tiny_llm, num_slots=4, num_blocks=12, prefix_bytes=0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = prompts_of([40, 40, 40, 40], seed=17)
    got = drive(engine, {0: [(rid, ids, params) for rid, ids in prompts.items()]})
    for rid, ids in prompts.items():
        assert got[rid][0] == solo(tiny_llm.model, ids, 20)[0], rid
    assert engine.cache.usage()["blocks_free"] == 12


def test_a_non_finite_decode_step_fails_one_request_when_overlapped(tiny_llm,
                                                                    monkeypatch) -> None:
    engine = overlapped(tiny_llm)
    prompts = prompts_of([11, 6], seed=47)
    head, steps = tiny_llm.model.head_out, []

    def poison(h, greedy=False):  # the head of every executor: the prefill step, then decodes
        out = head(h, greedy)
        steps.append(1)
        if len(steps) == 4:  # r0's row of the third all-decode step goes NaN
            out = out.clone()
            out[0, 3] = float("nan")
        return out

    monkeypatch.setattr(tiny_llm.model, "head_out", poison)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = drive(engine, {0: [(rid, ids, params) for rid, ids in prompts.items()]})
    assert got["r0"][2] == "error" and len(got["r0"][0]) == 3  # prefill + 2 decodes, then NaN
    assert got["r1"][0] == solo(tiny_llm.model, prompts["r1"], 8)[0]
    assert torch.isfinite(torch.tensor(got["r1"][0], dtype=torch.float)).all()


def test_unread_tokens_are_counted_never_written_as_ids(tiny_llm) -> None:
    """While a step is in flight its requests hold unread tokens (Request.num_unread: positions
    taken, ids on the device), at most two (the step in flight and the one just launched);
    output_ids only ever holds tokens read back, and every request ends with none unread."""
    engine = overlapped(tiny_llm)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    for rid, ids in prompts_of([7, 13], seed=53).items():
        engine.add_request(rid, ids, params)
    seen_unread, vocab = 0, tiny_llm.config.vocab_size
    while engine.has_work:
        engine.step()
        for rid in ("r0", "r1"):
            if engine.live(rid) is None:
                continue
            req = engine.scheduler.get(rid)
            assert 0 <= req.num_unread <= 2
            assert all(0 <= t < vocab for t in req.output_ids)
            assert req.num_tokens == len(req.prompt_ids) + len(req.output_ids) + req.num_unread
            seen_unread = max(seen_unread, req.num_unread)
    assert seen_unread >= 1  # the steps really ran ahead


def test_processed_requests_run_ahead_with_the_plain_engines_tokens(tiny_llm) -> None:
    """Penalties, biases, bans, min_tokens, a regex and a choice grammar beside free requests:
    the steps launch ahead (the processing of each is planned once the step before resolved)
    and every request gets the plain engine's tokens, text and finish; a row whose every token
    is masked fails alone with its reason."""
    from deltaserve.engine import overlap
    from deltaserve.structured.params import StructuredOutputsParams as S

    prompts = prompts_of([9, 14, 6, 11, 8, 10, 7], seed=59)
    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eos = min(tiny_llm.engine.eos_ids)
    params = {
        "r0": free,
        "r1": replace(free, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3),
        "r2": replace(free, logit_bias=((7, 30.0), (11, 29.5)), min_tokens=4,
                      bad_words=("hello",)),
        "r3": SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=S(regex="[0-9]{3}")),
        "r4": SamplingParams(temperature=0.0, max_tokens=12,
                             structured_outputs=S(choice=("alpha", "beta gamma"))),
        "r5": replace(free, allowed_token_ids=(eos,), min_tokens=3),  # nothing allowed: fails
        "r6": replace(free, repetition_penalty=0.7),
    }
    arrivals = {0: [(rid, prompts[rid], params[rid]) for rid in ("r0", "r1", "r3", "r5")],
                3: [(rid, prompts[rid], params[rid]) for rid in ("r2", "r4", "r6")]}
    plain = drive(make_engine(tiny_llm), arrivals)
    finished = []
    finish = overlap.finish
    overlap.finish = lambda engine, flight: (finished.append(1), finish(engine, flight))
    try:
        ahead = drive(overlapped(tiny_llm), arrivals)
    finally:
        overlap.finish = finish
    assert ahead == plain
    assert len(finished) >= 8
    assert plain["r5"][2] == "error" and "no token is allowed" in plain["r5"][3]
    assert plain["r3"][1].isdigit() and len(plain["r3"][1]) == 3, plain["r3"]
    assert plain["r4"][1] in ("alpha", "beta gamma"), plain["r4"]
    assert plain["r1"][0] != plain["r0"][0] or prompts["r1"] == prompts["r0"]


def test_grammar_only_steps_take_the_fused_pick_and_fail_a_nan_row_alone(tiny_llm,
                                                                         monkeypatch) -> None:
    """Every row grammar-constrained with nothing else to apply: the run-ahead steps pick tokens
    and both flags in one pass (ops/processing.mask_pick) and give the plain engine's outputs; a
    row whose logits go NaN fails alone, with the non-finite reason, not the grammar's."""
    from deltaserve.engine import overlap
    from deltaserve.structured.params import StructuredOutputsParams as S

    prompts = prompts_of([9, 14, 6], seed=61)
    params = {"r0": SamplingParams(temperature=0.0, max_tokens=12,
                                   structured_outputs=S(regex="[0-9]{2}-[a-z]{3}")),
              "r1": SamplingParams(temperature=0.0, max_tokens=12,
                                   structured_outputs=S(choice=("alpha", "beta gamma"))),
              "r2": SamplingParams(temperature=0.0, max_tokens=12,
                                   structured_outputs=S(json={"type": "boolean"}))}
    arrivals = {0: [(rid, prompts[rid], params[rid]) for rid in params]}
    plain = drive(make_engine(tiny_llm), arrivals)
    fused = []
    mask_pick = overlap.mask_pick
    monkeypatch.setattr(overlap, "mask_pick", lambda *a: (fused.append(1), mask_pick(*a)))
    assert drive(overlapped(tiny_llm), arrivals) == plain
    assert len(fused) >= 3
    assert plain["r1"][1] in ("alpha", "beta gamma") and plain["r2"][1] in ("true", "false")

    head, steps = tiny_llm.model.head_out, []

    def poison(h, greedy=False):  # r0's row of the third all-decode step goes NaN
        out = head(h, greedy)
        steps.append(1)
        if len(steps) == 4:
            out = out.clone()
            out[0, 3] = float("nan")
        return out

    monkeypatch.setattr(tiny_llm.model, "head_out", poison)
    got = drive(overlapped(tiny_llm), arrivals)
    assert got["r0"][2] == "error" and got["r0"][3] == "non-finite logits"
    assert got["r1"] == plain["r1"] and got["r2"] == plain["r2"]
