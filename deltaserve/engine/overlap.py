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
early; anything else (prefill chunks, sampling, logprobs, logits processing) runs at once after
the pending step resolves, so outputs are exactly those of the plain engine, one call later.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deltaserve.engine.scheduler import StepPlan


@dataclass(slots=True)
class InFlight:
    """A launched step whose tokens are still on the device."""

    rows: dict[str, tuple[int, int]]  # request -> (row of `tokens`, its index among the outputs)
    tokens: torch.Tensor  # [rows] int64 on the device (an own copy: graph outputs get reused)
    host: torch.Tensor  # [rows (+ chunks)] int64, pinned on CUDA: tokens (+ finite flags)
    event: torch.cuda.Event | None  # recorded after the copy into `host`
    chunk_rids: list[str]  # the finite flags' order (None when the greedy head made tokens)
    has_flags: bool


def can_overlap(engine, plan: StepPlan, pending: InFlight | None) -> bool:
    """Every row a greedy single-token decode without logprobs whose input token is known, or is
    the pending step's output for the same request, and none an image prompt's token."""
    for c in plan.chunks:
        if len(c.token_ids) != 1 or not c.sample:
            return False
        live = engine.live(c.request_id)
        if live is None or not live.params.greedy or live.params.logprobs is not None \
                or live.proc is not None:  # processing reads the previous token on the host
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
    if logits.are_tokens:  # the greedy head's tokens: a static graph buffer, copied out
        tokens, flags = logits.tensor.clone(), None
    else:
        tokens, flags = logits.tensor.argmax(-1), logits.finite_flags()
    both = tokens if flags is None else torch.cat([tokens, flags.long()])
    cuda = both.device.type == "cuda"
    host = _host_buffer(engine, engine.num_steps % 2, both.numel(), cuda)
    host.copy_(both, non_blocking=cuda)
    event = None
    if cuda:
        event = torch.cuda.Event()
        event.record()
    engine.scheduler.update(plan, None)  # each request gets an unread token
    rows = {}
    for rid, row in logits.rows.items():
        req = engine.scheduler.get(rid)
        rows[rid] = (row, len(req.output_ids) + req.num_unread - 1)
    engine.num_steps += 1
    return InFlight(rows, tokens, host, event, list(logits.chunk_rids), flags is not None)


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
    num = len(values) - (len(pending.chunk_rids) if pending.has_flags else 0)
    failed = set()
    if pending.has_flags:
        failed = {rid for rid, ok in zip(pending.chunk_rids, values[num:], strict=True) if not ok}
    outs = []
    for rid, (row, index) in pending.rows.items():
        if engine.live(rid) is None:  # stopped or aborted since the launch: discarded
            continue
        if rid in failed:
            outs.append(engine.fail(rid))
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
