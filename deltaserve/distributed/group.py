"""The tensor-parallel process group: one per process, from torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; our own launcher sets the same variables). NCCL on CUDA
devices, gloo on CPU. Every rank runs the same program (SPMD) and must see the same random stream,
so the group's start also seeds torch identically on every rank."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.errors import ConfigError

LAUNCH_VARS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    world_size: int
    local_rank: int  # index among this machine's workers: its GPU on CUDA
    backend: str  # "nccl" | "gloo"

    @property
    def is_first(self) -> bool:
        """Rank 0 speaks for the group (prints, writes records)."""
        return self.rank == 0


def launched() -> bool:
    """Whether this process was started by torchrun (or our launcher) as one rank of a group."""
    return all(v in os.environ for v in LAUNCH_VARS)


def launch_world_size() -> int:
    """WORLD_SIZE of the launch (1 outside one): what tensor_parallel_size=None means."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def init_group(size: int, device: str, what: str = "tensor_parallel_size"
               ) -> tuple[TPGroup, str]:
    """Join (or reuse) the default process group of `size` ranks; returns it and this rank's
    device ("cuda" becomes "cuda:LOCAL_RANK", made current). `what` names the size in errors
    (pipeline parallelism uses the same group of one rank per stage)."""
    flag = "--pp" if what.startswith("pipeline") else "--tp"
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"tensor parallelism runs on cpu (gloo) or cuda (nccl), not {device}")
    if not dist.is_initialized():
        if not launched():
            raise ConfigError(
                f"{what}={size} needs {size} processes: start them with "
                f"`torchrun --nproc-per-node {size} ...` or `deltaserve generate {flag} {size}`")
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ConfigError(f"{what}={size} but the launch has {world} processes")
        _check_devices(dev, size)
        if backend == "nccl":  # bind the GPU first: NCCL's communicator belongs to it
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method="env://")
    world = dist.get_world_size()
    if world != size:
        raise ConfigError(f"{what}={size} but the process group has {world} ranks")
    got = dist.get_backend()
    if got != backend:
        raise ConfigError(f"the process group runs {got} but device {device} needs {backend}")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    group = TPGroup(dist.get_rank(), world, local, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    _same_seed(dev if dev.type == "cuda" else torch.device("cpu"))
    return group, device


def _check_devices(dev: torch.device, size: int) -> None:
    if dev.type != "cuda":
        return
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if per_host > have:
        raise ConfigError(f"{per_host} tensor-parallel ranks on this machine but it has {have} "
                          "CUDA GPU(s)")


def _same_seed(device: torch.device) -> None:
    """Rank 0 draws a seed and every rank seeds torch with it: a request without a seed samples
    the same tokens on every rank (each rank runs its own sampler on identical logits)."""
    seed = torch.randint(0, 2**62, (1,), dtype=torch.long).to(device)
    dist.broadcast(seed, src=0)
    torch.manual_seed(int(seed.item()))


def cpu_threads_per_rank(size: int) -> int:
    """CPU workers share the cores: each takes its part, so they do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // size)


def init_tp(size: int | None, device: str) -> tuple[TPGroup | None, str]:
    """LLM's entry: size None = the launch's world size (1 outside torchrun or our launcher).
    Returns (None, device) for a single process, else init_group's answer."""
    size = launch_world_size() if size is None else size
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return None, device
    return init_group(size, device)


def tag(group: TPGroup | None) -> str:
    """What a rank adds to its model fingerprint: its shard's state differs from another's."""
    return "" if group is None else f"/tp{group.rank}of{group.world_size}"
