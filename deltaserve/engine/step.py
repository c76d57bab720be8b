"""One step as the executors see it (`Step`: the scheduler's plan with its chunks, ids, images and
batch built on first use) and what every executor returns (`StepLogits`, left on the device until
the engine samples, or overlap.resolve reads it a step later)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.cache.batch import Injection, SeqChunk, StepBatch, host_to_device
from deltaserve.engine.request import ImageInputs
from deltaserve.engine.scheduler import StepPlan

# (tokens [R] int64 on the device, destination rows, source rows of tokens)
Feed = tuple[torch.Tensor, list[int], list[int]]


class StepLogits(Mapping[str, torch.Tensor]):
    """Request id -> next-token logits [vocab], over one [rows, vocab] tensor (so the sampler
    can take every greedy row's argmax in one op, without stacking copies of the rows)."""

    def __init__(self, logits: torch.Tensor, rows: dict[str, int], chunk_rids: list[str],
                 verify_rows: dict[str, tuple[int, int]] | None = None) -> None:
        self.tensor, self.rows, self.chunk_rids = logits, rows, chunk_rids
        # speculative verify chunks (spec/verify.py): request id -> (first row, rows); chunk_rids
        # then names every row, so one non-finite row fails its request
        self.verify_rows = verify_rows or {}
        self.verify_record = None  # spec.rollback.VerifyRecord of the step, if it verified
        self.hidden = None  # [T,N] every row's final-normed hidden, when the runner keeps them
        self.are_tokens = logits.dtype == torch.int64  # the greedy head's output: [rows] tokens
        # per chunk: all logits finite; a device tensor, read with the sampler's own host copy.
        # Made on first use (before the next forward reuses the buffer): a processed overlapped
        # step takes its flags from its pick instead (overlap.finish), two launches fewer
        self._finite: torch.Tensor | None = None
        self._failed: frozenset[str] | None = frozenset() if self.are_tokens else None

    def failed_with(self, head: torch.Tensor | None) -> tuple[frozenset[str], list[int]]:
        """(requests whose logits went non-finite, head.tolist()) in one device-to-host copy."""
        if self._failed is not None:
            return self._failed, [] if head is None else head.tolist()
        self.finite_flags()
        both = self._finite.long() if head is None else torch.cat([head, self._finite.long()])
        values = both.tolist()
        cut = len(values) - len(self.chunk_rids)
        self._failed = frozenset(rid for rid, ok in zip(self.chunk_rids, values[cut:], strict=True)
                                 if not ok)
        return self._failed, values[:cut]

    def finite_flags(self) -> torch.Tensor | None:
        """[chunks] bool on the device, all logits of the chunk finite (None for head tokens)."""
        if self._finite is None and not self.are_tokens:
            self._finite = torch.isfinite(self.tensor).all(dim=-1)
        return self._finite

    @property
    def failed(self) -> frozenset[str]:
        return self.failed_with(None)[0]

    def __getitem__(self, rid: str) -> torch.Tensor:
        return self.tensor[self.rows[rid]]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def step_logits(logits: torch.Tensor, plan: StepPlan) -> StepLogits:
    """The executors' output rows [rows, vocab] (or tokens) named by the plan's requests."""
    if not any(c.num_draft for c in plan.chunks):
        rows = {c.request_id: i for i, c in enumerate(plan.chunks) if c.sample}
        return StepLogits(logits, rows, [c.request_id for c in plan.chunks])
    rows, rids, verify, at = {}, [], {}, 0  # a verify chunk has a logits row per token
    for c in plan.chunks:
        num = 1 + c.num_draft
        if c.num_draft:
            verify[c.request_id] = (at, num)
        elif c.sample:
            rows[c.request_id] = at
        rids += [c.request_id] * num
        at += num
    return StepLogits(logits, rows, rids, verify)


@dataclass(slots=True)
class Step:
    """plan with what the executors need, each part built once, when first asked for. all_ids:
    every multi-token chunk's request's key ids (prefix keys hash them); feed (decode-only
    plans): those rows' input ids come from the device (engine/overlap.py); images: the planned
    requests with image placeholders; rollback: SpeculativeConfig.rollback for verify chunks."""

    plan: StepPlan
    all_ids: Mapping[str, list[int]]
    feed: Feed | None
    images: Mapping[str, ImageInputs]
    cache: object  # cache/manager.CacheManager
    device: torch.device
    rollback: str = "recompute"
    decodes: bool = field(init=False)
    _chunks: list[SeqChunk] | None = None
    _batch: StepBatch | None = None
    _injection: tuple | None = None  # (injection or None,) once computed

    def __post_init__(self) -> None:
        self.decodes = all(len(c.token_ids) == 1 for c in self.plan.chunks)

    def chunks(self) -> list[SeqChunk]:
        """The plan's chunks with their KV tables and wanted prefix snapshots."""
        if self._chunks is None:
            cache, self._chunks = self.cache, []
            for c in self.plan.chunks:
                snap_at = ()
                if len(c.token_ids) > 1 and not c.num_draft:  # never a state that saw drafts
                    snap_at = cache.snapshot_positions(c.request_id, self.all_ids[c.request_id],
                                                       c.start_pos, c.start_pos + len(c.token_ids))
                self._chunks.append(SeqChunk(c.slot, c.start_pos, len(c.token_ids),
                                             cache.block_table(c.request_id), snap_at,
                                             c.num_draft > 0))
        return self._chunks

    def ids(self) -> list[int]:
        return [t for c in self.plan.chunks for t in c.token_ids]

    def injection(self) -> Injection | None:
        """(rows of the step [R], embeddings [R,N]) for the image placeholders the plan's chunks
        cover, or None: a chunk [start, end) takes the rows of its request's positions in it
        (computed once: several executors ask)."""
        if self._injection is None:
            self._injection = (self._build_injection(),)
        return self._injection[0]

    def _build_injection(self) -> Injection | None:
        if not self.images:
            return None
        rows, embeds, offset = [], [], 0
        for c in self.plan.chunks:
            image = self.images.get(c.request_id)
            if image is not None:
                at, part = placeholders(image, c.start_pos, c.start_pos + len(c.token_ids))
                rows += [offset + r for r in at]
                if at:
                    embeds.append(part)
            offset += len(c.token_ids)
        if not rows:
            return None
        return host_to_device(np.array(rows, np.int64), self.device), torch.cat(embeds)

    def batch(self) -> StepBatch:
        """The StepBatch over the engine's pools (the verify record, the step's kind and scratch
        arena on it)."""
        if self._batch is None:
            batch = StepBatch.build(self.chunks(), self.cache.states, self.cache.kv, self.device)
            if batch.verify:
                from deltaserve.spec.rollback import VerifyRecord

                batch.spec = VerifyRecord(batch, self.rollback)
            batch.native_rows = not batch.prefill  # decode rows' bits independent of the batch
            batch.scratch = self.cache.scratch
            self._batch = batch
        return self._batch

    def ids_tensor(self) -> torch.Tensor:
        """The step's input ids [T] on the device (fed rows taken from the device)."""
        out = host_to_device(np.array(self.ids(), np.int64), self.device)
        if self.feed is not None:  # decode-only: chunk i is token i; the unread ones are fed
            fed_ids(out, self.feed)
        return out

    def store_snapshots(self, out: StepLogits, snaps: dict[int, dict]) -> None:
        """Chunk i's prefix snapshots (snaps[i]: position -> layer -> (window, state)) into the
        prefix cache, unless its request's logits went non-finite (out.failed costs a host copy
        only when there are some)."""
        for i, per_chunk in snaps.items():
            if not per_chunk:
                continue
            rid = self.plan.chunks[i].request_id
            if rid not in out.failed:  # a state that produced NaN/inf is never shared
                self.cache.store_snapshots(rid, self.all_ids[rid], per_chunk)


def placeholders(image: ImageInputs, start: int, end: int) -> tuple[list[int], torch.Tensor]:
    """(positions in [start, end) relative to start, their embeddings [R,N]) of an image's
    placeholders."""
    lo = bisect.bisect_left(image.positions, start)
    hi = bisect.bisect_left(image.positions, end)
    return [p - start for p in image.positions[lo:hi]], image.embeds[lo:hi]


def fed_ids(ids: torch.Tensor, feed: Feed) -> None:
    """ids[dst] = tokens[src] on the device (a plain copy when the rows line up)."""
    tokens, dst, src = feed
    if dst == src == list(range(len(dst))):
        ids[: len(dst)].copy_(tokens[: len(dst)])
        return
    index = host_to_device(np.array([*dst, *src], np.int64), ids.device)
    ids.index_copy_(0, index[: len(dst)], tokens.index_select(0, index[len(dst):]))
