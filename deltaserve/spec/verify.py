"""Speculative decoding in the engine step: drafts appended to decode chunks, all of them verified
in the step's one forward, the longest agreeing prefix accepted, the rest rolled back exactly.

Per step: draft(plan) turns each eligible decode chunk (pending token t0) into a verify chunk
(t0, d1..dk) with KV reserved for its k extra positions; the forward gives logits for every row;
verify() takes the target's greedy token g_j at each row, accepts d1..dm while d_j == g_{j-1}, and
emits d1..dm plus g_m (the correction, or the bonus token when all k agree). Rows past the accepted
ones are undone: the GDN states roll back (spec/rollback.py) and the request's KV is truncated
(cache/manager.truncate). Verify chunks never take prefix snapshots, so no cached state ever holds
a rejected draft.

A request that samples (temperature > 0) gets drafts too, accepted by exact speculative sampling
(spec/sampled.py: each emitted token distributed as plain sampling would draw it). A request that
asks for logprobs decodes as usual, without drafts. Drafts never take the step past the
scheduler's token budget (max_num_batched_tokens).
"""

from __future__ import annotations

import dataclasses

import torch

from deltaserve.engine.scheduler import ScheduledChunk, StepPlan
from deltaserve.spec.config import SpeculativeConfig, draftable
from deltaserve.spec.ngram import AdaptiveGate, propose_ngram
from deltaserve.spec.pace import PaceGate
from deltaserve.spec.sampled import accept_sampled


@dataclasses.dataclass(slots=True)
class SpecStats:
    """Counters for /metrics and the bench (vLLM's spec_decode_* names)."""

    num_drafts: int = 0  # verify chunks run
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    num_disabled: int = 0  # requests the adaptive gate switched off
    pace: dict | None = None  # the pace gate's state when it runs (spec/pace.py)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "accepted_per_pos": list(self.accepted_per_pos),
                "num_disabled": self.num_disabled,
                **({"pace": self.pace} if self.pace is not None else {})}


