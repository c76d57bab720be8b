"""The model runner: turns a scheduler plan into one batched forward over the pools, stores the
prefix snapshots the forward captured, and returns the logits of the chunks that sample."""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import numpy as np
import torch

from deltaserve.cache.batch import SeqChunk, StepBatch, host_to_device
from deltaserve.cache.manager import CacheManager
from deltaserve.engine.request import ImageInputs
from deltaserve.engine.scheduler import StepPlan
from deltaserve.env import env
from deltaserve.ops.attention import SPLIT_MIN_QUERIES, warm_split_attention
from deltaserve.ops.gdn_prefill import SCAN_MAX_TOKENS


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
        self.are_tokens = logits.dtype == torch.int64  # the greedy head's output: [rows] tokens
        # per chunk: all logits finite; a device tensor, read with the sampler's own host copy
        self._finite = None if self.are_tokens else torch.isfinite(logits).all(dim=-1)
        self._failed: frozenset[str] | None = None if self._finite is not None else frozenset()

    def failed_with(self, head: torch.Tensor | None) -> tuple[frozenset[str], list[int]]:
        """(requests whose logits went non-finite, head.tolist()) in one device-to-host copy."""
        if self._failed is not None:
            return self._failed, [] if head is None else head.tolist()
        both = self._finite.long() if head is None else torch.cat([head, self._finite.long()])
        values = both.tolist()
        cut = len(values) - len(self.chunk_rids)
        self._failed = frozenset(rid for rid, ok in zip(self.chunk_rids, values[cut:], strict=True)
                                 if not ok)
        return self._failed, values[:cut]

    def finite_flags(self) -> torch.Tensor | None:
        """[chunks] bool on the device, all logits of the chunk finite (None for head tokens)."""
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


class ModelRunner:
    def __init__(self, model, cache: CacheManager, greedy_head: bool = False,
                 max_prefill_chunk: int = 0) -> None:
        self.model, self.cache, self.greedy_head = model, cache, greedy_head
        if max_prefill_chunk > SCAN_MAX_TOKENS:
            _tune_prefill_scan(model, max_prefill_chunk)
        if max_prefill_chunk >= SPLIT_MIN_QUERIES and model.cfg.num_attention_heads:
            cfg = model.cfg  # chunks behind cached keys may take the split: load cuDNN now
            warm_split_attention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                 model.act_dtype, model.device)
        self.spec_rollback = "recompute"  # SpeculativeConfig.rollback, for steps with verify chunks
        self.graphs = None
        # pipeline stages decode eagerly: their send/recv/broadcast are not captured in graphs
        if model.device.type == "cuda" and env().cuda_graphs and getattr(model, "pp", None) is None:
            from deltaserve.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(model, cache, cache.spare_slot, cache.spare_block,
                                       greedy_head)
        self.prefill_graphs = None  # short single-chunk prefill steps (engine/prefill_graph.py)
        if self.graphs is not None:
            from deltaserve.engine import prefill_graph

            if prefill_graph.usable(model):
                self.prefill_graphs = prefill_graph.PrefillGraphs(
                    model, cache, cache.spare_slot, cache.spare_block, greedy_head,
                    max_prefill_chunk or None)

    def execute(self, plan: StepPlan, all_ids: dict[str, list[int]],
                feed: Feed | None = None,
                images: Mapping[str, ImageInputs] | None = None) -> StepLogits:
        """all_ids: every multi-token chunk's request's key ids (Request.key_ids: prefix keys
        are hashes of them). feed (decode-only plans): (device tokens, rows of this plan, rows of
        those tokens): those rows' input ids come from the device, never read back
        (engine/overlap.py). images: the planned requests that have image placeholders.
        Returns request id -> next-token logits [vocab] fp32 for the chunks with sample=True."""
        images = images or {}
        decodes = all(len(c.token_ids) == 1 for c in plan.chunks)
        # a prefill chunk taking a prefill graph injects its image rows per piece instead
        inject = _injection(plan, images, self.model.device) if decodes else None
        if (self.graphs is not None and decodes and inject is None
                and self.graphs.supports(len(plan.chunks))):
            logits = self.graphs.run([max(c.token_ids[0], 0) for c in plan.chunks],
                                     [c.slot for c in plan.chunks],
                                     [c.start_pos for c in plan.chunks],
                                     [self.cache.block_table(c.request_id) for c in plan.chunks],
                                     feed)
            return _step_logits(logits, plan)
        chunks, ids = [], []
        for c in plan.chunks:
            snap_at = ()
            if len(c.token_ids) > 1 and not c.num_draft:  # never a state that saw drafts
                snap_at = self.cache.snapshot_positions(
                    c.request_id, all_ids[c.request_id], c.start_pos, c.start_pos + len(c.token_ids))
            chunks.append(SeqChunk(c.slot, c.start_pos, len(c.token_ids),
                                   self.cache.block_table(c.request_id), snap_at,
                                   c.num_draft > 0))
            ids.extend(c.token_ids)
        if (self.prefill_graphs is not None and len(chunks) == 1 and feed is None
                and not self.model.keep_hidden):
            pieces = self.prefill_graphs.pieces(chunks[0])
            if pieces is not None:
                image = images.get(plan.chunks[0].request_id)
                out = self._graph_prefill(plan, chunks[0], pieces, ids, all_ids, image)
                if out is not None:
                    return out
        device = self.model.device
        if not decodes:
            inject = _injection(plan, images, device)
        batch = StepBatch.build(chunks, self.cache.states, self.cache.kv, device)
        if batch.verify:
            from deltaserve.spec.rollback import VerifyRecord

            batch.spec = VerifyRecord(batch, self.spec_rollback)
        ids_t = host_to_device(np.array([max(t, 0) for t in ids] if feed else ids, np.int64),
                               device)
        if feed is not None:  # decode-only: chunk i is token i
            fed_ids(ids_t, feed)
        batch.native_rows = not batch.prefill  # decode rows' bits independent of the batch
        batch.scratch = self.cache.scratch
        logits = self.model.forward_batch(ids_t, batch, greedy=self.greedy_head, inject=inject)
        out = _step_logits(logits, plan)
        out.verify_record = batch.spec
        pending = {i: snaps for i, snaps in batch.snapshots.items() if snaps}
        for i, snaps in pending.items():  # (out.failed costs a host copy only when there are some)
            rid = plan.chunks[i].request_id
            if rid not in out.failed:  # a state that produced NaN/inf is never shared
                self.cache.store_snapshots(rid, all_ids[rid], snaps)
        return out

    def _graph_prefill(self, plan: StepPlan, chunk: SeqChunk, pieces: list[SeqChunk],
                       ids: list[int], all_ids: dict[str, list[int]],
                       image: ImageInputs | None) -> StepLogits | None:
        """One sequence's chunk as captured prefill graphs, piece by piece; the prefix snapshot at
        the end of a piece is the slot's state there. None (nothing run) when a graph it needs
        could not be captured."""
        graphs, snaps, out = self.prefill_graphs, {}, None
        injects = [_piece_injection(image, piece, self.model.device) if image else None
                   for piece in pieces]
        keys = [graphs.key(p, i is not None) for p, i in zip(pieces, injects, strict=True)]
        if not graphs.ready(keys):
            return None
        for piece, inject, key in zip(pieces, injects, keys, strict=True):
            lo = piece.start_pos - chunk.start_pos
            out = graphs.run(ids[lo : lo + piece.num_tokens], piece, inject)
            if piece.snapshot_at:  # a long fresh chunk: the graph kept every grid position's
                snaps.update(graphs.snapshots(key, piece.snapshot_at))
            elif piece.end_pos in chunk.snapshot_at:
                snaps[piece.end_pos] = dict(enumerate(self.cache.states.snapshot(chunk.slot)))
        logits = _step_logits(out, plan)
        rid = plan.chunks[0].request_id
        if snaps and rid not in logits.failed:  # a state that produced NaN/inf is never shared
            self.cache.store_snapshots(rid, all_ids[rid], snaps)
        return logits


