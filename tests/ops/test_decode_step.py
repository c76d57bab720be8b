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
from deltaserve.engine.executors import NativeDecode
from deltaserve.env import env
from deltaserve.ops import decode_step
from deltaserve.ops.native import native_lib, simd_lanes
from deltaserve.ops.qgemv import QGEMM_MAX_ROWS
from deltaserve.quant.convert import quantize_checkpoint

pytestmark = pytest.mark.skipif(native_lib() is None, reason="no C compiler for the CPU kernels")

BLOCK_LEN = 4  # small blocks: the decode tokens below cross block edges
BLOCKS_PER_SEQ = 8


def pools(lm, num_seqs: int = 1) -> tuple[StatePool, KVPool]:
    states = StatePool(lm.cfg, num_seqs + 1, torch.float32, torch.device("cpu"))
    for t in (*states.conv, *states.recurrent):
        if t is not None:
            t.normal_()  # slot 0 holds garbage: a plan reading the wrong slot shows
    kv = KVPool(lm.cfg, PoolSizes(num_seqs + 1, BLOCKS_PER_SEQ * num_seqs, BLOCK_LEN),
                torch.float32, torch.device("cpu"))
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


def table(seq: int, num_seqs: int) -> tuple[int, ...]:
    """Sequence seq's KV blocks, interleaved with the others' (seq, seq + n, ...)."""
    return tuple(seq + num_seqs * j for j in range(BLOCKS_PER_SEQ))


def forward(lm, ids: torch.Tensor, batch: StepBatch, native: bool, monkeypatch) -> torch.Tensor:
    """The step as the runner runs it (batch.native_rows without prefill chunks; the native
    executor, else the layers), asserting whether the one native call ran."""
    calls = []
    run = decode_step.DecodePlan.run
    monkeypatch.setattr(decode_step.DecodePlan, "run",
                        lambda plan, *args: calls.append(1) or run(plan, *args))
    batch.native_rows = not batch.prefill
    out = NativeDecode(lm, False, False).forward(ids, batch)  # a fresh plan for every step
    logits = lm.forward_batch(ids, batch) if out is None else out[0]
    monkeypatch.setattr(decode_step.DecodePlan, "run", run)
    assert len(calls) == int(native), f"the native call ran {len(calls)} times"
    return logits


def step(lm, states, kv, seqs: list[tuple[list[int], int]], fused: bool, monkeypatch,
         native: bool | None = None) -> torch.Tensor:
    """One forward_batch: sequence i (pool slot i + 1) feeds ids at positions [start, ...);
    `native`: whether the native call must run (default: `fused`)."""
    monkeypatch.setenv("DELTASERVE_FUSED_DECODE", "1" if fused else "0")
    env.cache_clear()
    chunks = [SeqChunk(i + 1, start, len(ids), table(i, len(seqs)))
              for i, (ids, start) in enumerate(seqs)]
    batch = StepBatch.build(chunks, states, kv, "cpu")
    ids = torch.tensor([t for ids, _ in seqs for t in ids])
    return forward(lm, ids, batch, fused if native is None else native, monkeypatch)


def assert_native_equals_layered(lm, monkeypatch, num_seqs: int = 1, num_decode: int = 7) -> None:
    """Sequences with prompts of 6, 9, 4, ... tokens decode num_decode tokens together: their
    positions differ, and each crosses block edges at its own step."""
    states, kv = pools(lm, num_seqs)
    prompts = [[(17 * i + 5 * s + 5) % lm.cfg.vocab_size for i in range(6 + (3 * s) % 7)]
               for s in range(num_seqs)]
    for s, prompt in enumerate(prompts):  # prefill one at a time: slot s + 1, its own blocks
        chunk = SeqChunk(s + 1, 0, len(prompt), table(s, num_seqs))
        batch = StepBatch.build([chunk], states, kv, "cpu")
        lm.forward_batch(torch.tensor(prompt), batch)
    other = clone(states, kv)
    tokens, starts = [p[-1] for p in prompts], [len(p) for p in prompts]
    for _ in range(num_decode):
        seqs = [([t], pos) for t, pos in zip(tokens, starts, strict=True)]
        fused = step(lm, states, kv, seqs, True, monkeypatch)
        layered = step(lm, *other, seqs, False, monkeypatch)
        assert torch.equal(fused, layered)
        tokens, starts = layered.argmax(-1).tolist(), [p + 1 for p in starts]
    for a, b in zip((*states.conv, *states.recurrent), (*other[0].conv, *other[0].recurrent),
                    strict=True):
        if a is not None:
            assert torch.equal(a, b)  # the other slot (garbage) untouched too
    for a, b in zip((*kv.k, *kv.v), (*other[1].k, *other[1].v), strict=True):
        if a is not None:
            assert torch.equal(a, b)  # and the blocks no sequence owns


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_bf16_weights_match_the_layered_path(tiny_dir, num_seqs, monkeypatch) -> None:
    assert_native_equals_layered(LLM(tiny_dir, dtype="bfloat16").model, monkeypatch, num_seqs)


