"""Short prefill chunks through the padded, device-indexed step a CUDA graph captures
(engine/prefill_graph.py): run eagerly on the CPU here (the same code the graph records), against
the ordinary prefill path, on fresh prompts and on the remainders of prefix-cache hits; on a GPU,
the captured graph against the same step run eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch

from deltaserve.engine.prefill_graph import PrefillGraphs, _bucket
from tests.engine.test_batching import capture, make_engine, prompts_of, rel, run_all


def padded(engine) -> PrefillGraphs:
    """The engine's runner takes single-chunk prefill steps through the padded step."""
    runner, cache = engine.runner, engine.cache
    runner.prefill_graphs = PrefillGraphs(runner.model, cache, cache.spare_slot,
                                          cache.spare_block, runner.greedy_head)
    return runner.prefill_graphs


def test_short_prompts_match_the_prefill_path(tiny_llm) -> None:
    """Fresh prompts of 2..63 tokens (one chunk, no snapshot position), one at a time: the padded
    step gives the same greedy tokens and logits within 1e-5 (another GEMM row count, attention as
    decode rows), and the decodes after it (which read the scattered state and conv window) too."""
    plain, graph = make_engine(tiny_llm, prefix_bytes=0), make_engine(tiny_llm, prefix_bytes=0)
    graphs = padded(graph)
    seen_plain, seen_graph = capture(plain), capture(graph)
    for rid, ids in prompts_of([2, 3, 5, 17, 40, 63], seed=11).items():
        assert run_all(graph, {rid: ids}) == run_all(plain, {rid: ids}), rid
        assert rel(torch.stack(seen_graph[rid]), torch.stack(seen_plain[rid])) <= 1e-5, rid
    assert graphs.num_runs == 6
    assert {key[0] for key in graphs.graphs} == {16, 32, 64}


def test_prefix_hit_remainders_match_a_miss(tiny_llm) -> None:
    """Questions behind a cached prefix: the hit restores the state at 64 / 128 / 192 and runs the
    remaining 3..40 tokens as one padded chunk; tokens equal the miss's, logits within 1e-5."""
    base = prompts_of([200], seed=3)["r0"]
    cold, warm = make_engine(tiny_llm, prefix_bytes=0), make_engine(tiny_llm, snapshots="grid")
    run_all(warm, {"seed": base})  # snapshots at 64, 128, 192
    graphs = padded(warm)
    seen_cold, seen_warm = capture(cold), capture(warm)
    cases = {"q1": base[:128] + [5, 6, 7] * 10, "q2": base[:64] + [9] * 40, "q3": base[:192] + [4, 8, 15]}
    for rid, ids in cases.items():
        hits = warm.cache.prefix.hits
        assert run_all(warm, {rid: ids}) == run_all(cold, {rid: ids}), rid
        assert warm.cache.prefix.hits == hits + 1
        assert rel(torch.stack(seen_warm[rid]), torch.stack(seen_cold[rid])) <= 1e-5, rid
    assert graphs.num_runs == 3


def test_what_takes_the_padded_step() -> None:
    from deltaserve.cache.batch import SeqChunk

    graphs = PrefillGraphs.__new__(PrefillGraphs)
    graphs.max_long_tokens, graphs.long_snapshots = 0, False  # short chunks only
    table = (1, 2, 3, 4)
    assert graphs.pieces(SeqChunk(0, 0, 40, table)) == [SeqChunk(0, 0, 40, table)]
    assert graphs.pieces(SeqChunk(0, 100, 128, table)) == [SeqChunk(0, 100, 128, table)]
    # cut at the snapshot positions (the last one may be the chunk's end)
    assert graphs.pieces(SeqChunk(0, 0, 100, table, snapshot_at=(64,))) == [
        SeqChunk(0, 0, 64, table), SeqChunk(0, 64, 36, table)]
    assert graphs.pieces(SeqChunk(0, 63, 65, table, snapshot_at=(64, 128))) == [
        SeqChunk(0, 63, 1, table), SeqChunk(0, 64, 64, table)]
    assert graphs.pieces(SeqChunk(0, 0, 1, table)) is None  # a decode
    assert graphs.pieces(SeqChunk(0, 0, 129, table)) is None  # over the largest bucket
    assert graphs.pieces(SeqChunk(0, 0, 320, table, snapshot_at=(64, 128, 192, 256))) is None
    assert graphs.pieces(SeqChunk(0, 0, 5, table, verify=True)) is None  # drafts: eager
    assert [_bucket(n) for n in (1, 16, 17, 64, 65, 128)] == [16, 16, 32, 64, 128, 128]


