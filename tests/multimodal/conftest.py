"""Vision-only MiniCPM-V-4.6 checkpoints: the real tensor names (checkpoint/synthetic.py) at a
reduced or the real width, with weights scaled so every stage carries O(1) activations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deltaserve.checkpoint.presets import preset
from deltaserve.checkpoint.synthetic import write_vision_checkpoint

# hidden 64 = 4 heads x 16, 8 layers, window merger after layer 2, text hidden 32
REDUCED_VISION = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
}
REDUCED_INSERT_LAYER_ID = 2
REDUCED_TEXT_HIDDEN = 32


def minicpm_config(
    vision: dict[str, Any] | None = None,
    insert_layer_id: int | None = None,
    text_hidden: int | None = None,
) -> dict[str, Any]:
    """The published MiniCPM-V-4.6 config.json (formats.md 3.1) with the given changes."""
    cfg = preset("minicpm-v-4.6").config
    cfg["vision_config"].update(vision or {})
    if insert_layer_id is not None:
        cfg["insert_layer_id"] = insert_layer_id
    if text_hidden is not None:
        cfg["text_config"]["hidden_size"] = text_hidden
    return cfg


def reduced_config() -> dict[str, Any]:
    return minicpm_config(REDUCED_VISION, REDUCED_INSERT_LAYER_ID, REDUCED_TEXT_HIDDEN)


@pytest.fixture(scope="session")
def reduced_dir(tmp_path_factory) -> Path:
    return write_vision_checkpoint(tmp_path_factory.mktemp("minicpm-vision"), reduced_config())


@pytest.fixture(scope="session")
def reduced_model(reduced_dir):
    from deltaserve.multimodal.loader import load_vision_model

    return load_vision_model(reduced_dir, torch.float32)


@pytest.fixture(scope="session")
def reduced_reference(reduced_dir):
    from deltaserve.validate.vision_reference import load_vision_reference

    return load_vision_reference(reduced_dir, torch.float32)
