"""Start N ranks on this machine the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): `deltaserve generate|bench --tp N` re-runs its own
command line in N processes; `spawn` runs a picklable function in N processes (tests, scripts).
Rank 0's output is the command's; the other ranks' stdout is dropped and their stderr shown only
if they fail."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
        # their own session: a terminal's Ctrl-C reaches the launcher alone, which asks rank 0
        # to stop (a server then ends the others itself)
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err,
                                      start_new_session=True, preexec_fn=_die_with_parent))
    try:
        with _forwarded_signals(procs[0]) as caught:
            code = _wait(procs, logs)
            if caught:  # a stop asked for: the others end on their own (a server tells them)
                code = _stopped(procs, logs, 128 + caught[0])
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
                _report(failed, logs)
            return codes[failed]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


@contextlib.contextmanager
def _forwarded_signals(first: subprocess.Popen):
    """While the ranks run: SIGINT or SIGTERM here sends SIGTERM to rank 0 (a server shuts down
    gracefully and then stops the others; any other command dies and the others follow); a
    second signal stops every rank at once. Yields the signals caught."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def handle(signum, _frame):
        caught.append(signum)
        if len(caught) > 1:
            raise KeyboardInterrupt  # run_ranks's finally kills every rank
        if first.poll() is None:
            first.send_signal(signal.SIGTERM)

    old = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    """In each rank before exec (Linux): SIGTERM when the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stopped(procs: list[subprocess.Popen], logs, code: int, grace_s: float = 30.0) -> int:
    """After a forwarded signal: wait for every rank's exit (up to grace_s; then run_ranks kills
    them), name a rank that did not end cleanly, and return `code` (a stop, not a failure)."""
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank, p in enumerate(procs[1:], start=1):
        if p.poll() not in (None, 0):
            _report(rank, logs)
    return code


def _report(rank: int, logs) -> None:
    logs[rank].seek(0)
    tail = logs[rank].read().decode(errors="replace").strip().splitlines()[-5:]
    print(f"deltaserve: tensor-parallel rank {rank} failed:\n" + "\n".join(tail),
          file=sys.stderr)


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
