"""Build the `VisionModel` from a checkpoint's `model.vision_tower.*` and `model.merger.*`."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.checkpoint.loader import checkpoint_targets
from deltaserve.checkpoint.reader import TensorIndex, read_config
from deltaserve.errors import CheckpointError
from deltaserve.multimodal.config import VisionConfig
from deltaserve.multimodal.tower import VisionModel

VISION_PREFIXES = ("model.vision_tower.", "model.merger.")


def vision_name(name: str) -> str | None:
    """Checkpoint name -> our parameter name (the leading `model.` dropped), None if not vision."""
    return name[len("model.") :] if name.startswith(VISION_PREFIXES) else None


def load_vision_model(
    model_dir: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> VisionModel:
    """Weights and activations in `dtype` (fp32 for parity with transformers)."""
    model_dir = Path(model_dir)
    cfg = VisionConfig.from_hf(read_config(model_dir))
    what = "vision (model.vision_tower.*, model.merger.*)"
    index = TensorIndex.scan(model_dir, vision_name, what)
    with torch.device("meta"):
        model = VisionModel(cfg, dtype)
    model = model.to_empty(device=torch.device(device))
    copy_vision_tensors(model, index)
    return model.eval()


def copy_vision_tensors(model: VisionModel, index: TensorIndex) -> None:
    """Every parameter (or packed q|k|v row slice) from its checkpoint tensor, shape-checked."""
    targets = checkpoint_targets(model)
    missing = [name for name in targets if name not in index.locations]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor 'model.{missing[0]}'{more}")
    # extra vision tensors mean config.json describes another tower (e.g. fewer layers)
    unexpected = sorted(set(index.locations) - set(targets))
    if unexpected:
        raise CheckpointError(
            f"checkpoint tensor 'model.{unexpected[0]}' is not part of the vision tower that "
            "config.json describes"
        )
    for name, tensor in index.tensors(list(targets)):
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor 'model.{name}' has shape {list(tensor.shape)} but the config expects "
                f"{list(target.shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(
                f"tensor 'model.{name}' has dtype {tensor.dtype}; expected floats"
            )
        target.copy_(tensor)
