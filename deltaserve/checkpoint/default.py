"""The embedded default model: stdlib-19m, a small Qwen3.5 hybrid trained here, shipped in the package.

Its model card is deltaserve/assets/stdlib-19m/README.md; scripts/train rebuilds it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from deltaserve.errors import CheckpointError

DEFAULT_NAME = "stdlib-19m"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_dir() -> Path:
    """The shipped checkpoint folder; a clear error if the install lost its files."""
    path = Path(str(resources.files("deltaserve").joinpath("assets", DEFAULT_NAME)))
    missing = [name for name in _REQUIRED if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"the embedded default model is incomplete ({', '.join(missing)} missing in {path}); "
            "reinstall deltaserve or pass --model"
        )
    return path
