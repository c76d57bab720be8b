"""After a rejected draft the request's state is bit-identical to a run that never drafted: every
GDN layer's conv window and recurrent matrix and every KV row of its blocks (torch.equal).

bf16 weights on CPU: the path spec/rollback.py builds to be bit-exact (row-exact GEMV/GEMM, native
norm, the same GDN decode kernel per token, masked SDPA per row)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.spec.config import SpeculativeConfig
from tests.engine.test_batching import run_all
from tests.spec.conftest import greedy, make_engine


def state_of(engine, rid: str):
    """(num_computed, per GDN layer (conv, state) copies, per attention layer its blocks' K, V)."""
    req = engine.scheduler.get(rid)
    cache = engine.cache
    table = list(cache.block_table(rid))
    gdn = [s for s in cache.states.snapshot(cache.slot_of(rid)) if s is not None]
    kv = [(k[table].clone(), v[table].clone()) for k, v in zip(cache.kv.k, cache.kv.v, strict=True)
          if k is not None]
    return req.num_computed, gdn, kv


def record_states(engine, rid: str, into: dict) -> callable:
    def after_step(eng) -> None:
        if eng.live(rid) is not None:
            n, gdn, kv = state_of(eng, rid)
            into[n] = (gdn, kv)
    return after_step


def scripted_drafts(engine, rid: str, reference: list[int], vocab: int):
    """Drafts by output position g: g % 3 == 0 all right, 1 the first wrong, 2 one right then
    wrong, so steps accept all, none, or some."""
    def propose(_rid: str, num: int) -> list[int]:
        g = len(engine.scheduler.get(rid).output_ids)
        right = reference[g : g + num]
        wrong_at = {0: num, 1: 0, 2: 1}[g % 3]
        return [t if j < wrong_at else (t + 1) % vocab for j, t in enumerate(right)]
    return propose


@pytest.mark.parametrize("rollback", ["keep", "recompute"])
def test_state_after_rejection_is_bit_identical(tiny_bf16_llm, rollback) -> None:
    llm = tiny_bf16_llm
    g = torch.Generator().manual_seed(1)
    prompt = {"r": torch.randint(1, 1000, (37,), generator=g).tolist()}
    params = greedy(40)
    plain, want = make_engine(llm), {}
    reference = run_all(plain, prompt, params, after_step=record_states(plain, "r", want))["r"]
    spec_engine = make_engine(llm, SpeculativeConfig(num_speculative_tokens=3, adaptive=False,
                                                     rollback=rollback))
    spec_engine.spec._propose = scripted_drafts(spec_engine, "r", reference, llm.config.vocab_size)
    got: dict = {}
    tokens = run_all(spec_engine, prompt, params,
                     after_step=record_states(spec_engine, "r", got))["r"]
    assert tokens == reference
    stats = spec_engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes happened
    assert len(got) >= 8
    for n, (gdn, kv) in got.items():
        want_gdn, want_kv = want[n]
        for (c, s), (wc, ws) in zip(gdn, want_gdn, strict=True):
            assert torch.equal(c, wc) and torch.equal(s, ws), n
        for (k, v), (wk, wv) in zip(kv, want_kv, strict=True):
            assert torch.equal(k, wk) and torch.equal(v, wv), n


def test_rejected_draft_blocks_go_back(tiny_bf16_llm) -> None:
    """Drafts that cross into a new KV block take it; a rejection returns it to the pool."""
    llm = tiny_bf16_llm
    engine = make_engine(llm, SpeculativeConfig(num_speculative_tokens=4, adaptive=False))
    engine.spec._propose = lambda rid, num: [1] * num  # wrong (almost surely) every time
    prompt = list(range(3, 3 + 14))  # 14 tokens: the first verify spans positions 14..18
    engine.add_request("r", prompt, greedy(8))
    free0 = engine.cache.kv.num_free
    engine.step()  # prefill: one block
    engine.step()  # verify: a second block for positions 16..18, returned on rejection
    req = engine.scheduler.get("r")
    held = len(engine.cache.block_table("r"))
    assert held == -(-req.num_computed // 16)
    assert engine.cache.kv.num_free == free0 - held
