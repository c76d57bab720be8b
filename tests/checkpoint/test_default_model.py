"""The shipped default model, stdlib-19m: its files, its quality and its agreement with transformers."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors import safe_open

from deltaserve import LLM
from deltaserve.bench.needle import heldout_filler
from deltaserve.cache.sequence import prompt_logits
from deltaserve.checkpoint.synthetic import lm_specs, mtp_specs
from deltaserve.validate.compare import compare
from deltaserve.validate.reference import load_reference

MAX_BYTES = 40_000_000


def test_files_names_shapes_dtypes_match_the_qwen3_5_layout(default_dir) -> None:
    cfg = json.loads((default_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["layer_types"].count("full_attention") == 2
    specs = lm_specs(cfg, "model.", True) + mtp_specs(cfg)
    expected = {s.name: (s.shape, "BF16" if s.dtype == torch.bfloat16 else "F32") for s in specs}
    with safe_open(default_dir / "model.safetensors", "pt") as f:
        got = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}
    assert got == expected
    weights = (default_dir / "model.safetensors").stat().st_size
    assert weights <= MAX_BYTES
    for name in ("README.md", "manifest.json", "train_log.json", "tokenizer_report.json"):
        assert (default_dir / name).is_file(), name


def test_logits_and_greedy_match_transformers_fp32(default_llm, default_dir) -> None:
    ids = default_llm.tokenizer.encode("import os\n\n\ndef list_python_files(path):\n")
    result = compare(default_llm, load_reference(default_dir), ids, num_tokens=32)
    assert result.logits_rel_l2 <= 1e-5
    assert result.ours_tokens == result.reference_tokens


def test_bf16_matches_transformers(default_dir) -> None:
    llm = LLM(default_dir, dtype="bfloat16")
    ids = llm.tokenizer.encode("class Stack:\n    def push(self, item):\n")
    # On CPU we compute in fp32 from the bf16 weights, so we match transformers' fp32 run exactly.
    exact = compare(llm, load_reference(default_dir), ids, num_tokens=16)
    assert exact.logits_rel_l2 <= 1e-5 and exact.first_divergence is None
    # transformers' own bf16 arithmetic sits ~5e-3 from its fp32 run (enough to flip a near-tie
    # greedy token on this prompt); we are within that distance of it.
    rounded = compare(llm, load_reference(default_dir, torch.bfloat16), ids, num_tokens=16)
    assert rounded.logits_rel_l2 <= 1e-2


def test_heldout_loss_is_far_below_unigram(default_llm, default_dir) -> None:
    """Cross-entropy on stdlib files the model never saw, in our engine, vs the unigram baseline."""
    log = json.loads((default_dir / "train_log.json").read_text())
    text = "".join(heldout_filler(default_dir / "manifest.json", max_lines=3000))
    ids = torch.tensor([default_llm.tokenizer.encode(text)[:2049]])
    logits = prompt_logits(default_llm.model, ids[:, :-1])
    loss = F.cross_entropy(logits, ids[0, 1:]).item()
    assert loss < 0.5 * log["unigram_heldout_loss"]


def test_chat_template_renders_the_training_format(default_llm) -> None:
    messages = [{"role": "user", "content": "What does `len(obj)` do?"}]
    text = default_llm.tokenizer.apply_chat_template(messages)
    assert text == "<|im_start|>user\nWhat does `len(obj)` do?<|im_end|>\n<|im_start|>assistant\n"