def test_what_takes_a_long_fresh_graph() -> None:
    """Past the short buckets: only a sequence's first piece (from position 0, up to its first
    snapshot position), up to the longest bucket the env allows; padded to the next LONG_BUCKETS
    size. A chunk cut into pieces replays only if every piece does."""
    from deltaserve.cache.batch import SeqChunk
    from deltaserve.engine.prefill_graph import _long_bucket

    graphs = PrefillGraphs.__new__(PrefillGraphs)
    graphs.max_long_tokens, graphs.long_snapshots = 4096, False
    table = tuple(range(300))
    assert graphs.pieces(SeqChunk(0, 0, 129, table)) == [SeqChunk(0, 0, 129, table)]
    assert graphs.pieces(SeqChunk(0, 0, 4096, table)) == [SeqChunk(0, 0, 4096, table)]
    assert graphs.pieces(SeqChunk(0, 0, 4097, table)) is None  # over the env's limit
    assert graphs.pieces(SeqChunk(0, 64, 300, table)) is None  # a later chunk: eager
    assert graphs.pieces(SeqChunk(0, 0, 300, table, snapshot_at=(64,))) is None  # [64,300) eager
    # the sparse policy's snapshots: the prompt's last grid position, at or before its end
    assert graphs.pieces(SeqChunk(0, 0, 4096, table, snapshot_at=(4096,))) == [
        SeqChunk(0, 0, 4096, table)]
    assert graphs.pieces(SeqChunk(0, 0, 300, table, snapshot_at=(256,))) == [
        SeqChunk(0, 0, 256, table), SeqChunk(0, 256, 44, table)]
    assert graphs.pieces(SeqChunk(0, 0, 300, table, snapshot_at=(64, 256))) is None
    assert graphs.pieces(SeqChunk(0, 0, 300, table, verify=True)) is None
    assert [_long_bucket(n, 8192) for n in (129, 256, 257, 1100, 5000, 8192, 8193)] == [
        256, 256, 512, 1536, 6144, 8192, None]
    graphs.long_snapshots = True  # DELTASERVE_PREFILL_GRAPH_SNAPSHOTS=1: snapshots kept inside
    with_snaps = SeqChunk(0, 0, 300, table, snapshot_at=(64, 128, 192, 256))
    assert graphs.pieces(with_snaps) == [with_snaps]
    assert graphs.key(with_snaps) == (512, 0, False, True)
    assert graphs.key(SeqChunk(0, 0, 300, table)) == (512, 0, False, False)


def test_memory_plan_counts_the_largest_long_graph() -> None:
    """The long graph a chunk budget reaches (its pool is held for good): the bucket over the
    budget, capped by DELTASERVE_PREFILL_GRAPH_TOKENS; none for short budgets or with 0."""
    from deltaserve.engine.prefill_graph import long_rows

    assert long_rows(2048, 16384) == 2048 and long_rows(5000, 16384) == 6144
    assert long_rows(32768, 16384) == 16384 and long_rows(32768, 10000) == 8192
    assert long_rows(128, 16384) == 0 and long_rows(8192, 0) == 0 and long_rows(8192, 100) == 0


