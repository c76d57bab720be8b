"""Decode steps replayed from CUDA graphs: a step whose chunks are all single-token decodes runs
as one graph launch instead of ~700 kernel launches from Python.

One graph per (batch bucket, KV-width bucket): the batch is padded to a power of two with rows
that read and write a spare state slot and a spare KV block (so they disturb no sequence), and the
block tables are padded to a power of two of blocks (the padded keys are masked out).
"""

from __future__ import annotations

import torch

from deltaserve.cache.batch import StepBatch
from deltaserve.engine.step import Step, StepLogits, fed_ids, step_logits

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
FIELDS = ("ids", "slots", "positions", "kv_blocks", "kv_rows", "lengths")  # [B] each


def width_bucket(num_blocks: int) -> int:
    """The KV-table width, in blocks, a graph is captured for: a power of two, at least 4."""
    return 1 << max(2, (num_blocks - 1).bit_length())


def capture(fn, pool, warmups: int = 2):
    """(graph, fn()'s output inside it): fn run `warmups` times on a side stream first, so lazy
    initialisation (cuBLAS handles, Triton compiles, memos) happens outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def _bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    def __init__(self, model, cache, spare_slot: int, spare_block: int,
                 greedy: bool = False) -> None:
        self.model, self.cache, self.greedy = model, cache, greedy
        self.spare_slot, self.spare_block = spare_slot, spare_block
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def supports(self, num_seqs: int) -> bool:
        return _bucket(num_seqs, BATCH_BUCKETS) is not None

    def execute_step(self, step: Step) -> StepLogits | None:
        """The executor (engine/executors.py): all-decode steps of a captured batch size without
        image rows; None for any other."""
        chunks = step.plan.chunks
        if not step.decodes or not self.supports(len(chunks)) or step.injection() is not None:
            return None
        logits = self.run([c.token_ids[0] for c in chunks], [c.slot for c in chunks],
                          [c.start_pos for c in chunks],
                          [self.cache.block_table(c.request_id) for c in chunks], step.feed)
        return step_logits(logits, step.plan)

    def run(self, ids: list[int], slots: list[int], positions: list[int],
            tables: list[tuple[int, ...]], feed=None) -> torch.Tensor:
        """Logits [len(ids), vocab] fp32 of one all-decode step, or its tokens [len(ids)] with the
        greedy head (a view of a static buffer). feed: step.Feed, ids taken on the device."""
        num = len(ids)
        bsz = _bucket(num, BATCH_BUCKETS)
        width = width_bucket(max(len(t) for t in tables))
        key = (bsz, width)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bsz, width)
        graph, static, logits = self.graphs[key]
        block_len = self.cache.kv.block_len
        pad = bsz - num
        padded = [list(t) + [self.spare_block] * (width - len(t)) for t in tables]
        padded += [[self.spare_block] * width] * pad
        host = [*ids, *[0] * pad, *slots, *[self.spare_slot] * pad, *positions, *[0] * pad,
                *[t[p // block_len] for t, p in zip(tables, positions, strict=True)],
                *[self.spare_block] * pad, *[p % block_len for p in positions], *[0] * pad,
                *[p + 1 for p in positions], *[1] * pad, *[b for row in padded for b in row]]
        # one host-to-device copy for every input (in FIELDS order, then the tables)
        static["packed"].copy_(torch.tensor(host, dtype=torch.long), non_blocking=True)
        if feed is not None:
            fed_ids(static["ids"], feed)
        graph.replay()
        return logits[:num]

    def _batch(self, static: dict, bsz: int) -> StepBatch:
        """A StepBatch whose tensors are the graph's static inputs (decode-only layout)."""
        from deltaserve.cache.batch import SeqChunk

        chunks = [SeqChunk(self.spare_slot, 0, 1, (self.spare_block,)) for _ in range(bsz)]
        batch = StepBatch(chunks, self.cache.states, self.cache.kv, scratch=self.cache.scratch)
        batch.offsets = list(range(bsz))
        batch.decode = list(range(bsz))
        batch.positions, batch.kv_blocks = static["positions"], static["kv_blocks"]
        batch.kv_rows, batch.decode_slots = static["kv_rows"], static["slots"]
        batch.decode_tables, batch.decode_lengths = static["tables"], static["lengths"]
        return batch

    def _capture(self, bsz: int, width: int):
        device = self.model.device
        packed = torch.empty((len(FIELDS) + width) * bsz, dtype=torch.long, device=device)
        static = {name: packed[i * bsz : (i + 1) * bsz] for i, name in enumerate(FIELDS)}
        static["tables"] = packed[len(FIELDS) * bsz :].view(bsz, width)
        static["packed"] = packed
        for name, value in (("ids", 0), ("slots", self.spare_slot), ("positions", 0),
                            ("kv_blocks", self.spare_block), ("kv_rows", 0), ("lengths", 1),
                            ("tables", self.spare_block)):
            static[name].fill_(value)
        # masks and the like are computed inside the graph from the static lengths
        graph, logits = capture(lambda: self.model.forward_batch(
            static["ids"], self._batch(static, bsz), greedy=self.greedy), self.pool)
        return graph, static, logits
