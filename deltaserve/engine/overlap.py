"""Overlapped decode: a greedy decode step is launched before the previous step's tokens are read
back, so the host's work per step (reading tokens, stop checks, detokenizing, scheduling) runs
while the GPU computes the next step, instead of between steps.

A launched step leaves each of its requests an unread token (Request.num_unread: the position
is taken, the id is on the device); the scheduler plans the next step from the positions, marking
the rows whose ids are unread (ScheduledChunk.num_unread), and those rows' input ids come from the
launched step's token tensor on the device. Resolving the launched step (one pinned
device-to-host copy, waited for by an event) reads the tokens back into the requests, in order,
and emits them. A request that stops at step k was already launched
into step k+1: that row's work is discarded (the request is retired before it resolves), the only
cost of overlapping. Only steps whose every row decodes greedily without logprobs are launched
early; anything else (prefill chunks, sampling, logprobs) runs at once after the pending step
resolves, so outputs are exactly those of the plain engine, one call later.

Rows with logits processing (penalties, grammars) need the previous token on the host: a step
with such rows launches its forward only, the pending step resolves (its tokens accepted by the
grammars and counts), and then `finish` plans the processing on the host — while the GPU runs the
forward — and queues the processed pick and the copy back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deltaserve.engine.processors import NO_TOKEN, processed_rows
from deltaserve.engine.scheduler import StepPlan
from deltaserve.ops.processing import mask_pick, pick


@dataclass(slots=True)
class InFlight:
    """A launched step whose tokens are still on the device."""

    rows: dict[str, tuple[int, int]]  # request -> (row of `tokens`, its index among the outputs)
    tokens: torch.Tensor | None  # [rows] int64 on the device (an own copy: graph outputs get reused)
    host: torch.Tensor | None  # [rows (+ chunks + processed)] int64, pinned on CUDA: tokens (+
    # finite flags, + each processed row's "a token was allowed")
    event: torch.cuda.Event | None  # recorded after the copy into `host`
    chunk_rids: list[str]  # the finite flags' order (None when the greedy head made tokens)
    has_flags: bool
    which: int = 0  # the host buffer it takes
    logits: object = None  # step.StepLogits until `finish` picks the processed rows' tokens
    processed: tuple[str, ...] = ()  # requests whose rows were processed, in the flags' order


def can_overlap(engine, plan: StepPlan, pending: InFlight | None) -> bool:
    """Every row a greedy single-token decode without logprobs whose input token is known, or is
    the pending step's output for the same request, and none an image prompt's token."""
    for c in plan.chunks:
        if len(c.token_ids) != 1 or not c.sample:
            return False
        live = engine.live(c.request_id)
        if live is None or not live.params.greedy or live.params.logprobs is not None:
            return False
        if c.num_unread and (pending is None or c.request_id not in pending.rows):
            return False
        req = engine.scheduler.get(c.request_id)
        if req.images is not None and c.start_pos < len(req.prompt_ids):
            return False  # a prompt token that may take an image embedding: the plain path
    return True


def launch(engine, plan: StepPlan, pending: InFlight | None) -> InFlight:
    """Run the plan's forward without waiting for it; the scheduler advances with placeholders."""
    dst = [i for i, c in enumerate(plan.chunks) if c.num_unread]
    feed = None
    if dst:
        feed = (pending.tokens, dst, [pending.rows[plan.chunks[i].request_id][0] for i in dst])
    logits = engine.runner.execute(plan, {}, feed)
    which = engine.num_steps % 2
    if any(engine.live(c.request_id).proc is not None for c in plan.chunks):
        flight = InFlight(_rows(engine, plan, logits), None, None, None, list(logits.chunk_rids),
                          True, which, logits)
        engine.num_steps += 1
        return flight
    if logits.are_tokens:  # the greedy head's tokens: a static graph buffer, copied out
        tokens, flags = logits.tensor.clone(), None
    else:
        tokens, flags = logits.tensor.argmax(-1), logits.finite_flags()
    both = tokens if flags is None else torch.cat([tokens, flags.long()])
    host, event = _copy_back(engine, which, both)
    rows = _rows(engine, plan, logits)
    engine.num_steps += 1
    return InFlight(rows, tokens, host, event, list(logits.chunk_rids), flags is not None, which)


