"""Loading the vision tower: names and shapes from the checkpoint, one clear error when off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.checkpoint.presets import preset
from deltaserve.checkpoint.synthetic import preset_specs
from deltaserve.errors import CheckpointError, ConfigError
from deltaserve.multimodal.config import VisionConfig
from deltaserve.multimodal.loader import load_vision_model
from deltaserve.multimodal.tower import VisionModel

PATCH = "model.vision_tower.embeddings.patch_embedding.weight"
Q_PROJ = "model.vision_tower.encoder.layers.3.self_attn.q_proj.weight"
MERGER = "model.merger.mlp.0.linear_2.bias"


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_parameters_are_the_published_tensor_names() -> None:
    """Every checkpoint tensor of the real model fills exactly one of our parameters (or a packed
    q|k|v row slice), checked on the meta device: no 2.6 GB file needed."""
    from deltaserve.checkpoint.loader import checkpoint_targets

    p = preset("minicpm-v-4.6")
    vision = {s.name: s.shape for s in preset_specs(p) if not s.name.startswith("model.language")}
    with torch.device("meta"):
        model = VisionModel(VisionConfig.from_hf(p.config), torch.float32)
    ours = {"model." + name: tuple(t.shape) for name, t in checkpoint_targets(model).items()}
    assert ours == vision
    # formats.md 3.2: 432 encoder + 16 vit_merger + 6 merger.mlp + 3 embeddings + 2 post_layernorm
    assert len(vision) == 459


def test_packed_qkv_rows_come_from_their_tensors(reduced_dir, reduced_model) -> None:
    tensors = load_file(str(reduced_dir / "model.safetensors"))
    qkv = reduced_model.vision_tower.encoder["layers"][3].self_attn.qkv
    width = reduced_model.cfg.hidden_size
    assert torch.equal(qkv.weight[:width], tensors[Q_PROJ].float())
    v_bias = tensors[Q_PROJ.replace("q_proj.weight", "v_proj.bias")]
    assert torch.equal(qkv.bias[2 * width :], v_bias.float())


def test_missing_tensor_names_it(reduced_dir, tmp_path) -> None:
    d = _edit_tensors(reduced_dir, tmp_path / "c", lambda t: t.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match=f"missing tensor '{Q_PROJ}'"):
        load_vision_model(d)


def test_wrong_shape_names_it(reduced_dir, tmp_path) -> None:
    def widen(tensors):
        tensors[MERGER] = torch.zeros(33, dtype=torch.bfloat16)

    d = _edit_tensors(reduced_dir, tmp_path / "c", widen)
    needle = rf"'{MERGER}' has shape \[33\] but the config expects \[32\]"
    with pytest.raises(CheckpointError, match=needle):
        load_vision_model(d)


def test_wrong_patch_kernel_shape_names_it(reduced_dir, tmp_path) -> None:
    def flatten(tensors):
        tensors[PATCH] = tensors[PATCH].reshape(64, -1)

    d = _edit_tensors(reduced_dir, tmp_path / "c", flatten)
    with pytest.raises(CheckpointError, match=PATCH):
        load_vision_model(d)


def test_extra_layer_is_reported(reduced_dir, tmp_path) -> None:
    extra = "model.vision_tower.encoder.layers.8.mlp.fc1.bias"
    d = _edit_tensors(reduced_dir, tmp_path / "c", lambda t: t.update({extra: torch.zeros(96)}))
    with pytest.raises(CheckpointError, match=extra):
        load_vision_model(d)


def test_no_vision_tensors(reduced_dir, tmp_path) -> None:
    def text_only(tensors):
        tensors.clear()
        tensors["model.language_model.norm.weight"] = torch.zeros(32)

    d = _edit_tensors(reduced_dir, tmp_path / "c", text_only)
    with pytest.raises(CheckpointError, match="no vision"):
        load_vision_model(d)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"insert_layer_id": 8}, "insert_layer_id 8 is outside"),
        ({"model_type": "qwen3_5"}, "no vision tower"),
        ({"merge_kernel_size": [3, 3]}, "2x2"),
        ({"downsample_mode": "2x"}, "downsample_mode"),
    ],
)
def test_bad_config_is_a_config_error(reduced_dir, tmp_path, change, needle) -> None:
    d = shutil.copytree(reduced_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=needle):
        load_vision_model(d)


def test_loads_in_bfloat16(reduced_dir) -> None:
    model = load_vision_model(reduced_dir, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
