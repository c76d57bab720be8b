"""`--tp N` / `--pp N` on the command line: check the model splits, then either start N ranks of
this same command line (from a plain shell) or, inside one rank (torchrun's or ours), take its
part."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deltaserve.distributed.group import launched
from deltaserve.errors import ConfigError


def model_dir_of(args: argparse.Namespace) -> Path:
    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir

    return default_model_dir() if args.model is None else resolve_model_dir(args.model)


def check_split(model_dir: Path, size: int) -> None:
    """A clear error before any process starts: the model's head counts must divide by size."""
    from deltaserve.checkpoint.reader import read_config
    from deltaserve.distributed.shard import TPPlan
    from deltaserve.models.registry import text_config_for

    if size < 1:
        raise ConfigError(f"--tp must be >= 1, got {size}")
    TPPlan(text_config_for(read_config(model_dir)), 0, size)


def check_pp_split(model_dir: Path, size: int, layers: str | None) -> tuple[int, ...] | None:
    """The same for --pp/--pp-layers: the split must cover the model's layers exactly."""
    from deltaserve.checkpoint.reader import read_config
    from deltaserve.distributed.pipeline import PPPlan, parse_split
    from deltaserve.models.registry import text_config_for

    split = parse_split(layers)
    if size < 2:
        if split is not None:
            raise ConfigError(f"--pp-layers {layers} splits layers over --pp {len(split)} "
                              f"ranks, but --pp is {size}")
        return None
    PPPlan.build(text_config_for(read_config(model_dir)).num_hidden_layers, 0, size, split)
    return split


def ranks_of(args: argparse.Namespace) -> int:
    """Processes the command runs as: --tp or --pp (refused together)."""
    tp, pp = getattr(args, "tp", 1), getattr(args, "pp", 1)
    if tp != 1 and pp != 1:
        raise ConfigError(f"--tp {tp} with --pp {pp}: mixing tensor and pipeline parallelism is "
                          "not supported (pick one)")
    return pp if pp != 1 else tp


def generate_ranks(args: argparse.Namespace, argv: list[str]) -> int | None:
    """From a shell: run the command as --tp (or --pp) ranks, return the exit code. Inside a
    rank: None (the caller goes on; LLM joins the launch's group), rank 0 alone keeps stdout."""
    size = ranks_of(args)
    flag = "--pp" if getattr(args, "pp", 1) != 1 else "--tp"
    if launched():
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ConfigError(f"{flag} {size} but the launch started {world} processes")
        if int(os.environ["RANK"]) != 0:
            sys.stdout = open(os.devnull, "w")  # kept for the process's lifetime
        return None
    from deltaserve.distributed.launch import cli_command, run_ranks

    model_dir = model_dir_of(args)
    if flag == "--pp" or getattr(args, "pp_layers", None):
        check_pp_split(model_dir, args.pp, args.pp_layers)
    else:
        check_split(model_dir, size)
    return run_ranks(cli_command(argv), size, args.device)
