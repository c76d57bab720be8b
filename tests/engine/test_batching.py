"""The batched engine against single runs, on the tiny checkpoint in fp32 (CPU)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from deltaserve.cache.manager import CacheConfig
from deltaserve.cache.sequence import Sequence
from deltaserve.engine.engine import Engine, EngineConfig
from deltaserve.engine.sampling import SamplingParams
from deltaserve.engine.scheduler import SchedulerConfig
from deltaserve.errors import CapacityError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(llm, num_slots=4, num_blocks=64, budget=96, prefix_bytes=1 << 28, max_waiting=64,
                fingerprint="test", snapshots="sparse"):
    """snapshots="grid": a snapshot every 64 tokens of every prompt (tests of resuming exactly at
    and between grid positions); "sparse" is the engine's default (cache/prefix.py)."""
    cfg = EngineConfig(SchedulerConfig(max_num_seqs=num_slots, max_num_batched_tokens=budget,
                                       max_prefill_chunk=budget, max_waiting=max_waiting),
                       CacheConfig(num_slots, num_blocks, 16, 64, prefix_bytes,
                                   prefix_snapshots=snapshots))
    return Engine(llm.model, llm.tokenizer, llm.eos_token_ids, llm.max_model_len, cfg, fingerprint)


def capture(engine) -> dict[str, list[torch.Tensor]]:
    """Record the logits the runner hands to the sampler, per request."""
    seen: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def wrapped(plan, all_ids, feed=None, images=None, hidden=False):
        out = execute(plan, all_ids, feed, images, hidden)
        for rid, lg in out.items():
            seen.setdefault(rid, []).append(lg.clone())
        return out

    engine.runner.execute = wrapped
    return seen


def run_all(engine, prompts: dict[str, list[int]], params=GREEDY, max_steps=2000,
            after_step=None):
    """Every prompt to completion; after_step(engine) runs after each step (state probes)."""
    tokens = defaultdict(list, {rid: [] for rid in prompts})
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    for _ in range(max_steps):
        if not engine.has_work:
            break
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.token_ids)
        if after_step is not None:
            after_step(engine)
    assert not engine.has_work
    return dict(tokens)


def solo(model, ids: list[int], num_new: int):
    """The single-sequence path: prefill in one call, then one token per call."""
    seq = Sequence(model, len(ids) + num_new)
    logits = [seq.forward(ids)[0]]
    toks = [int(logits[-1].argmax())]
    for _ in range(num_new - 1):
        logits.append(seq.forward(toks[-1:])[0])
        toks.append(int(logits[-1].argmax()))
    return toks, torch.stack(logits)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def prompts_of(lengths, seed=0, vocab=1000) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(1, vocab, (n,), generator=g).tolist() for i, n in enumerate(lengths)}


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir):
    from deltaserve import LLM

    return LLM(tiny_dir, dtype="bfloat16")  # bf16 weights, fp32 activations on CPU


@pytest.mark.parametrize("which", ["fp32", "bf16"])
def test_batch_of_n_equals_n_single_runs(tiny_llm, tiny_bf16, which) -> None:
    """bf16 weights: decode rows of a batch go through the small-batch GEMM, singles through the
    GEMV; both are fp32 math on the same bf16 weights."""
    llm = tiny_llm if which == "fp32" else tiny_bf16
    engine = make_engine(llm, prefix_bytes=0)
    seen = capture(engine)
    prompts = prompts_of([5, 150, 70, 1, 33])  # 150 > budget 96: chunked, mixed with decodes
    tokens = run_all(engine, prompts)
    for rid, ids in prompts.items():
        want_toks, want_logits = solo(llm.model, ids, GREEDY.max_tokens)
        assert tokens[rid] == want_toks, rid
        got = torch.stack(seen[rid])
        assert got.shape == want_logits.shape
        assert rel(got, want_logits) <= 1e-5, rid


def prefix_cases(base: list[int]) -> dict[str, list[int]]:
    """Prompts sharing base's first tokens: resuming exactly at a boundary (128, then one token),
    between boundaries (64 + 36), past the last one, and diverging after 130 tokens."""
    return {"at": base[:129], "between": base[:100], "past": base[:192] + [7, 8, 9],
            "diverging": base[:130] + [5] * 20}


