"""The embedded default model: until a trained one ships, a tiny synthetic checkpoint (random weights)."""

from __future__ import annotations

import sys
from pathlib import Path

from deltaserve.env import env

DEFAULT_NAME = "tiny-random-v1"
DEFAULT_SEED = 0


def default_model_dir() -> Path:
    """Made on first use under the cache folder; stable across runs (fixed preset and seed)."""
    out = env().cache_dir / "models" / DEFAULT_NAME
    if not (out / "config.json").is_file() or not (out / "tokenizer.json").is_file():
        from deltaserve.checkpoint.presets import preset
        from deltaserve.checkpoint.writer import write_checkpoint

        print(
            f"deltaserve: making the default model (tiny preset, RANDOM weights) in {out}",
            file=sys.stderr,
        )
        tmp = out.with_name(out.name + ".tmp")
        write_checkpoint(preset("tiny"), tmp, seed=DEFAULT_SEED)
        tmp.replace(out) if not out.exists() else _replace_dir(tmp, out)
    return out


def _replace_dir(src: Path, dst: Path) -> None:
    import shutil

    shutil.rmtree(dst)
    src.replace(dst)
