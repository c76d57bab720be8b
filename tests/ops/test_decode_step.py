"""The native decode step (ops/decode_step.py) against the layered path it replaces.

Both run the same model over copies of the same pools: a prompt is prefilled layer by layer, then
several decode tokens go through the one-call native step on one copy and through the layered
Python path on the other. Logits and every pool (conv windows, GDN states, K/V) must be the same
bits (the layered path runs the same kernels for decode rows: GEMVs, norms, GDN step, attention,
silu), per weight format, across KV block edges, at a pool slot other than 0. Bits, not a
tolerance: int8 with int8 activations (VNNI) rounds x per group, so a 1-ulp difference upstream
flips codes and grows to a ~3% logits difference over 24 random layers.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM
from deltaserve.cache.batch import SeqChunk, StepBatch
from deltaserve.cache.pools import KVPool, PoolSizes, StatePool
from deltaserve.env import env
from deltaserve.ops import decode_step
from deltaserve.ops.native import native_lib
from deltaserve.ops.norm import native_rows
from deltaserve.quant.convert import quantize_checkpoint

pytestmark = pytest.mark.skipif(native_lib() is None, reason="no C compiler for the CPU kernels")

BLOCK_LEN = 4  # small blocks: the decode tokens below cross a block edge
SLOT = 1


def pools(lm) -> tuple[StatePool, KVPool]:
    states = StatePool(lm.cfg, 2, torch.float32, torch.device("cpu"))
    for t in (*states.conv, *states.recurrent):
        if t is not None:
            t.normal_()  # slot 0 holds garbage: a plan reading the wrong slot shows
    kv = KVPool(lm.cfg, PoolSizes(2, 8, BLOCK_LEN), torch.float32, torch.device("cpu"))
    for t in (*kv.k, *kv.v):
        if t is not None:
            t.normal_()
    return states, kv


def clone(states: StatePool, kv: KVPool) -> tuple[StatePool, KVPool]:
    copy = lambda ts: [None if t is None else t.clone() for t in ts]  # noqa: E731
    s2, kv2 = object.__new__(StatePool), object.__new__(KVPool)
    s2.__dict__.update(states.__dict__, conv=copy(states.conv), recurrent=copy(states.recurrent))
    kv2.__dict__.update(kv.__dict__, k=copy(kv.k), v=copy(kv.v))
    return s2, kv2


def step(lm, states, kv, ids: list[int], start: int, fused: bool, monkeypatch) -> torch.Tensor:
    """One forward_batch of `ids` at positions [start, ...) of the sequence in SLOT."""
    monkeypatch.setenv("DELTASERVE_FUSED_DECODE", "1" if fused else "0")
    env.cache_clear()
    lm._plan = None
    table = tuple(range(8))
    batch = StepBatch.build([SeqChunk(SLOT, start, len(ids), table)], states, kv, "cpu")
    with native_rows(not batch.prefill):
        logits = lm.forward_batch(torch.tensor(ids), batch)
    if len(ids) == 1:
        assert (lm._plan[1] is not None) == fused, "the native plan was (not) used as asked"
    return logits


def assert_native_equals_layered(lm, monkeypatch, num_decode: int = 7) -> None:
    states, kv = pools(lm)
    prompt = [(17 * i + 5) % lm.cfg.vocab_size for i in range(6)]
    step(lm, states, kv, prompt, 0, False, monkeypatch)
    other = clone(states, kv)
    token, pos = prompt[-1], len(prompt)
    for _ in range(num_decode):  # positions 6..12: across the block edges at 8 and 12
        fused = step(lm, states, kv, [token], pos, True, monkeypatch)
        layered = step(lm, *other, [token], pos, False, monkeypatch)
        assert torch.equal(fused, layered)
        token, pos = int(layered.argmax()), pos + 1
    for a, b in zip((*states.conv, *states.recurrent), (*other[0].conv, *other[0].recurrent),
                    strict=True):
        if a is not None:
            assert torch.equal(a, b)  # the other slot (garbage) untouched too
    for a, b in zip((*kv.k, *kv.v), (*other[1].k, *other[1].v), strict=True):
        if a is not None:
            assert torch.equal(a, b)  # and the blocks the sequence does not own


def test_bf16_weights_match_the_layered_path(tiny_dir, monkeypatch) -> None:
    assert_native_equals_layered(LLM(tiny_dir, dtype="bfloat16").model, monkeypatch)


@pytest.fixture(scope="module", params=["int8", "int4", "q1"])
def quantized_dir(request, tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp(request.param) / "q"
    quantize_checkpoint(tiny_dir, request.param, out)
    return out


@pytest.mark.parametrize("exact_int8", ["0", "1"])
def test_quantized_weights_match_the_layered_path(quantized_dir, exact_int8, monkeypatch) -> None:
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", exact_int8)  # int8: VNNI and fp32 kernels
    env.cache_clear()
    assert_native_equals_layered(LLM(quantized_dir, dtype="float32").model, monkeypatch)


def test_the_plan_declines_what_it_cannot_run(tiny_dir) -> None:
    lm = LLM(tiny_dir, dtype="bfloat16").model
    states, kv = pools(lm)
    assert decode_step.build_plan(lm, states, kv) is not None
    kv16 = KVPool(lm.cfg, PoolSizes(2, 8, BLOCK_LEN), torch.float16, torch.device("cpu"))
    assert decode_step.build_plan(lm, states, kv16) is None  # a 16-bit KV cache
    for dtype in ("float16", "float32"):  # no native GEMV / the layered path's F.linear
        other = LLM(tiny_dir, dtype=dtype).model
        assert decode_step.build_plan(other, *pools(other)) is None


def test_generation_is_unchanged_by_the_native_step(tiny_dir, monkeypatch) -> None:
    from deltaserve import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DELTASERVE_FUSED_DECODE", flag)
        llm = LLM(tiny_dir, dtype="bfloat16")
        outs.append(llm.generate([[3, 14, 15, 92, 65]], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]