@pytest.mark.parametrize(("budget", "bound"), [(64, 0.0), (96, 5e-6)])
def test_prefix_hit_equals_miss_at_and_between_boundaries(tiny_llm, budget, bound) -> None:
    """One request at a time. With chunks of the snapshot granularity (64) the hit runs the same
    kernels on the same rows as the miss past the boundary: bit-identical logits, on every ISA.
    With 96-token chunks the miss crosses the boundary inside a chunk (a 1-token tail takes the
    decode kernel instead of the scan) and a row sits in GEMMs of another row count: torch's fp32
    GEMM (MKL sgemm) picks its kernel, so its K summation order, by the row count and by the
    CPU's ISA (a row's bits in a 200-row and an 8-row call agree with MKL's AVX-512 kernels and
    differ with its AVX2 ones). Measured worst case ("past"): 9.3e-7 with MKL's and ATen's
    AVX-512 kernels, 1.02e-6 with MKL_ENABLE_INSTRUCTIONS=AVX2, 1.11e-6 with ATen's AVX2 kernels
    too, 1.09e-6 on an AVX2-only AMD EPYC; our C kernels' AVX2 and AVX-512 builds give the same
    bits here (fp32 weights). 5e-6: 4x the widest draw; the greedy tokens must match as well."""
    base = prompts_of([200], seed=3)["r0"]
    cold = make_engine(tiny_llm, prefix_bytes=0, budget=budget)
    warm = make_engine(tiny_llm, budget=budget, snapshots="grid")
    run_all(warm, {"seed": base})  # snapshots at 64, 128, 192
    assert warm.cache.prefix.stats()["entries"] == 3
    seen_cold, seen_warm = capture(cold), capture(warm)
    for rid, ids in prefix_cases(base).items():
        hits = warm.cache.prefix.hits
        assert run_all(warm, {rid: ids}) == run_all(cold, {rid: ids}), rid
        assert warm.cache.prefix.hits == hits + 1
        got, want = torch.stack(seen_warm[rid]), torch.stack(seen_cold[rid])
        assert rel(got, want) <= bound, rid


def test_prefix_hits_in_a_mixed_batch(tiny_llm) -> None:
    """All cases at once, hits and misses sharing steps: greedy identical, the batch bound."""
    base = prompts_of([200], seed=3)["r0"]
    cold, warm = make_engine(tiny_llm, prefix_bytes=0), make_engine(tiny_llm)
    run_all(warm, {"seed": base})
    seen_cold, seen_warm = capture(cold), capture(warm)
    out_cold, out_warm = run_all(cold, prefix_cases(base)), run_all(warm, prefix_cases(base))
    for rid in out_cold:
        assert out_warm[rid] == out_cold[rid], rid
        assert rel(torch.stack(seen_warm[rid]), torch.stack(seen_cold[rid])) <= 1e-5, rid


def test_sparse_snapshots_serve_a_shared_system_prompt_and_the_next_turn(tiny_llm) -> None:
    """The default snapshots: a system prompt's first user snapshots only its own end (192); the
    second misses and snapshots the branch point too (grid 128 of a 150-token system prompt), which
    the third hits; a later turn hits the end of the turn before it. Tokens and logits: a cold
    engine's (within 1e-5)."""
    system, q1, q2, q3 = prompts_of([150, 60, 50, 30], seed=17).values()
    cold, warm = make_engine(tiny_llm, prefix_bytes=0), make_engine(tiny_llm)
    seen_cold, seen_warm = capture(cold), capture(warm)

    def both(rid: str, ids: list[int]) -> list[int]:
        out = run_all(warm, {rid: ids})
        assert out == run_all(cold, {rid: ids}), rid
        assert rel(torch.stack(seen_warm[rid]), torch.stack(seen_cold[rid])) <= 1e-5, rid
        return out[rid]

    both("first", system + q1)
    both("second", system + q2)
    assert warm.cache.prefix.hits == 0
    assert sorted(e.length for e in warm.cache.prefix.entries.values()) == [128, 192, 192]
    both("third", system + q3)
    assert warm.cache.prefix.hits == 1
    answer = both("turn1", system + q1 + q2)  # 260 tokens: resumes at 192, the first's end
    assert warm.cache.prefix.hits == 2
    both("turn2", system + q1 + q2 + answer + q3)  # 296: resumes at 256, turn1's end
    assert warm.cache.prefix.hits == 3
    assert max(e.length for e in warm.cache.prefix.entries.values()) == 256
    hits, repeated = warm.cache.prefix.hits, prompts_of([128], seed=23)["r0"]
    both("once", repeated)  # a length on the grid: snapshots 64, where the same prompt resumes
    both("twice", repeated)
    assert warm.cache.prefix.hits == hits + 1

