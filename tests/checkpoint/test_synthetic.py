"""Synthetic presets: published tensor counts and bytes; real presets load in transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from deltaserve.checkpoint.presets import PRESETS, preset
from deltaserve.checkpoint.synthetic import preset_specs
from deltaserve.checkpoint.writer import summarize, write_checkpoint


@pytest.mark.parametrize("name", ["qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-27b", "minicpm-v-4.6"])
def test_presets_match_published_counts_and_bytes(name: str) -> None:
    p = PRESETS[name]
    summary = summarize(p)
    assert (summary["num_tensors"], summary["num_bytes"]) == (p.expected_tensors, p.expected_bytes)


def test_dtype_rules_per_preset() -> None:
    qwen = {s.name: s for s in preset_specs(PRESETS["qwen3.5-27b"])}
    f32 = sorted(n for n, s in qwen.items() if s.dtype == torch.float32)
    assert len(f32) == 2 * 48 and all(n.endswith(("A_log", "linear_attn.norm.weight")) for n in f32)
    assert qwen["lm_head.weight"].shape == (248320, 5120)
    assert qwen["model.language_model.layers.0.linear_attn.A_log"].shape == (48,)
    assert qwen["model.language_model.layers.0.linear_attn.conv1d.weight"].shape == (10240, 1, 4)
    assert len([n for n in qwen if n.startswith("mtp.")]) == 15
    minicpm = preset_specs(PRESETS["minicpm-v-4.6"])
    assert all(s.dtype == torch.bfloat16 for s in minicpm)
    assert not any(s.name.startswith(("mtp.", "lm_head")) for s in minicpm)
    pos = [s for s in minicpm if s.name.endswith("position_embedding.weight")]
    assert pos[0].shape == (4900, 1152)


def test_27b_preset_has_eleven_shard_names() -> None:
    files = summarize(PRESETS["qwen3.5-27b"])["files"]
    assert files[0] == "model.safetensors-00001-of-00011.safetensors" and len(files) == 11


def test_written_tiny_checkpoint_is_deterministic_and_sane(tmp_path) -> None:
    a = write_checkpoint(preset("tiny"), tmp_path / "a", seed=3)
    write_checkpoint(preset("tiny"), tmp_path / "b", seed=3)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == a["num_tensors"]
        a_log = f.get_tensor("model.layers.0.linear_attn.A_log")
        assert torch.all(a_log.exp() >= 0.01) and torch.all(a_log.exp() <= 16)


def _check_loads_in_transformers(name: str, out) -> None:
    from transformers import AutoModelForImageTextToText

    summary = write_checkpoint(preset(name), out, seed=0)
    p = PRESETS[name]
    assert (summary["num_tensors"], summary["num_bytes"]) == (p.expected_tensors, p.expected_bytes)
    model, info = AutoModelForImageTextToText.from_pretrained(
        out, dtype=torch.bfloat16, output_loading_info=True
    )
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"


@pytest.mark.slow
def test_qwen3_5_08b_loads_in_transformers(tmp_path) -> None:
    _check_loads_in_transformers("qwen3.5-0.8b", tmp_path / "q08")


@pytest.mark.slow
def test_qwen3_5_2b_loads_in_transformers(tmp_path) -> None:
    _check_loads_in_transformers("qwen3.5-2b", tmp_path / "q2b")
