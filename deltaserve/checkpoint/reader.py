"""Read HF checkpoints: config.json, single or sharded safetensors, language-model tensor names."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deltaserve.errors import CheckpointError, ConfigError

INDEX_NAME = "model.safetensors.index.json"
# Prefixes that hold the language model, in the order they are tried; the name kept is `model.*`.
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Tensors the text engine does not read (multi-token prediction head, vision towers, projectors).
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "model.vision_tower.", "model.merger.", "visual.")


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} is not valid JSON: {path} ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} must hold a JSON object: {path}")
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    cfg = read_json(model_dir / "config.json", "config.json")
    if "model_type" not in cfg:
        raise ConfigError(f"config.json has no model_type: {model_dir / 'config.json'}")
    return cfg


def lm_name(name: str) -> str | None:
    """Checkpoint tensor name -> our `model.*` / `lm_head.*` name, or None if not a text-LM tensor."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith("lm_head.") or name.startswith("language_model.lm_head."):
        return "lm_head." + name.split("lm_head.", 1)[1]
    for prefix in _LM_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    return None


@dataclass(frozen=True, slots=True)
class TensorIndex:
    """Where each language-model tensor lives: our name -> (file, name in that file), plus its
    header entry (shape, safetensors dtype string), read in the same pass over each file."""

    locations: dict[str, tuple[Path, str]]
    headers: dict[str, tuple[list[int], str]]

    @classmethod
    def scan(
        cls,
        model_dir: Path,
        rename: Callable[[str], str | None] = lm_name,
        what: str = "language-model",
    ) -> TensorIndex:
        """Index the tensors `rename` maps to one of our names (None = not ours); the default
        keeps the language model, `multimodal.loader` passes the vision tower's map."""
        files = _weight_files(model_dir)
        locations: dict[str, tuple[Path, str]] = {}
        headers: dict[str, tuple[list[int], str]] = {}
        for file in files:
            for name, header in _file_headers(file).items():
                ours = rename(name)
                if ours is not None and ours not in locations:
                    locations[ours] = (file, name)
                    headers[ours] = header
        if not locations:
            raise CheckpointError(f"no {what} tensors found in {model_dir}")
        return cls(locations, headers)

    def meta(self, name: str) -> tuple[list[int], torch.dtype]:
        """(shape, dtype) of one tensor from the file header, without reading its data."""
        shape, dtype_name = self.headers[name]
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"tensor '{name}' has unsupported dtype {dtype_name}")
        return list(shape), dtype

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (our name, tensor) for `names`, opening each file once."""
        by_file: dict[Path, list[str]] = {}
        for ours in names:
            by_file.setdefault(self.locations[ours][0], []).append(ours)
        with ExitStack() as stack:
            for file, ours_list in by_file.items():
                handle = stack.enter_context(_open(file))
                for ours in ours_list:
                    try:
                        yield ours, handle.get_tensor(self.locations[ours][1])
                    except Exception as exc:  # safetensors raises its own error types
                        raise CheckpointError(
                            f"cannot read tensor '{ours}' from {file}: {exc}"
                        ) from exc


_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
    "U8": torch.uint8, "U32": torch.uint32, "I32": torch.int32, "I64": torch.int64,
}


def _weight_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / INDEX_NAME
    if index_path.exists():
        weight_map = read_json(index_path, INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"shard(s) listed in {INDEX_NAME} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {model_dir}")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:
        raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from exc


def _file_headers(file: Path) -> dict[str, tuple[list[int], str]]:
    if file.stat().st_size < 8:
        raise CheckpointError(f"corrupt or truncated safetensors file {file}: too small")
    with _open(file) as handle:
        out = {}
        for key in handle.keys():
            sl = handle.get_slice(key)
            out[key] = (list(sl.get_shape()), sl.get_dtype())
        return out
