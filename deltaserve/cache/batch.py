"""One forward step over many sequences: which tokens belong to whom, where their state and KV
live, and where prefix snapshots are wanted. Built by the model runner, read by every layer.

The step's tokens are one flat run [T] (chunk after chunk), so every projection and MLP is a
single GEMM over all sequences; only the token mixers (GDN scan, attention) look at chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.cache.pools import KVPool, StatePool


@dataclass(frozen=True, slots=True)
class SeqChunk:
    slot: int  # state-pool slot of the sequence
    start_pos: int  # absolute position of the chunk's first token
    num_tokens: int
    block_table: tuple[int, ...]  # KV blocks covering positions [0, start_pos + num_tokens)
    snapshot_at: tuple[int, ...] = ()  # positions in (start_pos, end] whose GDN state is wanted
    # speculative drafts under verification (spec/): every row attends and steps the GDN state as
    # a decode row does, and every row gets logits
    verify: bool = False

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


Injection = tuple[torch.Tensor, torch.Tensor]  # (rows [R] int64, input embeddings [R,N])

SNAP_GRID = 64  # fla's chunk and the finest prefix-snapshot granularity (cache/manager.py)


@dataclass(frozen=True, slots=True)
class GraphChunk:
    """One sequence's chunk of real_len tokens padded to T rows, described on the device only."""

    slot: torch.Tensor  # [1] int64 state-pool slot
    real_len: torch.Tensor  # [1] int64 tokens that are real (rows past it are padding)
    num_rows: int  # T
    # the chunk starts its sequence (position 0): attention reads only the chunk's own K/V
    # through the causal prefill kernel; else every row attends as a decode row over its table
    fresh: bool = False
    # a fresh chunk that keeps prefix snapshots: each GDN layer writes its state and conv window
    # after every SNAP_GRID-th row here (engine/prefill_graph.py reads out the wanted positions)
    snap_states: torch.Tensor | None = None  # [T/SNAP_GRID, G, HV, K, V] fp32, G GDN layers
    snap_windows: torch.Tensor | None = None  # [T/SNAP_GRID, G, C, W-1]
    snap_layers: tuple[int, ...] = ()  # the GDN layers' indices, in G order

    def pad_rows(self) -> torch.Tensor:
        """[T] bool, True for the padding rows."""
        return torch.arange(self.num_rows, device=self.real_len.device) >= self.real_len

    def window_rows(self, width: int) -> torch.Tensor:
        """[width] rows of [old window | chunk] holding the conv inputs before the first pad."""
        return torch.arange(width, device=self.real_len.device) + self.real_len

    def snap_positions(self) -> torch.Tensor:
        """[T/SNAP_GRID] the positions (from the chunk's start) snap_states are taken at."""
        num = self.snap_states.shape[0]
        return (torch.arange(num, device=self.real_len.device) + 1) * SNAP_GRID

    def last_row(self) -> torch.Tensor:
        """[1] the last real row (where the next-token logits come from)."""
        return self.real_len - 1

    def snapshot_hook(self, layer: int, window: torch.Tensor, rows: torch.Tensor):
        """(stops, on_boundary) for GDN layer `layer`'s scan of this chunk (window [C,W-1], rows
        [T,C] its conv input): its state after every SNAP_GRID rows into snap_states, and the conv
        windows there into snap_windows (all at once)."""
        g, num = self.snap_layers.index(layer), self.snap_states.shape[0]
        positions = self.snap_positions()  # [NS]
        at = positions[:, None] + torch.arange(window.shape[-1], device=positions.device)
        self.snap_windows[:, g].copy_(window_at(window, rows, at))

        def keep(done: int, s: torch.Tensor) -> None:
            if done % SNAP_GRID == 0 and 0 < done <= num * SNAP_GRID:
                self.snap_states[done // SNAP_GRID - 1, g].copy_(s[0])

        return tuple(SNAP_GRID * (i + 1) for i in range(num)), keep


@dataclass(slots=True)
class StepBatch:
    chunks: list[SeqChunk]
    states: StatePool
    kv: KVPool
    offsets: list[int] = field(default_factory=list)  # flat index of each chunk's first token
    decode: list[int] = field(default_factory=list)  # chunks of one token: batched mixers
    prefill: list[int] = field(default_factory=list)  # longer chunks: one mixer call each
    verify: list[int] = field(default_factory=list)  # draft-verification chunks (spec/verify.py)
    positions: torch.Tensor | None = None  # [T] absolute positions
    kv_blocks: torch.Tensor | None = None  # [T] block and row of each token's K/V
    kv_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None  # [BD]
    # attention's decode-style rows (decode chunks, then every row of a verify chunk, in flat order)
    decode_tables: torch.Tensor | None = None  # [BA,NBmax] (padded)
    decode_lengths: torch.Tensor | None = None  # [BA] positions each such row attends to
    spec: object = None  # spec.rollback.VerifyRecord when verify chunks run: per-position states
    # filled by the GDN layers: snapshots[chunk][position][layer] = (conv window, state)
    snapshots: dict[int, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = field(
        default_factory=dict
    )
    tables: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk -> its block table
    # steps with prefill or verify chunks: decode_rows / attend_rows / logit_rows as device index
    # tensors, copied in build (a Python list as an index is a pageable copy mid-forward, which
    # waits for all queued GPU work: one stall per use, ~100 per mixed step)
    row_index: dict[str, torch.Tensor] = field(default_factory=dict)
    # a captured prefill graph's one padded chunk (engine/prefill_graph.py); then the chunk's rows
    # attend as decode rows (decode_tables / decode_lengths) and prefill, decode, verify are empty
    graph_chunk: GraphChunk | None = None
    # the engine's steps without prefill chunks: every row takes the per-row kernels (native on
    # CPU) whatever their number, so a row's bits never depend on who shares its step
    # (spec/rollback.py relies on it); the model runs its ops within ops/dispatch.stepping(it)
    native_rows: bool = False
    scratch: object = None  # cache/scratch.Scratch the step's temporaries reuse (None: allocate)

    def snapshot_hook(self, i: int, layer: int, window: torch.Tensor, rows: torch.Tensor):
        """on_boundary for GDN layer `layer`'s scan of prefill chunk i (window [1,C,W-1], rows
        [1,T,C] its conv input): keeps (conv window, state) at the chunk's snapshot positions in
        snapshots[i][position][layer] (the window then = the W-1 inputs before it)."""
        chunk, width = self.chunks[i], window.shape[-1]
        full = torch.cat([window.transpose(1, 2).to(rows.dtype), rows], dim=1)
        snaps = self.snapshots.setdefault(i, {})

        def keep(done: int, s: torch.Tensor) -> None:
            pos = chunk.start_pos + done
            if pos in chunk.snapshot_at:
                win = full[0, done : done + width].t().contiguous()
                snaps.setdefault(pos, {})[layer] = (win, s[0])

        return keep

    def chunk_table(self, i: int, device) -> torch.Tensor:
        """Chunk i's block table on the device (prefill chunks': copied in build, once per step)."""
        table = self.tables.get(i)
        if table is None:
            table = self.tables[i] = host_to_device(
                np.asarray(self.chunks[i].block_table, dtype=np.int64), device)
        return table

    @classmethod
    def build(cls, chunks: list[SeqChunk], states: StatePool, kv: KVPool, device) -> StepBatch:
        batch = cls(chunks, states, kv)
        block_len, flat = kv.block_len, 0
        for i, c in enumerate(chunks):
            if c.num_tokens < 1 or len(c.block_table) * block_len < c.end_pos:
                raise ValueError(f"chunk {i} has no tokens or too few KV blocks: {c}")
            batch.offsets.append(flat)
            flat += c.num_tokens
            kind = batch.verify if c.verify else batch.decode if c.num_tokens == 1 else batch.prefill
            kind.append(i)
        places = _token_places(chunks, block_len)
        # one copy for the three (pinned, not waiting for queued work on the GPU)
        batch.positions, batch.kv_blocks, batch.kv_rows = host_to_device(places, device)
        for i in batch.prefill:  # before any GPU work: a copy mid-forward would wait for it
            batch.chunk_table(i, device)
        if batch.prefill or batch.verify:
            batch._index_rows(device)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        if batch.decode:
            batch.decode_slots = as_long([chunks[i].slot for i in batch.decode])
        if batch.decode or batch.verify:
            # one row per decode chunk and per verify-chunk token, in flat order (attend_rows)
            att = [(c, p + 1) for c in chunks if c.verify or c.num_tokens == 1
                   for p in range(c.start_pos, c.end_pos)]
            width = max(len(c.block_table) for c, _ in att)
            batch.decode_tables = as_long(
                [list(c.block_table) + [c.block_table[0]] * (width - len(c.block_table))
                 for c, _ in att]
            )
            batch.decode_lengths = as_long([length for _, length in att])
        return batch

    def _index_rows(self, device) -> None:
        """row_index: the row lists of a step with prefill or verify chunks, in one copy."""
        lists = {"decode": [self.offsets[i] for i in self.decode], "logit": self.logit_rows()}
        if self.prefill:  # (without one, every row attends as a decode: a slice)
            lists["attend"] = [self.offsets[i] + j for i, c in enumerate(self.chunks)
                               if i not in self.prefill for j in range(c.num_tokens)]
        flat = host_to_device(np.concatenate([np.asarray(v, np.int64) for v in lists.values()]),
                              device)
        at = 0
        for name, rows in lists.items():
            self.row_index[name], at = flat[at : at + len(rows)], at + len(rows)

    def decode_mask(self) -> torch.Tensor:
        """[BD,1,1,NBmax*L] True = attend: the padded key range of the decode rows, masked."""
        width = self.decode_tables.shape[1] * self.kv.block_len
        keys = torch.arange(width, device=self.decode_lengths.device)
        return (keys[None, :] < self.decode_lengths[:, None])[:, None, None, :]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def decode_rows(self) -> slice | torch.Tensor:
        """Flat rows of the decode chunks: a slice when the step is all decodes (so the step can
        be captured in a CUDA graph), else a device index tensor (row_index)."""
        return self.row_index.get("decode", slice(None))

    def attend_rows(self) -> slice | torch.Tensor:
        """Flat rows that attend as decodes (decode_tables' rows): decode chunks and every row of
        a verify chunk; a slice when there is no prefill chunk, else a device index tensor."""
        return self.row_index.get("attend", slice(None))

    def logit_index(self) -> torch.Tensor | None:
        """logit_rows as a device index tensor (steps with prefill or verify chunks), or None."""
        return self.row_index.get("logit")

    def span(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i] + self.chunks[i].num_tokens)

    def last_rows(self) -> list[int]:
        """Flat index of each chunk's last token (where its next-token logits come from)."""
        return [self.offsets[i] + c.num_tokens - 1 for i, c in enumerate(self.chunks)]

    def logit_rows(self) -> list[int]:
        """Rows that get logits: each chunk's last token, every token of a verify chunk."""
        return [self.offsets[i] + j for i, c in enumerate(self.chunks)
                for j in (range(c.num_tokens) if c.verify else (c.num_tokens - 1,))]


def _token_places(chunks: list[SeqChunk], block_len: int) -> np.ndarray:
    """[3, T] int64: each token's position, KV block and row in that block. Prefill chunks take
    numpy (per-token Python lists cost 3.3 ms of host time for an 8k-token chunk); a step of
    decodes alone takes plain ints (cheaper than array ops per chunk)."""
    if all(c.num_tokens == 1 for c in chunks):
        pos = [c.start_pos for c in chunks]
        return np.array([pos, [c.block_table[p // block_len] for c, p in zip(chunks, pos, strict=True)],
                         [p % block_len for p in pos]], dtype=np.int64)
    parts = []
    for c in chunks:
        pos = np.arange(c.start_pos, c.end_pos, dtype=np.int64)
        table = np.asarray(c.block_table, dtype=np.int64)
        parts.append(np.stack([pos, table[pos // block_len], pos % block_len]))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def window_at(window: torch.Tensor, rows: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Rows `at` [..., W-1] of [window^T | rows] (window [C,W-1], rows [T,C]) as conv windows
    [..., C, W-1], gathered without concatenating the chunk (a whole [T,C] copy per layer at 8k
    tokens)."""
    width = window.shape[-1]
    from_rows = rows[(at - width).clamp(min=0)]  # [..., W-1, C]
    from_window = window.t()[at.clamp(max=width - 1)].to(rows.dtype)
    return torch.where((at < width)[..., None], from_window, from_rows).transpose(-1, -2)


def host_to_device(host: np.ndarray, device) -> torch.Tensor:
    """An int64 array on the device; on CUDA through pinned memory with a non-blocking copy (a
    blocking copy waits for the queued work: the GPU then idles until the host catches up, and
    an overlapped decode step would wait for the step in flight)."""
    out = torch.from_numpy(np.ascontiguousarray(host))
    if torch.device(device).type != "cuda":
        return out
    return out.pin_memory().to(device, non_blocking=True)