def finish(engine, flight: InFlight) -> None:
    """The processed rows' tokens of a launched step, once the step before it resolved: each
    live processed row planned on the host (processors.stage, while the forward runs), and one
    int64 buffer [R tokens | C finite flags | P allowed flags] filled on the device and copied
    back. When every row is processed with grammar masks only (the usual constrained step), one
    pick (ops/processing.mask_pick) makes the tokens and both flags; otherwise the raw argmax
    where some row is not processed, the finite flags, and the processed rows' picks over them.
    Few launches: on a GPU each costs host time the forward must hide."""
    logits, flight.logits = flight.logits, None
    table = logits.tensor
    num, num_flags = table.shape[0], len(logits.chunk_rids)
    rids = [rid for rid in logits.rows
            if engine.live(rid) is not None and engine.live(rid).proc is not None]
    procs = [engine.live(rid).proc for rid in rids]
    both = torch.empty(num + num_flags + len(rids), dtype=torch.long, device=table.device)
    staged = engine.stage_rows(table, [logits.rows[rid] for rid in rids], procs) if rids else None
    rows_are_chunks = num == num_flags and all(
        logits.rows.get(rid) == i for i, rid in enumerate(logits.chunk_rids))
    if staged is not None and staged.mask_only and len(rids) == num and rows_are_chunks:
        mask_pick(table, staged.index, staged.mask_of, staged.words, both, num + num_flags, num)
    else:
        if len(rids) < num:
            torch.argmax(table, -1, out=both[:num])
        both[num:num + num_flags].copy_(logits.finite_flags())
        if staged is not None:
            pick(processed_rows(table, staged, procs), staged.index, both, num + num_flags)
    flight.tokens, flight.processed = both[:num], tuple(rids)
    flight.host, flight.event = _copy_back(engine, flight.which, both)


def _rows(engine, plan: StepPlan, logits) -> dict[str, tuple[int, int]]:
    """Each request's (row, index among its outputs); the scheduler advances with placeholders."""
    engine.scheduler.update(plan, None)  # each request gets an unread token
    rows = {}
    for rid, row in logits.rows.items():
        req = engine.scheduler.get(rid)
        rows[rid] = (row, len(req.output_ids) + req.num_unread - 1)
    return rows


def _copy_back(engine, which: int, both: torch.Tensor):
    """(host copy of both, the event recorded after it on CUDA, else None). The events alternate
    like the host buffers (step k's is recorded again at k+2, after k resolved): no event is
    created per step."""
    cuda = both.device.type == "cuda"
    host = _host_buffer(engine, which, both.numel(), cuda)
    host.copy_(both, non_blocking=cuda)
    event = None
    if cuda:
        event = engine.copy_events[which]
        if event is None:
            event = engine.copy_events[which] = torch.cuda.Event()
        event.record()
    return host, event


def _host_buffer(engine, which: int, numel: int, pinned: bool) -> torch.Tensor:
    """One of two persistent host buffers (pinned on CUDA; steps alternate: the buffer of step k
    is reused at k+2, after k resolved). No pinned allocation per step: the host allocator's
    event bookkeeping must not run while a new decode graph is being captured."""
    bufs = engine.host_buffers
    buf = bufs[which]
    if buf is None or buf.numel() < numel:
        buf = bufs[which] = torch.empty(max(numel, 512), dtype=torch.long, pin_memory=pinned)
    return buf[:numel]


def resolve(engine, pending: InFlight) -> list:
    """Wait for the launched step, read its tokens back into the requests, emit them."""
    if pending.event is not None:
        pending.event.synchronize()
    values = pending.host.tolist()
    num_flags = len(pending.chunk_rids) if pending.has_flags else 0
    num = len(values) - num_flags - len(pending.processed)
    flagged = pending.chunk_rids if pending.has_flags else ()  # the greedy head makes no flags
    failed = {rid: None for rid, ok in zip(flagged, values[num:num + num_flags], strict=True)
              if not ok}
    for rid, ok in zip(pending.processed, values[num + num_flags:], strict=True):
        if not ok:
            failed.setdefault(rid, NO_TOKEN)
    outs = []
    for rid, (row, index) in pending.rows.items():
        live = engine.live(rid)
        if live is None:  # stopped or aborted since the launch: discarded
            continue
        if rid not in failed and live.proc is not None and not live.proc.accept(values[row]):
            failed[rid] = "the grammar refused the sampled token"
        if rid in failed:
            outs.append(engine.fail(rid, failed[rid]))
            continue
        engine.scheduler.read_back(rid, values[row])
        outs.append(engine.emit(rid, values[row], None, index + 1))
    return outs


def patched(engine, plan: StepPlan) -> StepPlan:
    """A plan scheduled while a step was pending, once it resolved: chunks of requests that ended
    meanwhile dropped, unread rows given the tokens read back."""
    chunks = []
    for c in plan.chunks:
        if engine.live(c.request_id) is None:
            continue
        if c.num_unread:
            req = engine.scheduler.get(c.request_id)
            c = replace(c, token_ids=req.token_slice(c.start_pos, c.start_pos + len(c.token_ids)),
                        num_unread=0)
        chunks.append(c)
    return replace(plan, chunks=tuple(chunks))
