"""Write a synthetic checkpoint folder: random tensors, shards + index, config, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deltaserve.checkpoint.presets import Preset
from deltaserve.checkpoint.synthetic import TensorSpec, preset_specs, vision_init
from deltaserve.errors import DeltaserveError
from deltaserve.progress import bar


def init_tensor(spec: TensorSpec, gen: torch.Generator, std: float) -> torch.Tensor:
    """Random values that keep the model numerically sane (formats.md: norm and decay conventions)."""
    n = spec.shape[0]
    if spec.init == "normal":
        x = torch.randn(spec.shape, generator=gen) * std
    elif spec.init == "conv":  # depthwise taps of a few tenths, like trained short convs
        x = torch.randn(spec.shape, generator=gen) * 0.3
    elif spec.init == "zeros_centred":  # (1 + w) norms: near zero, noisy so 1+w vs w bugs show
        x = torch.randn(spec.shape, generator=gen) * 0.05
    elif spec.init == "ones_noisy":  # plain-w gated norm
        x = 1.0 + torch.randn(spec.shape, generator=gen) * 0.05
    elif spec.init == "a_log":  # transformers' init: A ~ U(0.01, 16)
        x = (torch.rand(n, generator=gen) * (16 - 0.01) + 0.01).log()
    elif spec.init == "dt_bias":
        x = 1.0 + (torch.rand(n, generator=gen) - 0.5) * 0.5
    else:
        x = torch.zeros(spec.shape)
    return x.to(spec.dtype)


def _init(spec: TensorSpec, gen: torch.Generator, std: float) -> torch.Tensor:
    """Vision tensors get the tower's fan-in scaling (N(0, 0.02) would flatten its attention)."""
    if spec.name.startswith(("model.vision_tower.", "model.merger.")):
        return vision_init(spec.name, spec.shape, gen).to(spec.dtype)
    return init_tensor(spec, gen, std)


def shard_names(num_shards: int) -> list[str]:
    """Qwen's naming: model.safetensors-0000k-of-0000n.safetensors (the 27B: 11 shards)."""
    width = 5
    return [
        f"model.safetensors-{k:0{width}d}-of-{num_shards:0{width}d}.safetensors"
        for k in range(1, num_shards + 1)
    ]


def _split(specs: list[TensorSpec], num_shards: int) -> list[list[TensorSpec]]:
    total = sum(s.num_bytes for s in specs)
    target = total / max(num_shards, 1)
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if used >= target * len(shards) and len(shards) < num_shards:
            shards.append([])
        shards[-1].append(spec)
        used += spec.num_bytes
    return shards


MINICPM_PREPROCESSOR = {"image_processor_type": "MiniCPMV4_6ImageProcessor", "max_slice_nums": 9,
                        "scale_resolution": 448, "patch_size": 14, "use_image_id": True,
                        "slice_mode": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


def write_checkpoint(p: Preset, out_dir: Path, seed: int) -> dict:
    """Write `p` into out_dir; returns a summary (tensor count, bytes, files)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = preset_specs(p)
    gen = torch.Generator().manual_seed(seed)
    text = p.config.get("text_config", p.config)
    std = float(text.get("initializer_range", 0.02))
    groups = _split(specs, p.num_shards) if p.num_shards else [specs]
    names = shard_names(p.num_shards) if p.num_shards else ["model.safetensors"]
    weight_map: dict[str, str] = {}
    total = sum(s.num_bytes for s in specs)
    # each byte counted twice: once drawn, once saved (a large shard's save takes seconds)
    with bar(2 * total, f"writing {out_dir.name}", "B", unit_scale=True) as shown:
        for group, file_name in zip(groups, names, strict=True):
            shown.set_postfix_str(file_name, refresh=False)
            tensors = {}
            for spec in group:
                tensors[spec.name] = _init(spec, gen, std)
                shown.update(spec.num_bytes)
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
            shown.update(sum(spec.num_bytes for spec in group))
            weight_map.update({s.name: file_name for s in group})
            del tensors
    if p.num_shards:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_json(out_dir / "config.json", p.config)
    if p.generation_config:
        _write_json(out_dir / "generation_config.json", p.generation_config)
    write_tokenizer(out_dir, p.config["model_type"] == "minicpmv4_6")
    if p.config["model_type"] == "minicpmv4_6":  # the published repo's (formats.md; converters read it)
        _write_json(out_dir / "preprocessor_config.json", MINICPM_PREPROCESSOR)
    return {"preset": p.name, "num_tensors": len(specs), "num_bytes": total, "files": names}


def summarize(p: Preset) -> dict:
    specs = preset_specs(p)
    return {
        "preset": p.name,
        "num_tensors": len(specs),
        "num_bytes": sum(s.num_bytes for s in specs),
        "files": shard_names(p.num_shards) if p.num_shards else ["model.safetensors"],
    }


def write_tokenizer(out_dir: Path, minicpm_v: bool = False) -> None:
    """The Qwen3.5 tokenizer files; minicpm_v adds MiniCPM-V-4.6's image and slice tokens."""
    from deltaserve.checkpoint.qwen_vocab import MINICPM_V_TOKENS, write_tokenizer_files

    template = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text(encoding="utf-8")
    extra = MINICPM_V_TOKENS if minicpm_v else ()
    try:
        write_tokenizer_files(out_dir, chat_template=template, extra_special_tokens=extra)
    except OSError as exc:
        raise DeltaserveError(f"cannot write tokenizer files to {out_dir}: {exc}") from exc


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
