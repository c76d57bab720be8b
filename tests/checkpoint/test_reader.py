"""Checkpoint reading: the three config forms, shards + index, prefixes, ignored tensors, dtypes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaserve.cache.sequence import Sequence
from deltaserve.checkpoint.loader import load_text_model
from deltaserve.checkpoint.reader import TensorIndex, lm_name
from deltaserve.config import TextConfig
from tests.conftest import read_config


def _nest(flat: dict, model_type: str) -> dict:
    text = dict(flat, model_type="qwen3_5_text")
    return {
        "model_type": model_type,
        "text_config": text,
        "tie_word_embeddings": flat["tie_word_embeddings"],
    }


def _rewrite(src: Path, dst: Path, config: dict, rename, num_shards: int = 0) -> Path:
    """Copy a checkpoint with renamed tensors, optionally split into shards with an index."""
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {rename(k): v for k, v in load_file(src / "model.safetensors").items()}
    if not num_shards:
        save_file(tensors, dst / "model.safetensors")
        return dst
    names, weight_map = sorted(tensors), {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _logits(model_dir: Path) -> torch.Tensor:
    model, _, _ = load_text_model(model_dir, "float32")
    return Sequence(model, 5).forward([1, 2, 3, 4, 5])


def test_three_config_forms_give_the_same_config(tiny_dir) -> None:
    flat = read_config(tiny_dir)
    a = TextConfig.from_hf(flat)
    assert a == TextConfig.from_hf(_nest(flat, "qwen3_5"))
    assert a == TextConfig.from_hf(_nest(flat, "minicpmv4_6"))
    assert a.linear_num_value_heads == 4 and a.linear_num_key_heads == 2


@pytest.mark.parametrize("model_type,num_shards", [("qwen3_5", 3), ("minicpmv4_6", 0)])
def test_nested_prefixed_and_sharded_checkpoints_load_identically(
    tiny_dir, tmp_path, model_type, num_shards
) -> None:
    def rename(name: str) -> str:
        return (
            name.replace("model.", "model.language_model.", 1)
            if name.startswith("model.")
            else name
        )

    nested = _rewrite(
        tiny_dir, tmp_path / "nested", _nest(read_config(tiny_dir), model_type), rename, num_shards
    )
    # a vision tensor the text engine must ignore
    extra = {"model.visual.blocks.0.norm1.weight": torch.ones(8, dtype=torch.bfloat16)}
    save_file(extra, nested / "vision-extra.safetensors") if not num_shards else None
    assert torch.equal(_logits(nested), _logits(tiny_dir))


def test_mtp_and_vision_tensors_are_ignored_and_names_mapped() -> None:
    assert lm_name("mtp.fc.weight") is None
    assert lm_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert lm_name("model.vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert lm_name("model.merger.mlp.0.linear_1.weight") is None
    assert (
        lm_name("model.language_model.layers.3.self_attn.q_proj.weight")
        == "model.layers.3.self_attn.q_proj.weight"
    )
    assert lm_name("model.norm.weight") == "model.norm.weight"
    assert lm_name("lm_head.weight") == "lm_head.weight"


def test_mixed_dtypes_on_disk_and_in_memory(tiny_dir) -> None:
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.linear_attn.A_log").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.linear_attn.norm.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.linear_attn.dt_bias").get_dtype() == "BF16"
        assert f.get_slice("model.layers.0.linear_attn.conv1d.weight").get_shape() == [
            256,
            1,
            4,
        ]  # 2*HK*K + HV*V
        assert any(k.startswith("mtp.") for k in f.keys())
    model, _, _ = load_text_model(tiny_dir, "bfloat16")
    assert model.model.layers[0].linear_attn.in_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32  # small params stay fp32


def test_tied_head_reads_the_embedding(tiny_dir) -> None:
    model, cfg, _ = load_text_model(tiny_dir, "float32")
    assert cfg.tie_word_embeddings
    assert model.head is model.model.embed_tokens
    assert "lm_head.weight" not in TensorIndex.scan(tiny_dir).locations