def test_restored_state_is_bit_identical_to_a_miss(tiny_llm) -> None:
    """The snapshot at 128 taken inside a 200-token prefill equals the state of a 128-token run."""
    ids = prompts_of([200], seed=5)["r0"]
    warm = make_engine(tiny_llm, snapshots="grid")
    run_all(warm, {"a": ids})
    snap = warm.cache.prefix.lookup(ids + [1], 129)
    assert snap is not None and snap.length == 128
    cold = make_engine(tiny_llm, prefix_bytes=0)
    cold.add_request("b", ids[:128], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    cold.step()  # budget 96: [0, 64) then [64, 128) (chunks stop on the 64-grid)
    cold.step()
    slot = cold.cache.slot_of("b")
    for layer, s in enumerate(snap.states):
        if s is None:
            continue
        assert torch.equal(s[0], cold.cache.states.conv[layer][slot]), layer
        assert torch.equal(s[1], cold.cache.states.recurrent[layer][slot]), layer
        assert s[1].abs().sum() > 0


def test_park_resume_and_abort_leave_others_exact(tiny_llm) -> None:
    engine = make_engine(tiny_llm, prefix_bytes=0)
    prompts = prompts_of([20, 30, 40], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    tokens = {rid: [] for rid in prompts}
    for _ in range(3):
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.token_ids)
    engine.park("r0")
    engine.abort("r2")
    parked_len = len(tokens["r0"])
    for _ in range(4):
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.token_ids)
    assert len(tokens["r0"]) == parked_len  # parked: no progress
    engine.resume("r0")
    while engine.has_work:
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.token_ids)
    for rid in ("r0", "r1"):
        assert tokens[rid] == solo(tiny_llm.model, prompts[rid], 10)[0], rid
    usage = engine.cache.usage()
    assert usage["slots_used"] == 0 and usage["blocks_free"] == usage["blocks_total"]


@pytest.mark.parametrize(("snapshots", "num_entries"), [("grid", 3), ("sparse", 2)])
def test_every_byte_returns_to_the_pools(tiny_llm, snapshots, num_entries) -> None:
    """grid: 64 and 128 of the first prompt, 64 of the second; sparse: 128 and 64 (each one's last
    grid position)."""
    engine = make_engine(tiny_llm, snapshots=snapshots)
    run_all(engine, prompts_of([130, 70, 10], seed=9))
    usage = engine.cache.usage()
    assert usage["slots_used"] == 0 and usage["blocks_held_by_requests"] == 0
    assert usage["prefix_entries"] == num_entries
    assert usage["blocks_free"] < usage["blocks_total"]  # snapshots hold their KV blocks
    engine.cache.prefix.clear()
    assert engine.cache.usage()["blocks_free"] == usage["blocks_total"]
    assert engine.cache.usage()["prefix_bytes"] == 0


def test_reset_one_slot_leaves_neighbours(tiny_llm) -> None:
    engine = make_engine(tiny_llm, prefix_bytes=0)
    states = engine.cache.states
    slots = [states.allocate() for _ in range(3)]
    for layer, r in enumerate(states.recurrent):
        if r is not None:
            r[slots].normal_()
            states.conv[layer][slots].normal_()
    before = [None if r is None else r.clone() for r in states.recurrent]
    states.reset(slots[1])
    for layer, r in enumerate(states.recurrent):
        if r is not None:
            assert torch.equal(r[slots[0]], before[layer][slots[0]])
            assert torch.equal(r[slots[2]], before[layer][slots[2]])
            assert r[slots[1]].abs().sum() == 0