def test_long_fresh_prompts_match_the_prefill_path(tiny_llm) -> None:
    """Fresh prompts of 150..700 tokens in one chunk, cache off: the padded step with attention
    over the chunk's own rows gives the greedy tokens of the ordinary path and logits within
    1e-5, and the decodes after it (reading the scattered state, window and K/V) too."""
    plain = make_engine(tiny_llm, prefix_bytes=0, budget=1024, num_blocks=128)
    graph = make_engine(tiny_llm, prefix_bytes=0, budget=1024, num_blocks=128)
    graphs = padded(graph)
    seen_plain, seen_graph = capture(plain), capture(graph)
    for rid, ids in prompts_of([150, 257, 700], seed=21).items():
        assert run_all(graph, {rid: ids}) == run_all(plain, {rid: ids}), rid
        assert rel(torch.stack(seen_graph[rid]), torch.stack(seen_plain[rid])) <= 1e-5, rid
    assert graphs.num_runs == 3
    assert set(graphs.graphs) == {(256, 0, False, False), (512, 0, False, False),
                                  (1024, 0, False, False)}


def test_long_prompts_with_snapshots_or_a_later_chunk_run_eagerly(tiny_llm) -> None:
    """A fresh 300-token prompt: with a snapshot every 64 tokens ("grid") it runs eagerly; with
    the default sparse snapshots (its last grid position, 256) as a long graph piece [0, 256) and a
    short one [256, 300), the snapshot the slot's state after the first, and the tokens a cold
    engine's. A prompt over the chunk budget: its first chunk replays, the later ones run eagerly."""
    warm = make_engine(tiny_llm, budget=1024, num_blocks=128, snapshots="grid")
    graphs = padded(warm)
    run_all(warm, prompts_of([300], seed=5))
    assert graphs.num_runs == 0
    sparse, plain = (make_engine(tiny_llm, budget=1024, num_blocks=128) for _ in range(2))
    graphs = padded(sparse)
    plain.runner.prefill_graphs = None
    ids = prompts_of([300], seed=5)
    assert run_all(sparse, ids) == run_all(plain, ids)
    assert graphs.num_runs == 2 and (256, 0, False, False) in graphs.graphs
    assert [e.length for e in sparse.cache.prefix.entries.values()] == [256]
    for ours, theirs in zip(*(next(iter(e.cache.prefix.entries.values())).states
                              for e in (sparse, plain)), strict=True):
        if theirs is not None:
            assert rel(ours[0], theirs[0]) <= 1e-5 and rel(ours[1], theirs[1]) <= 1e-5
    cold = make_engine(tiny_llm, prefix_bytes=0, budget=200, num_blocks=128)
    graphs, plain = padded(cold), make_engine(tiny_llm, prefix_bytes=0, budget=200, num_blocks=128)
    ids = prompts_of([576], seed=6)  # chunks of 192 (the 64-token grid): the first replays
    assert run_all(cold, ids) == run_all(plain, ids)
    assert graphs.num_runs == 1


def test_snapshot_positions_inside_a_chunk(tiny_llm) -> None:
    """Prompts whose chunk crosses the 64-token snapshot grid run as pieces cut there; the
    snapshots they store are the slot's state after each cut: a later hit on them gives the
    tokens and logits (within 1e-5) of a run without the cache."""
    base = prompts_of([120], seed=8)["r0"]
    cold, warm = make_engine(tiny_llm, prefix_bytes=0, budget=128), make_engine(tiny_llm, budget=128)
    graphs = padded(warm)
    seen_cold, seen_warm = capture(cold), capture(warm)
    cases = {"first": base[:100], "again": base[:64] + [3] * 20, "longer": base + [5, 6]}
    for rid, ids in cases.items():
        assert run_all(warm, {rid: ids}) == run_all(cold, {rid: ids}), rid
        assert rel(torch.stack(seen_warm[rid]), torch.stack(seen_cold[rid])) <= 1e-5, rid
    assert warm.cache.prefix.hits == 2  # "again" and "longer" resumed at 64
    assert graphs.num_runs == 2 + 1 + 1  # [0,64) + [64,100); then [64,84); then [64,122)


