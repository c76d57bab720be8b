"""Short prefill chunks replayed from CUDA graphs: a step that is one sequence's chunk of up to
128 tokens (a question behind a cached prefix, a short prompt) is ~400 kernels for a few ms of GPU
work, bound by Python's launch time when run eagerly.

One graph per (token bucket, KV-width bucket). The chunk is padded to a power of two of rows; every
index is on the device (layers see `StepBatch.graph_chunk`): the GDN layers gather the slot's conv
window and state, scan, and scatter them back, with the padding rows' gates set so that they change
nothing (beta 0, decay 1) and the new window taken at the real length; the attention rows attend as
decode rows (paged decode attention over the block table, per-row lengths), the padding rows' K/V
go to the spare block; the head reads the last real row. A chunk with prefix-snapshot positions
runs as pieces cut there (the snapshot = the slot's state after a piece; the first piece may be a
long graph, below). Image rows: the input
embeddings are made eagerly (token embeddings, the tower's rows copied in) into a static buffer
the graph reads. Draft verification, quantized models and 32-bit activations run eagerly.

Long fresh pieces (a prompt's first chunk, or its part before its first prefix snapshot, 129 tokens
up to DELTASERVE_PREFILL_GRAPH_TOKENS) replay from graphs of LONG_BUCKETS rows: an 8k chunk is ~500 launches
whose host time (fla's stage wrappers, Triton's launcher) matched its ~30 ms of GPU work. There
the GDN layers run as above (fla's stages on the padded rows), and attention runs the causal
prefill kernel over the chunk's own K/V, read back from the rows it was written to: padding rows
(positioned at the last real token, writing the spare block) come after every real row, so no
real row sees them. With DELTASERVE_PREFILL_GRAPH_SNAPSHOTS=1 a fresh chunk whose cut pieces would
not all replay (a snapshot inside it, a long piece after it) takes a long graph whole: its GDN
layers keep the state and conv window after every 64th row in a static buffer, and the runner
copies out the wanted positions after the replay. Off by default: its buffer is ~19 MB per 64 rows
of the chunk budget on the 0.8B shape, and the sparse snapshot policy (cache/prefix.py) rarely
needs it.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from deltaserve.cache.batch import SNAP_GRID, GraphChunk, SeqChunk, StepBatch, host_to_device
from deltaserve.engine.cuda_graph import capture, width_bucket
from deltaserve.engine.step import Step, StepLogits, placeholders, step_logits

TOKEN_BUCKETS = (16, 32, 64, 128)
# fresh chunks longer than TOKEN_BUCKETS: padding costs at most a third of the GPU work above 2k
LONG_BUCKETS = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
MAX_PIECES = 4  # a chunk cut at its prefix-snapshot positions replays at most this many graphs
FIELDS = ("ids", "positions", "kv_blocks", "kv_rows", "lengths")  # [T] each, then slot, real_len
Key = tuple[int, int, bool, bool]  # rows, KV-table width, image rows, prefix snapshots kept


def _bucket(n: int) -> int | None:
    return next((b for b in TOKEN_BUCKETS if b >= n), None)


def _long_bucket(n: int, max_tokens: int) -> int | None:
    return next((b for b in LONG_BUCKETS if n <= b <= max_tokens), None)


def long_rows(max_chunk_tokens: int, limit_tokens: int) -> int:
    """Rows of the largest long graph a chunk budget can reach (0: none), for the memory plan."""
    if min(max_chunk_tokens, limit_tokens) <= TOKEN_BUCKETS[-1]:
        return 0
    return _long_bucket(min(max_chunk_tokens, limit_tokens), limit_tokens) or max(
        (b for b in LONG_BUCKETS if b <= limit_tokens), default=0)


def graph_scratch_bytes(model, max_chunk_tokens: int, block_len: int) -> int:
    """Memory the long prefill graphs keep for good, beside an eager step's scratch: their
    largest bucket's activations (and, with DELTASERVE_PREFILL_GRAPH_SNAPSHOTS, the shared
    snapshot buffer: a state slot per 64 rows); 0 where they do not run."""
    from deltaserve.cache.memory import activation_bytes, unit_bytes
    from deltaserve.env import env

    if model.device.type != "cuda" or not env().cuda_graphs or not usable(model) \
            or not long_graphs_run(model, block_len):
        return 0
    rows = long_rows(max_chunk_tokens, env().prefill_graph_tokens)
    if not rows:
        return 0
    snaps = rows // SNAP_GRID * unit_bytes(model, block_len)[0] if env().prefill_graph_snapshots \
        else 0
    return activation_bytes(model, rows) + snaps


def long_graphs_run(model, block_len: int) -> bool:
    """Long fresh chunks can take graphs: attention's Triton path (power-of-two head and block
    dims) and, on the GPU, fla's stages for the scan (the other scans are not worth a graph's
    memory)."""
    cfg = model.cfg
    if cfg.head_dim & (cfg.head_dim - 1) or block_len & (block_len - 1):
        return False
    if model.device.type != "cuda" or not cfg.linear_num_value_heads:
        return True
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, case_at

    chosen = GDN_PREFILL.choose(case_at(LONG_BUCKETS[0], model.act_dtype, model.device, cfg))
    return chosen.name.startswith("fla_stages")


def usable(model) -> bool:
    """Graphs need the Triton scan and paged attention (16-bit activations, triton backend), no
    scratch-buffer dequantization (dense weights) and one rank."""
    from deltaserve.ops.backend import triton_enabled
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, case_at

    if model.act_dtype not in (torch.bfloat16, torch.float16) or not triton_enabled():
        return False
    short = case_at(TOKEN_BUCKETS[-1], model.act_dtype, model.device, model.cfg)
    if not GDN_PREFILL.chooses(short, "triton_recurrent"):  # e.g. DELTASERVE_REFERENCE_OPS=1
        return False
    if getattr(model, "tp", None) is not None:  # tensor-parallel ranks step eagerly here
        return False
    from deltaserve.quant.linear import is_quantized

    return not any(is_quantized(m) for m in model.modules())


class PrefillGraphs:
    def __init__(self, model, cache, spare_slot: int, spare_block: int,
                 greedy: bool = False, max_chunk_tokens: int | None = None) -> None:
        """max_chunk_tokens: the scheduler's longest prefill chunk (None: no limit below the env's),
        which sizes the snapshot buffer as graph_scratch_bytes counts it."""
        self.model, self.cache, self.greedy = model, cache, greedy
        self.spare_slot, self.spare_block = spare_slot, spare_block
        # key -> (graph or None, static inputs, static output); without capture (CPU: tests of
        # the padded step) the step runs eagerly on the same static inputs
        self.capture = model.device.type == "cuda"
        self.graphs: dict[Key, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_runs = 0
        self.failed: set[Key] = set()  # keys whose capture failed (out of memory)
        from deltaserve.env import env

        self.gdn_layers = tuple(i for i, r in enumerate(cache.states.recurrent) if r is not None)
        self.long_snapshots = env().prefill_graph_snapshots and bool(self.gdn_layers)

        runs = long_graphs_run(model, cache.kv.block_len)
        self.max_long_tokens = env().prefill_graph_tokens if runs else 0
        self.max_long_rows = long_rows(max_chunk_tokens or self.max_long_tokens,
                                       self.max_long_tokens)
        self._snap_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def execute_step(self, step: Step) -> StepLogits | None:
        """The executor (engine/executors.py): one sequence's chunk, not fed from the device, as
        captured graphs piece by piece; the prefix snapshot at the end of a piece is the slot's
        state there. None (nothing run) for other steps or when a graph it needs could not be
        captured."""
        if len(step.plan.chunks) != 1 or step.feed is not None:
            return None
        chunk = step.chunks()[0]
        pieces = self.pieces(chunk)
        if pieces is None:
            return None
        image, device = step.images.get(step.plan.chunks[0].request_id), self.model.device
        injects = [_piece_injection(image, piece, device) if image else None for piece in pieces]
        keys = [self.key(p, i is not None) for p, i in zip(pieces, injects, strict=True)]
        if not self.ready(keys):
            return None
        ids, snaps, out = step.ids(), {}, None
        for piece, inject, key in zip(pieces, injects, keys, strict=True):
            lo = piece.start_pos - chunk.start_pos
            out = self.run(ids[lo : lo + piece.num_tokens], piece, inject)
            if piece.snapshot_at:  # a long fresh chunk: the graph kept every grid position's
                snaps.update(self.snapshots(key, piece.snapshot_at))
            elif piece.end_pos in chunk.snapshot_at:
                snaps[piece.end_pos] = dict(enumerate(self.cache.states.snapshot(chunk.slot)))
        logits = step_logits(out, step.plan)
        step.store_snapshots(logits, {0: snaps})
        return logits

    def pieces(self, chunk: SeqChunk) -> list[SeqChunk] | None:
        """The chunk as graph steps: cut at its prefix-snapshot positions (each snapshot is then
        the slot's state after a piece, StatePool.snapshot), each piece a short bucket or, where it
        starts the sequence, a long one; else, with DELTASERVE_PREFILL_GRAPH_SNAPSHOTS, a fresh
        chunk whole, its graph keeping every grid position. None when it runs eagerly (drafts, a
        1-token chunk, too long, too many pieces)."""
        if chunk.verify or chunk.num_tokens < 2:
            return None
        cuts = sorted({chunk.start_pos, *chunk.snapshot_at, chunk.end_pos})
        pieces = [SeqChunk(chunk.slot, lo, hi - lo, chunk.block_table)
                  for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        if len(pieces) <= MAX_PIECES and all(map(self._replayable, pieces)):
            return pieces
        if (chunk.start_pos == 0 and self.long_snapshots and _bucket(chunk.num_tokens) is None
                and _long_bucket(chunk.num_tokens, self.max_long_tokens)
                and all(p % SNAP_GRID == 0 for p in chunk.snapshot_at)):
            return [chunk]  # one fresh chunk keeping its snapshots in the graph
        return None

    def _replayable(self, piece: SeqChunk) -> bool:
        return _bucket(piece.num_tokens) is not None or (
            piece.start_pos == 0 and _long_bucket(piece.num_tokens, self.max_long_tokens) is not None)

    def host_inputs(self, ids: list[int], chunk: SeqChunk, images: bool = False
                    ) -> tuple[Key, np.ndarray]:
        """(graph key, the packed int64 inputs: FIELDS [T] each, slot, real_len, tables [T*W];
        a fresh long chunk has no tables, W = 0)."""
        real = chunk.num_tokens
        block_len = self.cache.kv.block_len
        if len(chunk.block_table) * block_len < chunk.end_pos:  # as StepBatch.build refuses
            raise ValueError(f"chunk has too few KV blocks: {chunk}")
        key = self.key(chunk, images)
        num_rows, width, _, _ = key
        table = np.full(max(width, len(chunk.block_table)), self.spare_block, dtype=np.int64)
        table[: len(chunk.block_table)] = chunk.block_table
        row = np.arange(num_rows, dtype=np.int64)
        real_rows = row < real
        # padding rows: the last real position (valid for rotary), K/V into the spare block
        positions = chunk.start_pos + np.minimum(row, real - 1)
        kv_blocks = np.where(real_rows, table[positions // block_len], self.spare_block)
        table = table[:width]
        token_ids = np.zeros(num_rows, dtype=np.int64)
        token_ids[:real] = ids
        packed = np.concatenate([
            token_ids, positions, kv_blocks, positions % block_len, positions + 1,
            [chunk.slot, real], np.broadcast_to(table, (num_rows, width)).reshape(-1),
        ])
        return key, packed

    def key(self, chunk: SeqChunk, images: bool = False) -> Key:
        """(rows, KV-table width, image rows, snapshots kept) of the graph a piece from pieces()
        replays."""
        if _bucket(chunk.num_tokens) is None:  # pieces() gives longer ones only when fresh
            if chunk.start_pos != 0:  # the long graphs' attention sees only the chunk's own rows
                raise ValueError(f"a long graph chunk must start its sequence: {chunk}")
            rows = _long_bucket(chunk.num_tokens, self.max_long_tokens)
            return rows, 0, images, bool(chunk.snapshot_at)
        return _bucket(chunk.num_tokens), width_bucket(len(chunk.block_table)), images, False

    def snapshots(self, key: Key, positions: tuple[int, ...]) -> dict[int, dict]:
        """The prefix snapshots a long graph step kept, at `positions` (grid positions of its
        chunk): position -> {GDN layer: (conv window, state)}, one copy per position (its layers
        are views of it: a snapshot's memory goes when the prefix cache drops it)."""
        static, out = self.graphs[key][1], {}
        for pos in positions:
            states = static["snap_states"][pos // SNAP_GRID - 1].clone()
            windows = static["snap_windows"][pos // SNAP_GRID - 1].clone()
            out[pos] = {layer: (windows[g], states[g]) for g, layer in enumerate(self.gdn_layers)}
        return out

    def ready(self, keys: list[Key]) -> bool:
        """Every graph of a chunk's pieces captured, before any piece runs (capturing the missing
        ones); False when one could not be: the GPU had no memory for it. Such a key is remembered
        and its chunks run eagerly from then on."""
        for key in keys:
            if key in self.failed:
                return False
            if key in self.graphs or not self.capture:
                continue
            try:
                self.graphs[key] = self._capture(*key)
            except RuntimeError as exc:  # out of memory, or (torch < 2.14) the capture
                # invalidated by one: either way this bucket's chunks take the ordinary path
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            else:
                continue
            self.failed.add(key)
            torch.cuda.empty_cache()  # the failed capture's warm-up tensors are gone now
            warnings.warn(f"could not capture the {key[0]}-row prefill graph ({reason}): its "
                          f"chunks run eagerly", stacklevel=2)
            return False
        return True

    def run(self, ids: list[int], chunk: SeqChunk,
            inject: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [1, vocab] fp32 of the chunk's last token, or its greedy token [1]. inject: (rows
        of the chunk [R] int64 on the device, their input embeddings [R,N]) for image rows."""
        key, host = self.host_inputs(ids, chunk, inject is not None)
        if key not in self.graphs:
            self.graphs[key] = (self._capture(*key) if self.capture else
                                (None, self.static_inputs(*key, self.model.device), None))
        graph, static, out = self.graphs[key]
        self.num_runs += 1
        host_t = torch.from_numpy(host)
        static["packed"].copy_(host_t.pin_memory() if graph is not None else host_t,
                               non_blocking=graph is not None)
        if inject is not None:  # every row's input embedding, image rows from the tower
            x = self.model._embed(static["ids"][None])[0]
            x.index_copy_(0, inject[0], inject[1].to(x.dtype))
            static["embeds"].copy_(x)
        if graph is None:
            return self.forward(static)
        graph.replay()
        return out.clone()  # the static buffer is the next replay's

    def static_inputs(self, num_rows: int, width: int, images: bool, snaps: bool, device
                      ) -> dict[str, torch.Tensor]:
        packed = torch.empty(len(FIELDS) * num_rows + 2 + num_rows * width, dtype=torch.long,
                             device=device)
        static = {name: packed[i * num_rows : (i + 1) * num_rows] for i, name in enumerate(FIELDS)}
        at = len(FIELDS) * num_rows
        static["slot"], static["real_len"] = packed[at : at + 1], packed[at + 1 : at + 2]
        static["tables"] = packed[at + 2 :].view(num_rows, width)
        static["packed"] = packed
        if images:  # the step's input embeddings replace every row's (Injection of all rows)
            static["all_rows"] = torch.arange(num_rows, device=device)
            static["embeds"] = torch.zeros(num_rows, self.model.cfg.hidden_size,
                                           dtype=self.model.act_dtype, device=device)
        if snaps:  # every grid position's state and window, per GDN layer
            states, windows = self._snapshot_buffers(device)
            static["snap_states"] = states[: num_rows // SNAP_GRID]
            static["snap_windows"] = windows[: num_rows // SNAP_GRID]
        return static

    def _snapshot_buffers(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """One [positions, GDN layers, ...] buffer of states and one of windows for the largest
        bucket, shared by every graph that keeps snapshots (replays run one at a time and
        snapshots() copies out right after each)."""
        if self._snap_buffers is None:
            states, convs = self.cache.states.recurrent, self.cache.states.conv
            first = self.gdn_layers[0]
            grid = (self.max_long_rows // SNAP_GRID, len(self.gdn_layers))
            self._snap_buffers = (
                torch.zeros(*grid, *states[first].shape[1:], dtype=states[first].dtype,
                            device=device),
                torch.zeros(*grid, *convs[first].shape[1:], dtype=convs[first].dtype,
                            device=device))
        return self._snap_buffers

    def batch(self, static: dict[str, torch.Tensor]) -> StepBatch:
        """A StepBatch whose tensors are the graph's static inputs (one padded graph chunk)."""
        num_rows = static["ids"].shape[0]
        chunk = SeqChunk(self.spare_slot, 0, num_rows, (self.spare_block,))
        batch = StepBatch([chunk], self.cache.states, self.cache.kv, scratch=self.cache.scratch)
        batch.offsets = [0]
        batch.positions, batch.kv_blocks = static["positions"], static["kv_blocks"]
        batch.kv_rows = static["kv_rows"]
        fresh = static["tables"].shape[1] == 0
        if not fresh:  # every row attends as a decode row over its table
            batch.decode_tables, batch.decode_lengths = static["tables"], static["lengths"]
        batch.graph_chunk = GraphChunk(static["slot"], static["real_len"], num_rows, fresh,
                                       static.get("snap_states"), static.get("snap_windows"),
                                       self.gdn_layers)
        return batch

    def forward(self, static: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step on the static inputs, eagerly (what the graph captures; tests run it on CPU)."""
        inject = (static["all_rows"], static["embeds"]) if "embeds" in static else None
        return self.model.forward_batch(static["ids"], self.batch(static), greedy=self.greedy,
                                        inject=inject)

    def _capture(self, num_rows: int, width: int, images: bool, snaps: bool):
        static = self.static_inputs(num_rows, width, images, snaps, self.model.device)
        for name, value in (("ids", 0), ("positions", 0), ("kv_blocks", self.spare_block),
                            ("kv_rows", 0), ("lengths", 1), ("slot", self.spare_slot),
                            ("real_len", num_rows), ("tables", self.spare_block)):
            static[name].fill_(value)
        graph, out = capture(lambda: self.forward(static), self.pool)
        return graph, static, out


def _piece_injection(image, piece: SeqChunk, device: torch.device):
    """(rows of the piece [R], embeddings [R,N]) of the image placeholders it covers, or None."""
    rows, embeds = placeholders(image, piece.start_pos, piece.end_pos)
    return (host_to_device(np.array(rows, np.int64), device), embeds) if rows else None