def test_state_pool_without_gdn_layers_and_restore(tiny_llm) -> None:
    """A pipeline stage holding only attention layers has a state pool with nothing in it:
    reset and restore are no-ops there. Elsewhere restore puts a snapshot back bit for bit."""
    from dataclasses import replace

    from deltaserve.cache.pools import StatePool

    cfg = tiny_llm.model.cfg
    attention_only = replace(cfg, layer_types=["full_attention"] * len(cfg.layer_types))
    empty = StatePool(attention_only, 2, torch.float32, torch.device("cpu"))
    slot = empty.allocate()
    empty.restore(slot, empty.snapshot(slot))
    states = StatePool(cfg, 3, torch.float32, torch.device("cpu"))
    slot = states.allocate()
    for c, r in zip(states.conv, states.recurrent, strict=True):
        if c is not None:
            c[slot].normal_(), r[slot].normal_()
    snap = states.snapshot(slot)
    states.reset(slot)
    assert all(t[slot].abs().sum() == 0 for t in (*states.conv, *states.recurrent) if t is not None)
    states.restore(slot, snap)
    for layer, s in enumerate(snap):
        if s is not None:
            assert torch.equal(states.conv[layer][slot], s[0])
            assert torch.equal(states.recurrent[layer][slot], s[1])


def test_full_pools_wait_or_refuse(tiny_llm) -> None:
    # 2 slots for 5 requests: the rest wait and run later, every output exact
    engine = make_engine(tiny_llm, num_slots=2, num_blocks=24, prefix_bytes=0)
    prompts = prompts_of([40, 50, 60, 30, 20], seed=11)
    tokens = run_all(engine, prompts)
    for rid, ids in prompts.items():
        assert tokens[rid] == solo(tiny_llm.model, ids, GREEDY.max_tokens)[0], rid
    small = make_engine(tiny_llm, num_slots=2, num_blocks=4, max_waiting=2, prefix_bytes=0)
    with pytest.raises(CapacityError, match="KV pool"):
        small.add_request("big", list(range(1, 80)), GREEDY)  # 4 blocks of 16 = 64 positions
    small.add_request("a", [1, 2, 3], GREEDY)
    small.add_request("b", [4, 5, 6], GREEDY)
    with pytest.raises(CapacityError, match="queue is full"):
        small.add_request("c", [7, 8, 9], GREEDY)
    out = run_all(small, {})  # the two admitted requests still run to the end, exactly
    assert out == {rid: solo(tiny_llm.model, ids, GREEDY.max_tokens)[0]
                   for rid, ids in (("a", [1, 2, 3]), ("b", [4, 5, 6]))}


def test_export_import_round_trip_and_refusals(tiny_llm, tmp_path) -> None:
    ids = prompts_of([140], seed=13)["r0"]
    src = make_engine(tiny_llm, snapshots="grid")
    run_all(src, {"a": ids})
    path = tmp_path / "prefix.safetensors"
    assert src.export_prefix_cache(path) == 2
    dst = make_engine(tiny_llm)
    seen = capture(dst)
    assert dst.import_prefix_cache(path) == 2
    out = run_all(dst, {"b": ids[:130] + [3, 4]})
    assert dst.cache.prefix.hits == 1
    want_toks, want_logits = solo(tiny_llm.model, ids[:130] + [3, 4], GREEDY.max_tokens)
    assert out["b"] == want_toks
    assert rel(torch.stack(seen["b"]), want_logits) <= 1e-5
    other = make_engine(tiny_llm, fingerprint="another-model")
    before = other.cache.usage()
    from deltaserve.errors import CheckpointError

    with pytest.raises(CheckpointError, match="fingerprint"):
        other.import_prefix_cache(path)
    assert other.cache.usage() == before
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        other.import_prefix_cache(tmp_path / "junk.safetensors")


