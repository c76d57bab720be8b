"""Tensor parallelism on CPU: 2 gloo processes against one, on the same synthetic checkpoints.

TP=2 must give the TP=1 logits (fp32 rel-L2 <= 1e-5) and greedy tokens on both paths (single
sequence: batch-2 prefill then decode; engine: three prompts, chunked prefill mixed with decodes),
with the full and the greedy-only head, dense and int4; the shards must reassemble into the
checkpoint; a model that does not split says so before starting anything.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deltaserve.checkpoint.loader import load_text_model
from deltaserve.checkpoint.reader import TensorIndex
from deltaserve.distributed.group import TPGroup
from deltaserve.distributed.launch import spawn
from deltaserve.env import env
from deltaserve.errors import CheckpointError, ConfigError
from deltaserve.validate.compare import rel_l2
from tests.distributed.tp_cases import (
    assert_cli_generate_equals_one_process,
    reference,
    tp_worker,
    write_08b_shape,
)
from tests.isa import needs_int4_act

TOLERANCE = 1e-5


def run_tp2(cases: list[tuple[str, bool]], tmp_path) -> list[dict]:
    out = tmp_path / "tp2.pt"
    spawn(tp_worker, 2, cases, 2, str(out))
    return torch.load(out)


def assert_same(got: dict, ref: dict) -> None:
    assert got["tokens"] == ref["tokens"]
    if "single" in ref:  # the single-sequence path: [2, 40, V] prefill then decode
        assert rel_l2(got["single"], ref["single"]) <= TOLERANCE
    assert len(got["engine"]) == len(ref["engine"]) > 3  # the same schedule, step by step
    for a, b in zip(got["engine"], ref["engine"], strict=True):
        if b.dtype == torch.int64:  # the greedy head's tokens
            assert torch.equal(a, b)
        else:
            assert rel_l2(a, b) <= TOLERANCE


@pytest.fixture(scope="module")
def int4_dir(tiny_dir, tmp_path_factory):
    from deltaserve.quant.convert import quantize_checkpoint

    out = tmp_path_factory.mktemp("tiny-int4") / "q"
    quantize_checkpoint(tiny_dir, "int4", out)
    return out


def assert_tp2_equals_tp1_exact(cases: list[tuple[str, bool]], tmp_path, monkeypatch) -> list:
    """The cases at TP=2 and TP=1 on the exact kernels (fp32 activations, where TP only reorders
    fp32 sums): the same logits and tokens. Returns the TP=2 results."""
    monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")  # inherited by the spawned ranks
    env.cache_clear()
    try:
        got, ref = run_tp2(cases, tmp_path), reference(cases)
    finally:
        env.cache_clear()
    for g, r in zip(got, ref, strict=True):
        assert_same(g, r)
    return got


def test_tp2_equals_tp1_on_tiny(tiny_dir, int4_dir, tmp_path, monkeypatch) -> None:
    """Dense (full head, greedy-only head) and int4 (its row-parallel codes split by groups), on
    the exact kernels (fp32 activations), where TP only reorders fp32 sums."""
    cases = [(str(tiny_dir), False), (str(tiny_dir), True), (str(int4_dir), False)]
    got = assert_tp2_equals_tp1_exact(cases, tmp_path, monkeypatch)
    assert got[0]["counters"]["ffn"]["calls"] > 0  # the reductions really ran
    assert got[0]["tokens"] == got[1]["tokens"]  # greedy head == argmax of the gathered logits


@needs_int4_act
def test_tp2_on_int8_activations_stays_within_their_rounding(int4_dir, tmp_path,
                                                           monkeypatch) -> None:
    """int4 on the VNNI kernels (x rounded per group to int8, ops/qgemv.py). Each rank's shard
    gets the whole row's per-group integers (tests/ops/test_qgemv_a4_vnni.py: a row in halves),
    but rounding is not continuous: TP's reordered sums (~1e-7) can flip one activation code, and
    the difference grows through the layers. Measured on this random tiny model: at most 1.9e-2
    logits rel-L2 per row, the same tokens; a wrong shard gives ~1."""
    monkeypatch.delenv("DELTASERVE_EXACT_INT8_ACT", raising=False)
    env.cache_clear()
    cases = [(str(int4_dir), False)]
    try:
        got, ref = run_tp2(cases, tmp_path)[0], reference(cases)[0]
    finally:
        env.cache_clear()
    assert rel_l2(got["single"], ref["single"]) <= 5e-2
    assert len(got["engine"]) == len(ref["engine"]) > 3
    for a, b in zip(got["engine"], ref["engine"], strict=True):
        assert rel_l2(a, b) <= 5e-2


def test_tp2_equals_tp1_on_08b_shape(tmp_path) -> None:
    """Every Qwen3.5-0.8B tensor shape (4 of its 24 layers; all 24 measured 7.8e-6 by hand)."""
    model_dir = write_08b_shape(tmp_path / "q08")
    cases = [(str(model_dir), False)]
    got, ref = run_tp2(cases, tmp_path), reference(cases)
    assert_same(got[0], ref[0])


def test_shards_reassemble_into_the_checkpoint(tiny_dir) -> None:
    """Rank 0's and rank 1's parts (built in this process: loading needs no process group) put
    back together along each tensor's split axis give every checkpoint tensor."""
    from deltaserve.checkpoint.loader import checkpoint_targets
    from deltaserve.distributed.shard import COLUMN, PER_V_HEAD, QKV_BLOCKS, ROW

    shards = [checkpoint_targets(load_text_model(tiny_dir, "float32", "cpu",
                                                 TPGroup(r, 2, r, "gloo"))[0]) for r in (0, 1)]
    full, cfg, _ = load_text_model(tiny_dir, "float32", "cpu")
    assert shards[0]["model.embed_tokens.weight"].shape[0] == cfg.vocab_size // 2
    for name, whole in checkpoint_targets(full).items():
        a, b = shards[0][name], shards[1][name]
        parts = name.split(".")
        if parts[-2] in ROW:
            assert torch.equal(torch.cat([a, b], dim=1), whole), name
        elif parts[-2] in QKV_BLOCKS:
            sizes = [cfg.linear_key_dim // 2] * 2 + [cfg.linear_value_dim // 2]
            pieces = [torch.cat(p) for p in zip(a.split(sizes), b.split(sizes), strict=True)]
            assert torch.equal(torch.cat(pieces), whole), name
        elif parts[-2] in (*COLUMN, "embed_tokens") or parts[-1] in PER_V_HEAD:
            assert torch.equal(torch.cat([a, b]), whole), name
        else:  # norms: replicated
            assert torch.equal(a, whole) and torch.equal(b, whole), name


def test_heads_that_do_not_divide_are_refused_before_any_process(tiny_dir) -> None:
    with pytest.raises(ConfigError, match="num_attention_heads = 4"):
        load_text_model(tiny_dir, "float32", "cpu", TPGroup(0, 3, 0, "gloo"))
    proc = subprocess.run([sys.executable, "-m", "deltaserve", "generate", "--model",
                           str(tiny_dir), "--tp", "3", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "needs every head count to divide by 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_quant_groups_that_do_not_split_are_refused(tiny_dir, tmp_path) -> None:
    """q1 groups of 128 inputs: the GDN out_proj has 128, 64 per rank (not whole groups)."""
    from deltaserve.quant.convert import quantize_checkpoint

    quantize_checkpoint(tiny_dir, "q1", tmp_path / "q1")
    assert "model.layers.0.linear_attn.out_proj.scales" in TensorIndex.scan(tmp_path / "q1").locations
    with pytest.raises(CheckpointError, match="whole groups"):
        load_text_model(tmp_path / "q1", "float32", "cpu", TPGroup(0, 2, 0, "gloo"))


def test_cli_generate_tp2_on_cpu_equals_tp1(tiny_dir, tiny_llm) -> None:
    """`deltaserve generate --tp 2 --device cpu` equals one process."""
    assert_cli_generate_equals_one_process(tiny_dir, tiny_llm, "--tp")
