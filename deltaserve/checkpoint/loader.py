"""Build a text model from a checkpoint folder: config -> empty model -> tensors checked and copied."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deltaserve.checkpoint.memory import advise_huge_pages
from deltaserve.checkpoint.reader import TensorIndex, read_config
from deltaserve.config import TextConfig
from deltaserve.env import env
from deltaserve.errors import CheckpointError, ConfigError
from deltaserve.layers.linear import Linear
from deltaserve.models.registry import text_config_for, text_model_class
from deltaserve.progress import bar
from deltaserve.quant.linear import narrow_scales_
from deltaserve.quant.loading import from_mlx, is_mlx_layout, quantize_model_

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# a bar only for loads this long: the embedded model loads in well under it
LOAD_BAR_DELAY_S = 2.0


def resolve_dtype(dtype: str, raw_config: dict[str, Any]) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (bfloat16 for the published models)."""
    if dtype == "auto":
        text = raw_config.get("text_config", raw_config)
        dtype = str(
            text.get("dtype") or text.get("torch_dtype") or raw_config.get("dtype") or "bfloat16"
        )
    if dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype '{dtype}' (choose auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """CPUs here lack fast bf16 GEMMs and bf16 activations lose accuracy: compute in fp32 on CPU."""
    return torch.float32 if device.type == "cpu" else dtype


def load_text_model(model_dir: Path, dtype: str = "auto", device: str = "cpu", tp=None,
                    pp=None):
    """(model, the checkpoint's TextConfig, raw config.json). With tp (a distributed.group.TPGroup)
    the model is this rank's shard: built from the local config, each tensor sliced to its part.
    With pp (a distributed.pipeline.PPLaunch) it is this rank's pipeline stage: its layers only."""
    raw = read_config(model_dir)
    cfg = text_config_for(raw)
    plan = None if tp is None else _tp_plan(cfg, tp)
    stage = None if pp is None else pp.plan(cfg)
    param_dtype = resolve_dtype(dtype, raw)
    dev = torch.device(device)
    if dev.type == "cpu":
        # GDN decays underflow into denormals (exp(-50) products) and denormal arithmetic is ~100x
        # slower on x86: flushing them to zero took 0.8B prefill from 107 to 147 tok/s here.
        torch.set_flush_denormal(True)
    cls = text_model_class(raw["model_type"])
    index = TensorIndex.scan(model_dir)
    mlx = is_mlx_layout(index)  # of the whole checkpoint: a stage may hold no GDN conv
    if plan is not None:
        plan = _check_quantized_split(plan, raw, index)
    local = cfg if plan is None else plan.local_config()
    if stage is not None:
        local, index = stage.local_config(cfg), stage.local_index(index, cfg.tie_word_embeddings)
    with torch.device("meta"):
        model = cls(local, param_dtype, activation_dtype(param_dtype, dev))
        if stage is not None:
            stage.drop_ends(model)
        quantize_model_(model, raw, index)
    model = model.to_empty(device=dev)
    if dev.type == "cpu" and env().huge_pages:
        advise_huge_pages([p.data for p in model.parameters()])
    _copy_weights(model, cfg, index, from_mlx if mlx else None,
                  None if plan is None else plan.shard)
    narrow_scales_(model)  # half the scale bytes per decode step; exact (quant/linear.py)
    if plan is not None:
        from deltaserve.distributed.comm import Comm, Compression
        from deltaserve.distributed.sharded import attach

        attach(model, plan, Comm(plan.size, dev, Compression.from_env()))
    if stage is not None:
        from deltaserve.distributed.pipeline import PPStage

        model.pp = PPStage(stage, dev)
    return model.eval(), cfg, raw


def _tp_plan(cfg: TextConfig, tp):
    from deltaserve.distributed.shard import TPPlan

    return TPPlan(cfg, tp.rank, tp.world_size)


def _check_quantized_split(plan, raw: dict[str, Any], index: TensorIndex):
    """The plan, with the modules whose inputs keep a GGUF's value-head order."""
    from deltaserve.distributed.shard import check_quantized_split
    from deltaserve.quant.loading import quant_block, quantized_scheme

    block = quant_block(raw)
    if block is None:
        return plan
    return check_quantized_split(plan, index, lambda name: quantized_scheme(block, index, name))


def checkpoint_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the tensor (a parameter, or a row slice of a packed Linear) it fills."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if getattr(module, "checkpoint_name", None) is not None:  # one part of a packed Linear
            targets[f"{module.checkpoint_name}.{leaf}"] = param.data
            continue
        if not isinstance(module, Linear) or module.parts is None:
            targets[name] = param.data
            continue
        parent = module_name.rpartition(".")[0]
        for part, rows in zip(module.parts, param.data.split(module.out_sizes), strict=True):
            targets[f"{parent}.{part}.{leaf}"] = rows
    return targets


def _copy_weights(model: torch.nn.Module, cfg: TextConfig, index: TensorIndex, fix=None,
                  shard=None) -> None:
    """fix(name, tensor): layout repairs (MLX); shard(name, tensor): a rank's part of it."""
    targets = checkpoint_targets(model)
    missing = [name for name in targets if name not in index.locations]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor '{missing[0]}'{more}")
    with bar(len(targets), "loading weights", "tensor", delay=LOAD_BAR_DELAY_S) as shown:
        for name, tensor in index.tensors(list(targets)):
            shown.update(1)
            target = targets[name]
            if fix is not None:
                tensor = fix(name, tensor)
            if shard is not None:
                tensor = shard(name, tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"tensor '{name}' has shape {list(tensor.shape)} but the config expects "
                    f"{list(target.shape)}"
                )
            if target.dtype.is_floating_point != tensor.dtype.is_floating_point or (
                not target.dtype.is_floating_point and tensor.dtype != target.dtype
            ):
                raise CheckpointError(
                    f"tensor '{name}' has dtype {tensor.dtype}; expected {target.dtype}"
                )
            target.copy_(tensor)