def _tune_prefill_scan(model, max_prefill_chunk: int) -> None:
    """fla's stages (the GDN scan of chunks over SCAN_MAX_TOKENS) picked their launch configs at a
    prefill length: ops/fla_scan.tune, once per process, before the first request."""
    from deltaserve.ops import fla_scan
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, case_at

    cfg = model.cfg
    if not cfg.linear_num_value_heads or model.device.type != "cuda" or fla_scan.tuned is not None:
        return
    case = case_at(max_prefill_chunk, model.act_dtype, model.device, cfg)
    if GDN_PREFILL.choose(case).name.startswith("fla_stages"):
        fla_scan.tuned = max_prefill_chunk
        fla_scan.tune(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                      cfg.linear_key_head_dim, cfg.linear_value_head_dim, max_prefill_chunk,
                      model.act_dtype, model.device)


def _placeholders(image: ImageInputs, start: int, end: int) -> tuple[list[int], torch.Tensor]:
    """(positions in [start, end) relative to start, their embeddings [R,N]) of an image's
    placeholders."""
    lo = bisect.bisect_left(image.positions, start)
    hi = bisect.bisect_left(image.positions, end)
    return [p - start for p in image.positions[lo:hi]], image.embeds[lo:hi]


def _piece_injection(image: ImageInputs, piece: SeqChunk, device: torch.device):
    """(rows of the piece [R], embeddings [R,N]) of the image placeholders it covers, or None."""
    rows, embeds = _placeholders(image, piece.start_pos, piece.end_pos)
    return (host_to_device(np.array(rows, np.int64), device), embeds) if rows else None


def _injection(plan: StepPlan, images: Mapping[str, ImageInputs], device: torch.device):
    """(rows of the step [R], embeddings [R,N]) for the image placeholders the plan's chunks
    cover, or None: a chunk [start, end) takes the rows of its request's positions in it."""
    rows, embeds, offset = [], [], 0
    for c in plan.chunks:
        image = images.get(c.request_id)
        if image is not None:
            at, rows_embeds = _placeholders(image, c.start_pos, c.start_pos + len(c.token_ids))
            rows += [offset + r for r in at]
            if at:
                embeds.append(rows_embeds)
        offset += len(c.token_ids)
    if not rows:
        return None
    return host_to_device(np.array(rows, np.int64), device), torch.cat(embeds)


# (tokens [R] int64 on the device, destination rows, source rows of tokens)
Feed = tuple[torch.Tensor, list[int], list[int]]


def fed_ids(ids: torch.Tensor, feed: Feed) -> None:
    """ids[dst] = tokens[src] on the device (a plain copy when the rows line up)."""
    tokens, dst, src = feed
    if dst == src == list(range(len(dst))):
        ids[: len(dst)].copy_(tokens[: len(dst)])
        return
    index = host_to_device(np.array([*dst, *src], np.int64), ids.device)
    ids.index_copy_(0, index[: len(dst)], tokens.index_select(0, index[len(dst):]))



def _step_logits(logits: torch.Tensor, plan: StepPlan) -> StepLogits:
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
