"""How a step executes. ModelRunner.execute offers the step to each executor in turn and takes the
first that runs it (the one place that decides):

1. engine/cuda_graph.DecodeGraphs: every chunk a single-token decode, replayed from a CUDA graph;
2. engine/prefill_graph.PrefillGraphs: one sequence's chunk as captured pieces;
3. NativeDecode: a CPU step of decode and verify rows, every layer in one native call
   (ops/decode_step; the dispatcher's decode_step op says whether it runs here);
4. Eager: the model's batched forward, which takes any step.

Each has execute_step(step) -> StepLogits, or None when it does not take the step; results stay
on the device. With keep_hidden (the MTP drafter reads every row's final hidden) the graph
executors are not built, and StepLogits.hidden carries the rows.
"""

from __future__ import annotations

import torch

from deltaserve.cache.batch import StepBatch
from deltaserve.engine.step import Step, StepLogits, step_logits
from deltaserve.ops import decode_step
from deltaserve.ops.dispatch import stepping


class Eager:
    def __init__(self, model, greedy: bool, keep_hidden: bool) -> None:
        self.model, self.greedy, self.keep_hidden = model, greedy, keep_hidden

    def execute_step(self, step: Step, hidden: bool = False) -> StepLogits:
        """hidden: every row's final hidden kept for this step (prompt logprobs)."""
        batch = step.batch()
        keep = self.keep_hidden or hidden
        out = self.model.forward_batch(step.ids_tensor(), batch, greedy=self.greedy,
                                       inject=step.injection(), return_hidden=keep)
        out, hidden = out if keep else (out, None)
        logits = step_logits(out, step.plan)
        logits.verify_record, logits.hidden = batch.spec, hidden
        step.store_snapshots(logits, batch.snapshots)
        return logits


class NativeDecode:
    """The one-call CPU decode step. Its plan (pointers to every weight, norm and pool) is built
    once per set of pools and kept here, not in the model."""

    def __init__(self, model, greedy: bool, keep_hidden: bool) -> None:
        self.model, self.greedy, self.keep_hidden = model, greedy, keep_hidden
        self._plan: tuple | None = None  # (pools key, decode_step.DecodePlan or None)

    def execute_step(self, step: Step) -> StepLogits | None:
        if any(len(c.token_ids) > 1 and not c.num_draft for c in step.plan.chunks):
            return None  # a prefill chunk (said before any batch is built)
        if step.injection() is not None:
            return None
        batch = step.batch()
        out = self.forward(step.ids_tensor(), batch)
        if out is None:
            return None
        out, hidden = out
        logits = step_logits(out, step.plan)
        logits.verify_record, logits.hidden = batch.spec, hidden
        return logits

    def forward(self, ids: torch.Tensor, batch: StepBatch
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(the head's output for ids [T], every row's final hidden if kept), or None where the
        plan does not run this batch (the layers then do)."""
        plan = self.plan_for(batch)
        if plan is None:
            return None
        model = self.model
        with stepping(batch.native_rows, batch.scratch):
            x = model.embed_input(ids[None])
            cos_sin = model.rotary().cos_sin(batch.positions, model.act_dtype)
            steps, _buffers = decode_step.gdn_steps(batch, model.model.layers)  # alive for run
            h = plan.run(x[0], steps, batch.positions, batch.decode_tables, *cos_sin)
            return model.head_out(h, self.greedy), (h if self.keep_hidden else None)

    def plan_for(self, batch: StepBatch):
        """The native decode plan when this step is decode and draft-verify rows only on CPU, no
        more of them than the plan's kernels take (no tensor or pipeline split), else None. Only
        for batch.native_rows (the runner's decode-only steps): there the layered path runs the
        per-row kernels the plan runs, so both give the same bits."""
        model = self.model
        if batch.prefill or batch.graph_chunk is not None or model.tp is not None \
                or model.pp is not None or model.device.type != "cpu" or not batch.native_rows \
                or (batch.verify and batch.spec is None):  # verify rows need their record
            return None
        key = decode_step.pools_key(batch.states, batch.kv)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, decode_step.build_plan(model, batch.states, batch.kv))
        plan = self._plan[1]
        return plan if plan is not None and batch.num_tokens <= plan.max_rows else None


class VulkanStep:
    """Every step on the Vulkan device (vulkan/runtime.VulkanModel): one command buffer for the
    step, or, where a prefill chunk wants prefix snapshots inside it, one per piece up to each
    snapshot position, the slot's state read back between pieces. The greedy-only head's tokens
    are the GPU's argmax (the logits stay there)."""

    def __init__(self, model, greedy: bool) -> None:
        self.model, self.vk, self.greedy = model, model.vulkan, greedy

    def execute_step(self, step: Step) -> StepLogits:
        chunks, ids = step.chunks(), step.ids()
        if any(c.verify for c in chunks) or step.injection() is not None:
            raise AssertionError("vulkan: drafts and image rows are refused before a step")
        pools = step.cache
        snaps: dict[int, dict] = {}
        if not any(c.snapshot_at for c in chunks):
            out = self.vk.step(chunks, ids, _last_rows(chunks), pools, self.greedy)
        else:
            out, offset = [], 0
            for i, c in enumerate(chunks):
                out.append(self._chunk(c, ids[offset:offset + c.num_tokens], pools,
                                       snaps.setdefault(i, {})))
                offset += c.num_tokens
            out = torch.cat(out)
        logits = step_logits(out, step.plan)
        step.store_snapshots(logits, snaps)
        return logits

    def _chunk(self, c, ids: list[int], pools, snaps: dict) -> torch.Tensor:
        """One chunk in pieces ending at its snapshot positions; the last piece's last logits."""
        from deltaserve.cache.batch import SeqChunk

        cuts = sorted(p for p in c.snapshot_at if c.start_pos < p < c.end_pos) + [c.end_pos]
        start, out = c.start_pos, None
        for end in cuts:
            piece = SeqChunk(c.slot, start, end - start, c.block_table)
            out = self.vk.step([piece], ids[start - c.start_pos:end - c.start_pos],
                               [end - start - 1], pools, self.greedy)
            if end in c.snapshot_at:
                snaps[end] = {layer: s for layer, s in enumerate(pools.states.snapshot(c.slot))
                              if s is not None}
            start = end
        return out


def _last_rows(chunks) -> list[int]:
    rows, r = [], 0
    for c in chunks:
        r += c.num_tokens
        rows.append(r - 1)
    return rows
