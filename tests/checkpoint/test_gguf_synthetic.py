"""`make-checkpoint --format gguf-q1_0`: a GGUF at a preset's shape with llama.cpp's layout.

The layout is checked against the test writer of tests/quant (llama.cpp's conversion rules,
written independently of the product's name map): the same tensor names and shapes; the types
are llama-quantize's for Q1_0; the random blocks decode to weights of the preset's std; the
file alone (no folder around it) generates and chats. That llama.cpp itself loads such files
was checked with its llama-bench (the 27B: docs/journal/2026-12-05-issue-34-gguf-quantized.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.checkpoint.gguf_synthetic import gguf_bytes, write_synthetic_gguf
from deltaserve.checkpoint.presets import preset
from deltaserve.cli import main
from deltaserve.quant.gguf_read import read_gguf

gguf = pytest.importorskip("gguf")


def test_layout_is_the_converters_and_values_are_sane(tiny_dir, tmp_path) -> None:
    from tests.quant.test_gguf_import import Q, write_gguf

    ours = tmp_path / "ours.gguf"
    summary = write_synthetic_gguf(preset("tiny").config, ours, seed=0)
    theirs = tmp_path / "theirs.gguf"
    write_gguf(tiny_dir, theirs, Q.Q1_0, Q.Q8_0)
    a, b = read_gguf(ours), read_gguf(theirs)
    assert {t.name: list(t.shape) for t in a.tensors} == {t.name: list(t.shape) for t in b.tensors}
    types = {t.name: t.tensor_type.name for t in a.tensors}
    # tied head: the embedding takes the output's type, Q6_K, whose 256-blocks 128-wide rows do
    # not fill: llama-quantize's fallback Q8_0; every other matrix Q1_0; vectors and conv F32
    assert types["token_embd.weight"] == "Q8_0"
    assert {types[n] for n in types if n.endswith("ffn_down.weight") or "attn_qkv" in n} == \
        {"Q1_0"}
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == "F32"
    assert summary["tensor_bytes"] == gguf_bytes(preset("tiny").config) == \
        sum(np.asarray(t.data).nbytes for t in a.tensors)
    by_name = {t.name: t for t in a.tensors}
    down = np.asarray(by_name["blk.0.ffn_down.weight"].data).reshape(-1, 18)
    d = down[:, :2].copy().view(np.float16).astype(np.float32)
    assert abs(d.mean() / (0.02 * np.sqrt(2 / np.pi)) - 1) < 0.02  # mean|x| of N(0, 0.02)
    assert (np.asarray(by_name["blk.0.ssm_a"].data) < 0).all()  # -exp(A_log)
    norm = np.asarray(by_name["blk.0.attn_norm.weight"].data)
    assert abs(norm.mean() - 1) < 0.05  # (1 + w) stored with the 1


def test_the_file_alone_generates_and_chats(tmp_path) -> None:
    path = tmp_path / "tiny-q1_0.gguf"
    assert main(["make-checkpoint", "--preset", "tiny", "--format", "gguf-q1_0",
                 str(path)]) == 0
    llm = LLM(path, dtype="float32")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    chat = llm.chat([{"role": "user", "content": "hi"}],
                    SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert "<|im_start|>user\nhi<|im_end|>" in chat.prompt


def test_make_checkpoint_gguf_refusals_and_dry_run(tmp_path, capsys) -> None:
    assert main(["make-checkpoint", "--preset", "tiny", "--format", "gguf-q1_0",
                 str(tmp_path / "out")]) == 1
    assert "ending in .gguf" in capsys.readouterr().err
    assert main(["make-checkpoint", "--preset", "minicpm-v-4.6", "--format", "gguf-q1_0",
                 "--dry-run"]) == 1
    assert "Qwen3.5 presets only" in capsys.readouterr().err
    assert main(["make-checkpoint", "--preset", "qwen3.5-27b", "--format", "gguf-q1_0",
                 "--dry-run"]) == 0
    # llama-bench reported model_size 4716437504 for the file this writes
    assert json.loads(capsys.readouterr().out)["tensor_bytes"] == 4_716_437_504