@pytest.mark.gpu
def test_captured_prefill_replays_the_padded_step(tiny_dir) -> None:
    """bf16 on CUDA: the engine captures graphs for short chunks and a long fresh one (fla's
    stages on padded rows, attention over the chunk's own rows); a replay gives the bits of the
    same padded step run eagerly, and the prefill logits are the eager engine's within bf16."""
    from deltaserve import LLM
    from deltaserve.ops import fla_scan

    llm = LLM(tiny_dir, dtype="bfloat16", device="cuda")
    fla_scan.tuned = None  # (LLM's own engine tuned already: the engines below must tune again)
    graph_engine, eager_engine = (make_engine(llm, prefix_bytes=0, budget=512, num_blocks=128)
                                  for _ in range(2))
    graphs = graph_engine.runner.prefill_graphs
    assert graphs is not None and graphs.capture
    assert fla_scan.tuned == 512  # the engine tuned fla's stages at its prefill chunk length
    eager_engine.runner.prefill_graphs = None
    seen_graph, seen_eager = capture(graph_engine), capture(eager_engine)
    prompts = prompts_of([7, 30, 60, 300], seed=4)
    for rid, ids in prompts.items():
        run_all(graph_engine, {rid: ids})
        run_all(eager_engine, {rid: ids})
        steps = min(len(seen_graph[rid]), len(seen_eager[rid]))
        errs = [rel(seen_graph[rid][i].float(), seen_eager[rid][i].float()) for i in range(steps)]
        print(f"{rid} ({len(ids)} tokens): graph vs eager logits rel per step "
              f"{' '.join(f'{e:.1e}' for e in errs)}")
        assert errs[0] <= 2e-2, rid  # the prefill step itself (later steps follow its tokens)
    assert graphs.num_runs == 4 and {k[0] for k in graphs.graphs} == {16, 32, 64, 512}
    # a replay equals the captured step run eagerly on the same static inputs, from the same state
    # (the spare slot, zeroed before each)
    states, spare = graph_engine.cache.states, graph_engine.cache.spare_slot

    def reset() -> None:
        for pool in (*states.conv, *states.recurrent):
            if pool is not None:
                pool[spare].zero_()

    for graph, static, out in graphs.graphs.values():
        static["slot"].fill_(spare)
        reset()
        graph.replay()
        replayed = out.clone()
        reset()
        assert torch.equal(replayed, graphs.forward(static))


def test_long_graph_keeps_the_prefix_snapshots(tiny_llm, monkeypatch) -> None:
    """DELTASERVE_PREFILL_GRAPH_SNAPSHOTS=1, prefix cache on: a fresh 300-token prompt replays one
    512-row graph that keeps every 64th position's state; the snapshots it stores are the eager
    path's (same positions, states and windows within 1e-5), and prompts that hit them later
    give the tokens of a cold engine."""
    from deltaserve.env import env

    monkeypatch.setenv("DELTASERVE_PREFILL_GRAPH_SNAPSHOTS", "1")
    env.cache_clear()
    try:
        plain = make_engine(tiny_llm, budget=1024, num_blocks=128, snapshots="grid")
        graph = make_engine(tiny_llm, budget=1024, num_blocks=128, snapshots="grid")
        graphs = padded(graph)
    finally:  # the knob only for these engines' graphs: later env() reads see it unset
        monkeypatch.delenv("DELTASERVE_PREFILL_GRAPH_SNAPSHOTS")
        env.cache_clear()
    assert graphs.long_snapshots
    base, other = prompts_of([300, 320], seed=12).values()  # 320: a snapshot at its very end
    for ids in (base, other):  # two replays of one 512-row graph and its shared buffer
        assert run_all(graph, {"p": ids}) == run_all(plain, {"p": ids})
    assert graphs.num_runs == 2 and set(graphs.graphs) == {(512, 0, False, True)}
    got, want = graph.cache.prefix.entries, plain.cache.prefix.entries
    assert sorted(e.length for e in got.values()) == sorted(e.length for e in want.values()) == [
        64, 64, 128, 128, 192, 192, 256, 256, 320]
    for key, entry in want.items():  # the first prompt's too: copies, not the reused buffer
        for ours, theirs in zip(got[key].states, entry.states, strict=True):
            if theirs is not None:
                assert rel(ours[0], theirs[0]) <= 1e-5 and rel(ours[1], theirs[1]) <= 1e-5
    cold = make_engine(tiny_llm, prefix_bytes=0, budget=1024, num_blocks=128)
    for rid, ids in {"hit192": base[:200] + [7, 8, 9], "hit256": base[:290] + [3] * 20}.items():
        hits = graph.cache.prefix.hits
        assert run_all(graph, {rid: ids}) == run_all(cold, {rid: ids}), rid
        assert graph.cache.prefix.hits == hits + 1


