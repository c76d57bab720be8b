"""Resolve a model argument: a local folder, or a Hugging Face hub id downloaded with huggingface_hub."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from deltaserve.errors import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


def resolve_model_dir(model: str | Path, revision: str | None = None,
                      mmproj: str | Path | None = None) -> Path:
    """A folder is used as is; a .gguf file (or the first part of a split set) is imported once into
    the cache folder, with MiniCPM-V's vision file `mmproj` (None: the one `mmproj*.gguf` beside
    the model file, if any; "none": text only); `org/name` that is not a folder is fetched (or
    found in the HF cache)."""
    path = Path(model).expanduser()
    if mmproj is not None and str(mmproj) != "none" and not (
            path.is_file() and path.suffix.lower() == ".gguf"):
        raise CheckpointError("--mmproj goes with a .gguf model file (a checkpoint folder holds "
                              "its vision tower itself)")
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from deltaserve.quant.cached import gguf_copy
        from deltaserve.quant.gguf_import import split_parts
        from deltaserve.quant.gguf_mmproj import find_mmproj

        parts = split_parts(path)
        if mmproj is None:
            vision = find_mmproj(parts[0])
        elif str(mmproj) == "none":
            vision = None
        else:
            vision = Path(mmproj).expanduser()
            if not vision.is_file():
                raise CheckpointError(f"mmproj file '{mmproj}' does not exist")
        return gguf_copy(parts, log=lambda msg: print(f"deltaserve: {msg}", file=sys.stderr,
                                                      flush=True), mmproj=vision)
    if path.exists():
        raise CheckpointError(
            f"model '{model}' is a file; pass a checkpoint folder or a .gguf file"
        )
    text = str(model)
    if not _HUB_ID.match(text) or text.startswith((".", "/", "~")):
        raise CheckpointError(f"model folder '{model}' does not exist")
    return _download(text, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError as exc:  # pragma: no cover - it is a runtime dependency
        raise CheckpointError(
            f"'{repo_id}' is not a local folder and huggingface_hub is missing"
        ) from exc
    try:
        # snapshot_download shows a tqdm progress bar per file unless HF_HUB_DISABLE_PROGRESS_BARS=1
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"'{repo_id}' is not a local folder and could not be downloaded: offline or the hub is "
            "unreachable, and it is not in the Hugging Face cache"
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise CheckpointError(f"hub repository '{repo_id}' not found or not accessible") from exc
    except OSError as exc:
        raise CheckpointError(f"downloading '{repo_id}' failed: {exc}") from exc