def test_kv_pressure_preempts_and_recomputes_exactly(tiny_llm) -> None:
    # 12 blocks of 16 = 192 positions for 4 sequences that grow to 60 each: someone is preempted
    engine = make_engine(tiny_llm, num_slots=4, num_blocks=12, prefix_bytes=0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = prompts_of([40, 40, 40, 40], seed=17)
    preempted = []
    schedule = engine.scheduler.schedule

    def watch():
        plan = schedule()
        preempted.extend(plan.preempted)
        return plan

    engine.scheduler.schedule = watch
    tokens = run_all(engine, prompts, params)
    assert preempted, "the pool was meant to run short"
    for rid, ids in prompts.items():
        assert tokens[rid] == solo(tiny_llm.model, ids, 20)[0], rid
    assert engine.cache.usage()["blocks_free"] == 12


def test_snapshots_of_another_dtype_are_refused(tiny_llm, tiny_bf16, tmp_path) -> None:
    """Real fingerprints (LLM.engine): the same checkpoint loaded with bf16 weights is another
    model as far as its states go."""
    from deltaserve.errors import CheckpointError

    ids = prompts_of([70], seed=19)["r0"]
    tiny_llm.generate({"prompt_token_ids": ids}, GREEDY)
    path = tmp_path / "fp32.safetensors"
    assert tiny_llm.engine.export_prefix_cache(path) >= 1
    before = tiny_bf16.engine.cache.usage()
    with pytest.raises(CheckpointError, match="refused"):
        tiny_bf16.engine.import_prefix_cache(path)
    assert tiny_bf16.engine.cache.usage() == before


def test_greedy_head_engine_matches_and_refuses_sampling(tiny_llm) -> None:
    """The greedy-only head: same tokens as the logits path; a sampling request is refused
    before anything changes."""
    cfg = EngineConfig(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=96,
                                       max_prefill_chunk=96), CacheConfig(4, 64, 16, 64, 0), True)
    greedy = Engine(tiny_llm.model, tiny_llm.tokenizer, tiny_llm.eos_token_ids,
                    tiny_llm.max_model_len, cfg, "test")
    prompts = prompts_of([5, 70, 33], seed=23)
    assert run_all(greedy, prompts) == run_all(make_engine(tiny_llm, prefix_bytes=0), prompts)
    from deltaserve.errors import RequestError

    before = greedy.cache.usage()
    with pytest.raises(RequestError, match="greedy-only"):
        greedy.add_request("s", [1, 2, 3], SamplingParams(temperature=0.8, max_tokens=4))
    assert greedy.cache.usage() == before and not greedy.has_work


def test_non_finite_logits_end_one_request_and_never_reach_the_prefix_cache(tiny_llm,
                                                                          monkeypatch) -> None:
    engine = make_engine(tiny_llm)
    prompts = prompts_of([130, 70], seed=29)
    head = tiny_llm.model.head_out
    poisoned = {"done": False}

    def poison(h, greedy=False):  # the first step's first chunk (r0's prefill) goes NaN
        out = head(h, greedy)
        if not poisoned["done"]:
            poisoned["done"] = True
            out = out.clone()
            out[0, 7] = float("nan")
        return out

    monkeypatch.setattr(tiny_llm.model, "head_out", poison)
    events = defaultdict(list)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    while engine.has_work:
        for ev in engine.step():
            events[ev.request_id].append(ev)
    assert [e.finish_reason for e in events["r0"]] == ["error"] and events["r0"][0].text == ""
    assert [t for e in events["r1"] for t in e.token_ids] == solo(tiny_llm.model, prompts["r1"],
                                                                   GREEDY.max_tokens)[0]
    assert engine.cache.prefix.lookup(prompts["r0"], 129) is None  # r0's states were not kept
    assert engine.cache.prefix.lookup(prompts["r1"], 69) is not None  # r1's 64-token snapshot was
    usage = engine.cache.usage()
    assert usage["slots_used"] == 0 and usage["blocks_held_by_requests"] == 0


def test_kv_cache_dtype_is_an_option(tiny_dir) -> None:
    """bf16 K/V under fp32 activations: half the KV bytes, logits close to the fp32 KV's."""
    from deltaserve import LLM
    from deltaserve.errors import RequestError

    with pytest.raises(RequestError, match="kv_cache_dtype must be one of"):
        LLM(tiny_dir, dtype="float32", kv_cache_dtype="int3")
    runs = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(tiny_dir, dtype="float32", kv_cache_dtype=kv, prefix_cache_bytes=0)
        seen = capture(llm.engine)
        llm.generate({"prompt_token_ids": prompts_of([90], seed=31)["r0"]}, GREEDY)
        runs[kv] = (torch.stack(next(iter(seen.values()))), llm.engine.cache)
    (fp32, c32), (bf16, c16) = runs["auto"], runs["bfloat16"]
    assert c16.kv.bytes_per_block() * 2 == c32.kv.bytes_per_block()
    assert next(t for t in c16.kv.k if t is not None).dtype == torch.bfloat16
    assert 0 < rel(bf16, fp32) <= 2e-2