class Speculator:
    def __init__(self, config: SpeculativeConfig, engine) -> None:
        self.config, self.engine = config, engine
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._gates: dict[str, AdaptiveGate] = {}
        self.pace = PaceGate() if config.adaptive and config.pace else None
        # (drafted or not, number of sequences) of a decode-only step being timed, else None
        self._paced: tuple[bool, int] | None = None
        self.mtp = None
        if config.method == "mtp":
            from deltaserve.spec.mtp import MTPDrafter

            self.mtp = MTPDrafter(engine.model, config, engine.model_dir)

    # ---- before the forward ----

    def draft(self, plan: StepPlan) -> StepPlan:
        """The plan with drafts appended to every eligible decode chunk (KV reserved for them);
        unchanged where the pace gate measured drafting not to pay (or probes without it)."""
        decode_only, num_seqs = all(len(c.token_ids) == 1 for c in plan.chunks), len(plan.chunks)
        self._paced = None
        if self.pace is not None:
            wanted = self.pace.choose(num_seqs) if decode_only else self.pace.drafting
            if not wanted:
                self._paced = (False, num_seqs) if decode_only else None
                return plan
        plan = self._append_drafts(plan)
        if self.pace is not None and decode_only:
            self._paced = (any(c.num_draft for c in plan.chunks), num_seqs)
        return plan

    def timed(self, num_tokens: int, seconds: float) -> None:
        """The engine's wall time of the step just run and the tokens it emitted."""
        if self._paced is not None:
            drafted, num_seqs = self._paced
            self.pace.record(drafted, num_tokens, seconds, num_seqs)
            self.stats.pace = self.pace.as_dict()
            self._paced = None

    def _append_drafts(self, plan: StepPlan) -> StepPlan:
        chunks, changed = [], False
        budget = self.engine.scheduler.config.max_num_batched_tokens - plan.num_tokens
        proposed = None  # MTP drafts every chunk at once (the budget shared out in plan order)
        if self.mtp is not None:
            wanted, left = {}, budget
            for c in plan.chunks:
                wanted[c.request_id] = num = min(self._num_drafts(c), max(left, 0))
                left -= num
            proposed = self.mtp.propose_many({rid: num for rid, num in wanted.items() if num})
        for c in plan.chunks:
            if proposed is not None:
                drafts = proposed.get(c.request_id, [])[: max(budget, 0)]
            else:  # one request at a time: the budget a short proposal leaves goes on
                num = min(self._num_drafts(c), max(budget, 0))
                drafts = self._propose(c.request_id, num) if num else []
            if drafts and self.engine.cache.reserve(c.request_id, c.start_pos + 1 + len(drafts)):
                c = dataclasses.replace(c, token_ids=c.token_ids + tuple(drafts),
                                        num_draft=len(drafts))
                budget -= len(drafts)
                changed = True
            chunks.append(c)
        return dataclasses.replace(plan, chunks=tuple(chunks)) if changed else plan

    def _num_drafts(self, c: ScheduledChunk) -> int:
        """Drafts this decode chunk may carry: 0 with logprobs or the gate closed; never past the
        request's last token nor the KV pool."""
        if len(c.token_ids) != 1 or not c.sample:
            return 0
        live = self.engine.live(c.request_id)
        if not draftable(live):
            return 0
        gate = self._gates.get(c.request_id)
        if gate is not None and not gate.enabled:
            return 0
        req = self.engine.scheduler.get(c.request_id)
        if not req.output_ids:
            return 0
        left = live.max_new - len(req.output_ids) - 1  # the step yields up to drafts + 1 tokens
        room = self.engine.cache.capacity_tokens() - c.start_pos - 1
        return max(0, min(self.config.num_speculative_tokens, left, room))

    def _propose(self, rid: str, num: int) -> list[int]:
        """n-gram drafts (MTP drafts every chunk at once: _append_drafts)."""
        cfg = self.config
        return propose_ngram(self.engine.scheduler.get(rid).all_ids, num, cfg.prompt_lookup_min,
                             cfg.prompt_lookup_max)

    # ---- after the forward ----

    def verify(self, plan: StepPlan, logits, failed: frozenset[str]) -> dict[str, tuple[int, ...]]:
        """Accepted tokens per verify chunk (drafts that agree, then the target's own token); the
        rest rolled back. Requests in `failed` (non-finite logits) are left to the engine."""
        spans = logits.verify_rows
        if not spans:
            return {}
        index = torch.tensor([r for r0, n in spans.values() for r in range(r0, r0 + n)],
                             device=logits.tensor.device)
        rows = logits.tensor.index_select(0, index)
        targets = (rows if logits.are_tokens else rows.argmax(-1)).tolist()  # greedy head: tokens
        out, rollback, at = {}, {}, 0
        chunk_of = {c.request_id: i for i, c in enumerate(plan.chunks)}
        for rid, (_, n) in spans.items():
            target, at = targets[at : at + n], at + n
            if rid in failed:
                continue
            chunk = plan.chunks[chunk_of[rid]]
            drafts = chunk.token_ids[1:]
            live = self.engine.live(rid)
            if live.params.greedy:
                num_ok = 0
                while num_ok < len(drafts) and drafts[num_ok] == target[num_ok]:
                    num_ok += 1
                last = target[num_ok]
            else:  # exact speculative sampling over the chunk's logits rows
                num_ok, last = accept_sampled(rows[at - n : at], drafts, live.params, live.gen)
            out[rid] = tuple(drafts[:num_ok]) + (last,)
            self._count(rid, len(drafts), num_ok)
            if num_ok < len(drafts):  # keep t0 and the accepted drafts: num_ok + 1 positions
                rollback[chunk_of[rid]] = num_ok + 1
                self.engine.cache.truncate(rid, chunk.start_pos + num_ok + 1)
        if logits.verify_record is not None:
            logits.verify_record.rollback(rollback)
        return out

    def _count(self, rid: str, num_drafted: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            s.accepted_per_pos[j] += 1
        if self.config.adaptive:
            gate = self._gates.get(rid)
            if gate is None:
                gate = self._gates[rid] = AdaptiveGate(self.config.adaptive_min_drafts,
                                                       self.config.adaptive_min_acceptance)
            gate.record(num_drafted, num_accepted)
            if not gate.enabled:
                s.num_disabled += 1

    def observe(self, plan: StepPlan, logits) -> None:
        """After the scheduler recorded the step: the MTP drafter reads the new hidden states."""
        if self.mtp is not None:
            self.mtp.observe(plan, self.engine, logits.hidden)

    def forget(self, rid: str) -> None:
        """A request ended: drop its gate (and the MTP drafter's state)."""
        self._gates.pop(rid, None)
        if self.mtp is not None:
            self.mtp.forget(rid)
