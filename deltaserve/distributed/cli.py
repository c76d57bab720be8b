"""`--tp N` on the command line: check the model splits, then either start N ranks of this same
command line (from a plain shell) or, inside one rank (torchrun's or ours), take its part."""

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


def generate_ranks(args: argparse.Namespace, argv: list[str]) -> int | None:
    """From a shell: run the command as args.tp ranks, return the exit code. Inside a rank:
    None (the caller goes on; LLM joins the launch's group), rank 0 alone keeps stdout."""
    if launched():
        world = int(os.environ["WORLD_SIZE"])
        if world != args.tp:
            raise ConfigError(f"--tp {args.tp} but the launch started {world} processes")
        if int(os.environ["RANK"]) != 0:
            sys.stdout = open(os.devnull, "w")  # kept for the process's lifetime
        return None
    from deltaserve.distributed.launch import cli_command, run_ranks

    check_split(model_dir_of(args), args.tp)
    return run_ranks(cli_command(argv), args.tp, args.device)
