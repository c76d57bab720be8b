"""The Qwen3.5 model against transformers on the same synthetic checkpoint, and its invariants."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM
from deltaserve.cache.sequence import Sequence, prompt_logits
from deltaserve.env import env
from deltaserve.validate.compare import compare, rel_l2
from deltaserve.validate.reference import load_reference
from tests.conftest import write_variant


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_and_greedy_match_transformers(tiny_llm, tiny_reference) -> None:
    result = compare(tiny_llm, tiny_reference, prompt_ids(80), num_tokens=32)
    assert result.logits_rel_l2 <= 1e-5
    assert result.ours_tokens == result.reference_tokens
    assert result.first_divergence is None


@pytest.mark.parametrize(
    "overrides",
    [
        {"linear_num_key_heads": 4, "linear_num_value_heads": 4},
        {"tie_word_embeddings": False},
        {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32},
    ],
    ids=["v-heads-equal-k-heads", "untied-head", "no-gqa-head-dim-32"],
)
def test_config_variants_match_transformers(tmp_path, overrides) -> None:
    model_dir = write_variant(tmp_path / "ckpt", seed=5, **overrides)
    llm = LLM(model_dir, dtype="float32")
    result = compare(llm, load_reference(model_dir), prompt_ids(70, seed=1), num_tokens=16)
    assert result.logits_rel_l2 <= 1e-5
    assert result.ours_tokens == result.reference_tokens


def test_prefill_then_decode_equals_one_forward(tiny_llm) -> None:
    ids = torch.tensor([prompt_ids(90, seed=2)])
    model = tiny_llm.model
    full = prompt_logits(model, ids)[None]
    seq = Sequence(model, 90)
    pieces = [seq.forward(ids[:, :70], all_logits=True)]  # chunked prefill: 70 = 64 + 6
    pieces += [seq.forward(ids[:, t : t + 1], all_logits=True) for t in range(70, 90)]
    assert rel_l2(torch.cat(pieces)[None], full) <= 1e-5


def test_uneven_prefill_chunks_equal_one_forward(tiny_llm) -> None:
    ids = torch.tensor([prompt_ids(150, seed=3)])
    model = tiny_llm.model
    full = prompt_logits(model, ids)[None]
    seq = Sequence(model, 150)
    bounds = [0, 1, 50, 64, 129, 150]
    pieces = [seq.forward(ids[:, a:b], all_logits=True)
              for a, b in zip(bounds, bounds[1:], strict=False)]
    assert rel_l2(torch.cat(pieces)[None], full) <= 1e-5


def test_bf16_decode_stays_close_to_fp32_over_512_steps(tiny_dir, tiny_llm) -> None:
    """Long horizon: bf16 weights, fp32 recurrent state, 512 teacher-forced decode steps."""
    bf16 = LLM(tiny_dir, dtype="bfloat16").model
    fp32 = tiny_llm.model
    ids = prompt_ids(16 + 512, seed=6)
    s16, s32 = Sequence(bf16, len(ids)), Sequence(fp32, len(ids))
    s16.forward(ids[:16])
    s32.forward(ids[:16])
    worst = 0.0
    for t in ids[16:]:
        a = s16.forward([t])
        b = s32.forward([t])
        worst = max(worst, rel_l2(a, b))
    assert worst <= 1e-2
    assert worst > 0  # bf16 really ran in lower precision


def test_state_is_per_sequence_and_fp32(tiny_llm) -> None:
    seq = Sequence(tiny_llm.model, 100)
    cfg = tiny_llm.config
    gdn = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert seq.states.recurrent[gdn[0]].dtype == torch.float32
    assert seq.states.recurrent[gdn[0]].shape == (
        1,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    assert seq.states.conv[gdn[0]].shape == (1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    assert len(seq.blocks) == 2  # 100 positions in 64-position KV blocks
    seq.forward(prompt_ids(10))
    assert seq.position == 10 and seq.states.recurrent[gdn[0]].abs().sum() > 0
    with pytest.raises(ValueError, match="does not fit"):
        seq.forward(prompt_ids(91))


@pytest.mark.slow
def test_qwen3_5_08b_shape_matches_transformers(tmp_path) -> None:
    """The real 0.8B shape (1.7 GB synthetic checkpoint): fp32 logits and 32 greedy tokens."""
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint

    write_checkpoint(preset("qwen3.5-0.8b"), tmp_path / "q08", seed=0)
    llm = LLM(tmp_path / "q08", dtype="float32")
    result = compare(llm, load_reference(tmp_path / "q08"), prompt_ids(80), num_tokens=32)
    assert result.logits_rel_l2 <= 1e-5
    assert result.ours_tokens == result.reference_tokens


def test_reference_ops_switch_gives_the_same_decode(tiny_dir, monkeypatch) -> None:
    """DELTASERVE_REFERENCE_OPS=1 swaps every fast op for its torch reference: same results, bf16 too."""
    ids = prompt_ids(20, seed=8)
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("DELTASERVE_REFERENCE_OPS", flag)
        model = LLM(tiny_dir, dtype="bfloat16").model
        seq = Sequence(model, len(ids))
        logits = [seq.forward(ids[:10])]
        logits += [seq.forward([t]) for t in ids[10:]]
        runs.append(torch.stack(logits))
    monkeypatch.undo()
    env.cache_clear()  # later tests see the real environment again
    assert rel_l2(runs[0], runs[1]) <= 1e-5