@pytest.fixture(scope="module", params=["int8", "int4", "q1"])
def quantized_dir(request, tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp(request.param) / "q"
    quantize_checkpoint(tiny_dir, request.param, out)
    return out


@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("exact_int8", ["0", "1"])
def test_quantized_weights_match_the_layered_path(quantized_dir, exact_int8, num_seqs,
                                                  monkeypatch) -> None:
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", exact_int8)  # int8, int4: VNNI and fp32 kernels
    env.cache_clear()
    assert_native_equals_layered(LLM(quantized_dir, dtype="float32").model, monkeypatch,
                                 num_seqs)


def prefilled(lm, num_seqs: int):
    """Pools where sequence s (slot s + 1, its own blocks) holds a prompt of 5 + 2s tokens."""
    states, kv = pools(lm, num_seqs)
    lengths = [5 + 2 * s for s in range(num_seqs)]
    for s, length in enumerate(lengths):
        prompt = [(13 * i + 7 * s + 3) % lm.cfg.vocab_size for i in range(length)]
        batch = StepBatch.build([SeqChunk(s + 1, 0, length, table(s, num_seqs))], states, kv,
                                "cpu")
        lm.forward_batch(torch.tensor(prompt), batch)
    return states, kv, lengths


def verify_step(lm, states, kv, chunks, ids, strategy, fused: bool, monkeypatch):
    from deltaserve.spec.rollback import VerifyRecord

    monkeypatch.setenv("DELTASERVE_FUSED_DECODE", "1" if fused else "0")
    env.cache_clear()
    batch = StepBatch.build(chunks, states, kv, "cpu")
    batch.spec = VerifyRecord(batch, strategy)
    return forward(lm, torch.tensor(ids), batch, fused, monkeypatch), batch.spec


def assert_pools_equal(a, b) -> None:
    for x, y in zip((*a[0].conv, *a[0].recurrent, *a[1].k, *a[1].v),
                    (*b[0].conv, *b[0].recurrent, *b[1].k, *b[1].v), strict=True):
        if x is not None:
            assert torch.equal(x, y)


@pytest.mark.parametrize("strategy", ["recompute", "keep"])
def test_verify_steps_match_the_layered_path(tiny_dir, strategy, monkeypatch) -> None:
    """A step of one decode row and two verify chunks (4 and 3 tokens: the pending token and its
    drafts) natively and layer by layer: the same logits, states and K/V, and after a rollback
    (to 2 and 1 accepted tokens) the same states again."""
    lm = LLM(tiny_dir, dtype="bfloat16").model
    states, kv, lengths = prefilled(lm, 3)
    other = clone(states, kv)
    sizes = [1, 4, 3]
    chunks = [SeqChunk(s + 1, lengths[s], n, table(s, 3), verify=n > 1)
              for s, n in enumerate(sizes)]
    ids = [(31 * i + 11) % lm.cfg.vocab_size for i in range(sum(sizes))]
    fused, record = verify_step(lm, states, kv, chunks, ids, strategy, True, monkeypatch)
    layered, record2 = verify_step(lm, *other, chunks, ids, strategy, False, monkeypatch)
    assert torch.equal(fused, layered)
    assert_pools_equal((states, kv), other)
    record.rollback({1: 2, 2: 1})
    record2.rollback({1: 2, 2: 1})
    assert_pools_equal((states, kv), other)


def test_the_plan_declines_what_it_cannot_run(tiny_dir) -> None:
    lm = LLM(tiny_dir, dtype="bfloat16").model
    states, kv = pools(lm)
    assert decode_step.build_plan(lm, states, kv) is not None
    kv16 = KVPool(lm.cfg, PoolSizes(2, 8, BLOCK_LEN), torch.float16, torch.device("cpu"))
    assert decode_step.build_plan(lm, states, kv16) is None  # a 16-bit KV cache
    for dtype in ("float16", "float32"):  # no native GEMV / the layered path's F.linear
        other = LLM(tiny_dir, dtype=dtype).model
        assert decode_step.build_plan(other, *pools(other)) is None


def test_steps_above_the_plans_rows_take_the_layered_path(quantized_dir, monkeypatch) -> None:
    """Above max_rows the layered path dequantizes for torch's GEMM, which the plan does not run:
    such a step must not reach the plan (which refuses it too). The multi-row kernels (int8,
    int4) take 32 rows where the build has vector paths, q1 (a GEMV per row) and every format on
    the scalar build (ops/qgemv.qgemm_max_rows) 16."""
    lm = LLM(quantized_dir, dtype="float32").model
    plan = decode_step.build_plan(lm, *pools(lm))
    multi_kinds = (decode_step.Q8, decode_step.Q8_VNNI, decode_step.A4, decode_step.A4_VNNI)
    multi = all(getattr(spec, name).kind in multi_kinds
                for spec in plan.layers for name in ("mix_in", "mix_out", "gate_up", "down"))
    assert plan.max_rows == (QGEMM_MAX_ROWS if multi and simd_lanes() else 16)
    for num_seqs in (plan.max_rows, plan.max_rows + 1):
        states, kv = pools(lm, num_seqs)
        step(lm, states, kv, [([3], 0)] * num_seqs, True, monkeypatch,
             native=num_seqs <= plan.max_rows)
    with pytest.raises(ValueError, match="rows"):
        x = torch.zeros(plan.max_rows + 1, lm.cfg.hidden_size)
        zeros = torch.zeros(plan.max_rows + 1, dtype=torch.long)
        plan.run(x, zeros, zeros, zeros[:, None], x[:, :2], x[:, :2])


def test_the_plan_needs_the_runners_native_rows(tiny_dir, monkeypatch) -> None:
    """Without batch.native_rows the layered path runs torch's norms and silu for decode rows, and
    a verify chunk without its rollback record cannot run natively: both go layered."""
    lm = LLM(tiny_dir, dtype="bfloat16").model
    states, kv = pools(lm, 2)
    chunks = [SeqChunk(s + 1, 0, 1, table(s, 2)) for s in range(2)]
    batch = StepBatch.build(chunks, states, kv, "cpu")
    native = NativeDecode(lm, False, False)
    assert native.plan_for(batch) is None
    batch.native_rows = True
    assert native.plan_for(batch) is not None
    verify = StepBatch.build([SeqChunk(1, 0, 3, table(0, 2), verify=True)], states, kv, "cpu")
    verify.native_rows = True
    assert native.plan_for(verify) is None  # no batch.spec


def test_generation_is_unchanged_by_the_native_step(tiny_dir, monkeypatch) -> None:
    from deltaserve import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[3, 14, 15, 92, 65], [2, 71, 82], [1, 41, 42, 13, 56, 23, 73]]
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("DELTASERVE_FUSED_DECODE", flag)
        llm = LLM(tiny_dir, dtype="bfloat16")
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def gguf_q4_k_m(tmp_path_factory):
    """A Q4_K_M mix (llama-quantize's: attn_v and ffn_down Q6_K, the rest Q4_K; tied head
    Q4_K) on a model whose rows fill K-quant blocks and Hv = Hk (no reordered columns): the
    attention's packed q|k|v runs as parts, every matrix on GGUF blocks."""
    from deltaserve.quant.gguf_import import import_gguf
    from tests.conftest import write_variant
    from tests.quant.test_gguf_import import Q, write_gguf

    root = tmp_path_factory.mktemp("q4km")
    src = write_variant(root / "hf", 2, hidden_size=256, intermediate_size=512, vocab_size=1024,
                        linear_value_head_dim=128, linear_key_head_dim=64,
                        linear_num_value_heads=2)
    mix = lambda name: Q.Q6_K if name.endswith(("attn_v.weight", "ffn_down.weight")) else Q.Q4_K  # noqa: E731
    write_gguf(src, root / "m.gguf", mix, Q.Q4_K)
    import_gguf(root / "m.gguf", root / "imported", tokenizer_dir=src)
    return root / "imported"


@pytest.mark.parametrize("num_seqs", [1, 3])
@pytest.mark.parametrize("exact_int8", ["0", "1"])
def test_gguf_blocks_and_parts_match_the_layered_path(gguf_q4_k_m, exact_int8, num_seqs,
                                                      monkeypatch) -> None:
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", exact_int8)  # the VNNI or exact block kernels
    env.cache_clear()
    lm = LLM(gguf_q4_k_m, dtype="float32").model
    attn = lm.model.layers[3].self_attn
    assert [p.scheme.kind for p in attn.qkv_proj.segments] == ["q4_k", "q4_k", "q6_k"]
    assert lm.model.layers[0].mlp.down_proj.scheme.kind == "q6_k"
    assert_native_equals_layered(lm, monkeypatch, num_seqs)
