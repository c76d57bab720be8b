"""The collectives a sharded model calls: exact all-reduce and all-gather, and the compressed
all-reduce (16-bit transport of a row-parallel layer's partial sums).

Compressed: the partial sums [..., N] are scaled per tensor so the largest sum any rank can make
fits the 16-bit range (a MAX all-reduce of each rank's amax first: |sum| <= ranks * amax), cast,
summed, and scaled back. Unscaled FP16 overflows (a 110,677 activation > 65,504 turned the
recurrent state into NaN in llama.cpp's 27B run), so "none" scaling exists only to show that.
Counters per tensor class, on the device (no host sync, CUDA-graph safe): elements that
overflowed the transport, and non-finite values that came in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.errors import ConfigError

CLASSES = ("attn", "gdn", "ffn")  # o_proj, out_proj, down_proj
TRANSPORTS = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Compression:
    transport: str | None = None  # None = exact reductions; "fp16" | "bf16"
    classes: tuple[str, ...] = ("ffn",)  # which reductions travel compressed
    scaling: str = "dynamic"  # "dynamic" (per-tensor scale) | "none" (raw cast: can overflow)

    def __post_init__(self) -> None:
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ConfigError(f"compressed reductions: transport {self.transport!r} (choose "
                              f"{', '.join(TRANSPORTS)})")
        bad = set(self.classes) - set(CLASSES)
        if bad:
            raise ConfigError(f"compressed reductions: unknown classes {sorted(bad)} (choose "
                              f"{', '.join(CLASSES)})")
        if self.scaling not in ("dynamic", "none"):
            raise ConfigError(f"compressed reductions: scaling {self.scaling!r} (dynamic, none)")

    @classmethod
    def from_env(cls) -> Compression:
        from deltaserve.env import env

        e = env()
        classes = tuple(c.strip() for c in e.tp_compress_classes.split(",") if c.strip())
        return cls(e.tp_compress or None, classes, e.tp_compress_scaling)


class Comm:
    """The group's collectives for one model; counters [overflow, nonfinite] per class."""

    def __init__(self, world_size: int, device: torch.device, compression: Compression) -> None:
        self.world_size, self.compression = world_size, compression
        self.counters = {c: torch.zeros(2, dtype=torch.long, device=device) for c in CLASSES}
        self.calls = dict.fromkeys(CLASSES, 0)  # eager calls (graph replays are not counted)

    def compressed(self, cls: str) -> bool:
        c = self.compression
        return c.transport is not None and cls in c.classes

    def reducer(self, cls: str):
        """The callable a row-parallel Linear applies to its output (partial sums -> sums)."""
        return lambda y: self.all_reduce(y, cls)

    def all_reduce(self, y: torch.Tensor, cls: str = "exact") -> torch.Tensor:
        if cls in self.calls:
            self.calls[cls] += 1
        if cls in CLASSES and self.compressed(cls):
            return self._compressed(y, cls)
        y = y.contiguous()
        dist.all_reduce(y)
        return y

    def _compressed(self, y: torch.Tensor, cls: str) -> torch.Tensor:
        dtype = TRANSPORTS[self.compression.transport]
        x = y.float()
        finite = torch.isfinite(x)
        amax = torch.where(finite, x.abs(), 0.0).amax().reshape(1)
        bad = (~finite).sum().reshape(1)
        flags = torch.cat([amax, bad.float()])  # one collective: global amax, any non-finite
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if self.compression.scaling == "dynamic":
            # the sum of world_size values of |v| <= amax stays under half the range
            limit = torch.finfo(dtype).max / 2
            scale = limit / (flags[:1] * self.world_size).clamp_min(1e-30)
            scale = scale.clamp_max(1e30)  # all-zero partial sums: any finite scale is exact
        else:
            scale = torch.ones(1, device=x.device)
        q = (x * scale).to(dtype)
        dist.all_reduce(q)
        out = q.float() / scale
        # overflow is only the transport's doing when every rank's input was finite
        overflow = torch.where(flags[1] == 0, torch.isinf(q).sum(), 0)
        self.counters[cls].add_(torch.stack([overflow, bad[0]]))
        return out.to(y.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., C] on every rank -> [..., world_size * C], rank order along the last dim."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def report(self) -> dict[str, dict[str, int]]:
        """Counters per class (a collective: every rank must call it): overflowed elements of
        the reduced tensors (the same on every rank), non-finite inputs summed over ranks."""
        stacked = torch.stack([self.counters[c] for c in CLASSES])
        nonfinite = stacked[:, 1].contiguous()
        dist.all_reduce(nonfinite)
        rows = zip(CLASSES, stacked[:, 0].tolist(), nonfinite.tolist(), strict=True)
        return {c: {"calls": self.calls[c], "overflow": over, "nonfinite": bad,
                    "compressed": self.compressed(c)} for c, over, bad in rows}

    def reset(self) -> None:
        for c in CLASSES:
            self.counters[c].zero_()
            self.calls[c] = 0
