"""Pipeline (layer-split) parallelism: rank r of N holds a contiguous range of decoder layers
(rank 0 also the embedding, the last rank the head; a tied head is the embedding matrix, so the
last rank loads it too), only those layers' weights and only their cache pools.

A step: rank 0 embeds and runs its layers, sends the residual stream [T, N] to rank 1
(point-to-point send/recv), ..., the last rank applies the final norm and head and broadcasts the
step's logits (or the greedy head's tokens) to every rank, so every rank's scheduler and sampler
(SPMD: all run the same engine on the same requests) advance identically. No micro-batches: one
stage computes while the others wait, so N stages give the memory of N devices, not their speed.

Each stage builds its model from a local config (its layers' types, renumbered from 0), so the
layers, pools and kernels run it unchanged; checkpoint names are renumbered as they are indexed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.config import TextConfig
from deltaserve.distributed.group import TPGroup, init_group
from deltaserve.errors import ConfigError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def even_split(num_layers: int, size: int) -> tuple[int, ...]:
    """num_layers over size stages as evenly as possible; when it does not divide, the earlier
    stages take one more (the last stage also runs the vocabulary head)."""
    base, extra = divmod(num_layers, size)
    return tuple(base + (r < extra) for r in range(size))


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """'10,14' -> (10, 14); None or '' -> None (the even split)."""
    if not text:
        return None
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ConfigError(f"--pp-layers takes layer counts separated by commas (e.g. 10,14), "
                          f"got {text!r}") from None


@dataclass(frozen=True, slots=True)
class PPPlan:
    """Rank `rank` of `size` stages; layer_split[r] = decoder layers of stage r (in order)."""

    num_layers: int
    rank: int
    size: int
    layer_split: tuple[int, ...]

    def __post_init__(self) -> None:
        split, n = self.layer_split, self.num_layers
        if len(split) != self.size:
            raise ConfigError(f"the layer split {list(split)} has {len(split)} stages but the "
                              f"pipeline has {self.size}")
        if min(split) < 1:
            raise ConfigError(f"the layer split {list(split)} gives a stage no layers (every "
                              "stage needs at least one)")
        if sum(split) != n:
            raise ConfigError(f"the layer split {list(split)} covers {sum(split)} layers but the "
                              f"model has {n} (the counts must add up to {n})")

    @classmethod
    def build(cls, num_layers: int, rank: int, size: int,
              layer_split: tuple[int, ...] | None = None) -> PPPlan:
        if size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {size}")
        if size > num_layers:
            raise ConfigError(f"{size} pipeline stages but the model has only {num_layers} layers")
        split = even_split(num_layers, size) if layer_split is None else tuple(layer_split)
        return cls(num_layers, rank, size, split)

    @property
    def start(self) -> int:
        return sum(self.layer_split[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.layer_split[self.rank]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds_embedding(self, tied: bool) -> bool:
        return self.is_first or (tied and self.is_last)

    def local_config(self, cfg: TextConfig) -> TextConfig:
        types = cfg.layer_types[self.start : self.stop]
        return dataclasses.replace(cfg, num_hidden_layers=len(types), layer_types=types)

    def local_name(self, name: str, tied: bool) -> str | None:
        """Checkpoint name (ours) -> this stage's name for it, or None if the stage lacks it."""
        m = _LAYER.match(name)
        if m is not None:
            layer = int(m.group(1))
            inside = self.start <= layer < self.stop
            return f"model.layers.{layer - self.start}.{m.group(2)}" if inside else None
        if name.startswith("model.embed_tokens."):
            return name if self.holds_embedding(tied) else None
        if name.startswith("lm_head."):
            return name if self.is_last else None
        return name  # the final norm (N weights) stays on every stage: model.device reads it

    def local_index(self, index, tied: bool):
        """The checkpoint's TensorIndex seen by this stage (its tensors, local names)."""
        locations, headers = {}, {}
        for name, loc in index.locations.items():
            ours = self.local_name(name, tied)
            if ours is not None:
                locations[ours], headers[ours] = loc, index.headers[name]
        return type(index)(locations, headers)

    def drop_ends(self, model) -> None:
        """Remove the embedding / untied head a stage does not run (built on meta: free)."""
        if not self.holds_embedding(model.cfg.tie_word_embeddings):
            model.model.embed_tokens = None
        if not self.is_last and not model.cfg.tie_word_embeddings:
            model.lm_head = None

    def tag(self) -> str:
        """What this stage adds to its model fingerprint."""
        return f"/pp{self.rank}of{self.size}:{self.start}-{self.stop}"


class PPStage:
    """model.pp: the stage's communication (the default process group, one rank per stage)."""

    def __init__(self, plan: PPPlan, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.is_first, self.is_last = plan.is_first, plan.is_last
        self.sent_bytes = 0  # hidden states sent + results broadcast by this rank

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's residual stream (every rank knows T from the step's input ids)."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, src=self.plan.rank - 1)
        return x

    def send(self, x: torch.Tensor) -> None:
        x = x.contiguous()
        self.sent_bytes += x.numel() * x.element_size()
        dist.send(x, dst=self.plan.rank + 1)

    def share(self, out: torch.Tensor | None, shape: tuple[int, ...],
              dtype: torch.dtype) -> torch.Tensor:
        """The last stage's output (logits or greedy tokens) on every rank: out there, None on
        the others (which pass the shape and dtype they expect)."""
        if self.plan.size == 1:
            return out
        if self.is_last:
            out = out.contiguous()
            self.sent_bytes += out.numel() * out.element_size()
        else:
            out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(out, src=self.plan.size - 1)
        return out

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value: pool sizes the schedulers must share (each stage
        plans its KV blocks for its own attention layers and its own device's memory)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


@dataclass(frozen=True, slots=True)
class PPLaunch:
    """What LLM hands the loader: this rank's group and the requested split (None = even)."""

    group: TPGroup  # the process group's rank and world size (one rank per stage)
    layer_split: tuple[int, ...] | None = None

    def plan(self, cfg: TextConfig) -> PPPlan:
        return PPPlan.build(cfg.num_hidden_layers, self.group.rank, self.group.world_size,
                            self.layer_split)


def init_pp(size: int, device: str, layer_split: tuple[int, ...] | None = None,
            tp_size: int | None = None) -> tuple[PPLaunch | None, str]:
    """LLM's entry for pipeline_parallel_size: (None, device) for one stage, else the launch."""
    if size != 1 and tp_size not in (None, 1):
        raise ConfigError(f"tensor_parallel_size={tp_size} with pipeline_parallel_size={size}: "
                          "mixing tensor and pipeline parallelism is not supported (pick one)")
    if size < 1:
        raise ConfigError(f"pipeline_parallel_size must be >= 1, got {size}")
    if size == 1:
        if layer_split is not None:
            raise ConfigError(f"layer_split {list(layer_split)} needs pipeline_parallel_size="
                              f"{len(layer_split)} (a split applies to 2 or more stages)")
        return None, device
    group, device = init_group(size, device, what="pipeline_parallel_size")
    return PPLaunch(group, layer_split), device

