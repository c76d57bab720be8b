"""Start N ranks on this machine the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): `deltaserve generate|bench --tp N` re-runs its own
command line in N processes; `spawn` runs a picklable function in N processes (tests, scripts).
Rank 0's output is the command's; the other ranks' stdout is dropped and their stderr shown only
if they fail."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

from deltaserve.errors import ConfigError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int, threads: int | None = None) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of a one-machine launch."""
    out = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if threads is not None and not os.environ.get("DELTASERVE_NUM_THREADS"):
        out["DELTASERVE_NUM_THREADS"] = str(threads)
    return out


def check_gpus(size: int, device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if size > have:
        raise ConfigError(f"--tp {size} on {device} needs {size} CUDA GPUs; this machine has {have}")


def run_ranks(cmd: list[str], size: int, device: str = "cpu", capture: bool = False):
    """Run `cmd` as `size` ranks; returns rank 0's exit code, or the first failing rank's (the
    others are then stopped: they would wait in a collective forever). With capture, returns
    (code, rank 0's stdout, rank 0's stderr) instead of passing rank 0's output through."""
    from deltaserve.distributed.group import cpu_threads_per_rank

    check_gpus(size, device)
    port, threads = free_port(), cpu_threads_per_rank(size) if device == "cpu" else None
    logs = [tempfile.TemporaryFile() for _ in range(size)]
    out0 = tempfile.TemporaryFile() if capture else None
    procs = []
    for rank in range(size):
        env = {**os.environ, **rank_env(rank, size, port, threads)}
        out = (out0 if capture else None) if rank == 0 else subprocess.DEVNULL
        err = None if rank == 0 and not capture else logs[rank]
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err))
    try:
        code = _wait(procs, logs)
        if not capture:
            return code
        out0.seek(0)
        logs[0].seek(0)
        return code, out0.read().decode(errors="replace"), logs[0].read().decode(errors="replace")
    finally:
        if out0 is not None:
            out0.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()


def _wait(procs: list[subprocess.Popen], logs) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            if failed != 0:  # rank 0 printed its own error; another rank's is in its log
                logs[failed].seek(0)
                tail = logs[failed].read().decode(errors="replace").strip().splitlines()[-5:]
                print(f"deltaserve: tensor-parallel rank {failed} failed:\n" + "\n".join(tail),
                      file=sys.stderr)
            return codes[failed]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def cli_command(argv: list[str]) -> list[str]:
    """This deltaserve command line as a subprocess command."""
    return [sys.executable, "-m", "deltaserve", *argv]


def _spawned(rank: int, fn, size: int, port: int, threads: int | None, args: tuple) -> None:
    os.environ.update(rank_env(rank, size, port, threads))
    fn(rank, *args)


def spawn(fn, size: int, *args, device: str = "cpu") -> None:
    """fn(rank, *args) in `size` fresh processes (torch.multiprocessing), joined; raises if any
    rank raised. fn must be importable (defined at a module's top level)."""
    import torch.multiprocessing as mp

    from deltaserve.distributed.group import cpu_threads_per_rank

    check_gpus(size, device)
    threads = cpu_threads_per_rank(size) if device == "cpu" else None
    mp.spawn(_spawned, args=(fn, size, free_port(), threads, args), nprocs=size, join=True)