def test_a_graph_without_memory_to_capture_runs_eagerly(tiny_llm) -> None:
    """A capture that runs out of GPU memory (simulated: the CPU run pretends to capture) leaves
    nothing run: the chunk takes the ordinary path, with its tokens, a warning names the graph, and
    that bucket is not tried again."""
    plain = make_engine(tiny_llm, prefix_bytes=0, budget=1024, num_blocks=128)
    graph = make_engine(tiny_llm, prefix_bytes=0, budget=1024, num_blocks=128)
    graphs = padded(graph)
    attempts = []

    def no_memory(*key):
        attempts.append(key)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    graphs.capture, graphs._capture = True, no_memory
    (first, first_ids), (second, second_ids) = prompts_of([300, 310], seed=9).items()
    with pytest.warns(UserWarning, match="512-row prefill graph"):
        got = run_all(graph, {first: first_ids})
    assert got == run_all(plain, {first: first_ids})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # not tried (nor warned about) again
        got = run_all(graph, {second: second_ids})
    assert got == run_all(plain, {second: second_ids})
    assert attempts == [(512, 0, False, False)] and graphs.failed == {(512, 0, False, False)}
    assert graphs.num_runs == 0


@pytest.mark.gpu
def test_captured_long_graph_keeps_the_eager_snapshots(tiny_dir, monkeypatch) -> None:
    """bf16 on CUDA, prefix cache on with a snapshot every 64 tokens ("grid"),
    DELTASERVE_PREFILL_GRAPH_SNAPSHOTS=1: a fresh 300-token prompt replays a captured 512-row graph
    (fla's fp32 state pass on padded rows inside it); the snapshots it stores match the eager
    engine's (same positions, states within 1e-2)."""
    from deltaserve import LLM
    from deltaserve.env import env

    llm = LLM(tiny_dir, dtype="bfloat16", device="cuda")
    monkeypatch.setenv("DELTASERVE_PREFILL_GRAPH_SNAPSHOTS", "1")
    env.cache_clear()
    try:
        graph_engine, eager_engine = (make_engine(llm, budget=512, num_blocks=128,
                                                  snapshots="grid") for _ in range(2))
    finally:
        monkeypatch.delenv("DELTASERVE_PREFILL_GRAPH_SNAPSHOTS")
        env.cache_clear()
    graphs = graph_engine.runner.prefill_graphs
    assert graphs is not None and graphs.capture and graphs.long_snapshots
    eager_engine.runner.prefill_graphs = None
    base = prompts_of([300], seed=13)["r0"]
    run_all(graph_engine, {"seed": base})
    run_all(eager_engine, {"seed": base})
    assert graphs.num_runs == 1 and set(graphs.graphs) == {(512, 0, False, True)}
    got, want = graph_engine.cache.prefix.entries, eager_engine.cache.prefix.entries
    assert sorted(e.length for e in got.values()) == sorted(e.length for e in want.values())
    errs = []
    for key, entry in want.items():
        for ours, theirs in zip(got[key].states, entry.states, strict=True):
            if theirs is not None:
                errs.append(max(rel(ours[0].float(), theirs[0].float()),
                                rel(ours[1], theirs[1])))
    print(f"graph vs eager snapshots: max rel {max(errs):.2e}")
    assert max(errs) <= 1e-2
