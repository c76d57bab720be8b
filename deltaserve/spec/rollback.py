"""Exact GDN state rollback for draft verification.

A verify chunk (the request's pending token and its k drafts) runs through each GDN layer one token
at a time, through the same decode kernel (ops/gdn_decode.gdn_decode_slots) and on the same
in-projection rows that a non-speculative decode step would use. Each token's step writes its
slot's state in place, so the state after token j depends only on tokens <= j: a rejected draft
never reaches the states before it.

Bit-identical to a run that never drafted, by construction, where every op a row passes through
gives the same bits whatever the other rows of its step are. On CPU that holds for: bf16 weights
through the native GEMV / small GEMM (ops/gemv.py, rows <= SMALL_GEMM_MAX_ROWS: each row's dot
products run in the same order), the native RMSNorm (rows <= ops/norm.NATIVE_MAX_ROWS), the fused
GDN step (one slot per row), per-row attention (the native ds_attend_rows the one-call decode
step runs; masked SDPA where that kernel cannot run, measured independent of batch and padded key
width), elementwise ops and the head's GEMM (bf16). It does NOT hold for fp32
weights (MKL's sgemv for one row and sgemm for several differ in the last bits), for steps of more
than NATIVE_MAX_ROWS rows (torch's norm reduction) or on CUDA (cuBLAS picks kernels by M); there
the verified logits differ from single decodes by rounding only, as a batch of decodes differs from
single runs (tests/engine/test_batching.py bounds both at 1e-5). Running the k + 1 tokens as one
chunk through the chunked scan (ops/gdn.py) would break it even on CPU: its arithmetic differs.

Two ways back to the state after the accepted prefix (SpeculativeConfig.rollback):
- "keep": after each token's step, copies of the slots' conv windows and recurrent matrices;
  rollback copies the accepted position's back (k state copies per layer and step, always).
- "recompute": one copy of the slots' state before the first token and the in-projection rows;
  rollback restores it and re-runs the accepted tokens' recurrence steps (only on a rejection).
"""

from __future__ import annotations

import math

import torch

from deltaserve.cache.batch import StepBatch
from deltaserve.ops.gdn_decode import gdn_decode_slots

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # qkv, z, b, a rows


class VerifyRecord:
    """What one step's GDN layers leave for the rollback. steps[j] = (verify chunk indices with a
    token j, their slots [n] on the device); per layer: kept[layer][j] = (conv [n,C,W-1], state
    [n,HV,K,V]) after step j ("keep"), or before[layer] (state before step 0, all chunks) and
    inputs[layer][j] (the rows of step j) ("recompute")."""

    def __init__(self, batch: StepBatch, strategy: str) -> None:
        self.strategy, self.batch = strategy, batch
        chunks, device = batch.chunks, batch.positions.device
        longest = max(chunks[i].num_tokens for i in batch.verify)
        self.steps: list[tuple[list[int], torch.Tensor]] = []
        for j in range(longest):
            members = [i for i in batch.verify if chunks[i].num_tokens > j]
            slots = torch.tensor([chunks[i].slot for i in members], dtype=torch.long, device=device)
            self.steps.append((members, slots))
        self.kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.inputs: dict[int, list[Rows]] = {}
        self.layers: dict[int, torch.nn.Module] = {}

    def native_buffers(self, model_layers) -> tuple[list, list, list]:
        """For the native decode step (ops/decode_step.py), which runs verify_steps' arithmetic in
        C: per layer the flat buffer it fills where verify_steps would keep states ("before" and
        "inputs" for "recompute", "kept" for "keep"; None elsewhere), this record holding views of
        them in verify_steps' layout."""
        states, sizes = self.batch.states, [len(members) for members, _ in self.steps]
        before, inputs, kept = [], [], []
        for layer, conv_pool in enumerate(states.conv):
            bufs = [None, None, None]
            if conv_pool is not None:
                shapes = (conv_pool.shape[1:], states.recurrent[layer].shape[1:])
                if self.strategy == "recompute":
                    bufs[0], views = _carve(sizes[:1], shapes)
                    self.before[layer] = views[0]
                    gdn = self.layers[layer] = model_layers[layer].linear_attn
                    # in-projection rows qkv | z | b | a, as the layer splits them
                    bufs[1], self.inputs[layer] = _carve(sizes, [(n,) for n in gdn.in_proj.out_sizes])
                else:
                    bufs[2], self.kept[layer] = _carve(sizes[:-1], shapes)
            for out, buf in zip((before, inputs, kept), bufs, strict=True):
                out.append(buf)
        return before, inputs, kept

    def rollback(self, accepted: dict[int, int]) -> None:
        """accepted[chunk index] = tokens of that verify chunk whose effect stays (1..len-1):
        every GDN layer's slot state becomes the state right after that many tokens."""
        if not accepted:
            return
        states = self.batch.states
        for layer, conv_pool in enumerate(states.conv):
            if conv_pool is None:
                continue
            if self.strategy == "keep":
                self._restore_kept(layer, accepted, conv_pool, states.recurrent[layer])
            else:
                self._recompute(layer, accepted, conv_pool, states.recurrent[layer])

    def _restore_kept(self, layer, accepted, conv_pool, state_pool) -> None:
        for i, num in accepted.items():
            members, _ = self.steps[num - 1]
            row, slot = members.index(i), self.batch.chunks[i].slot
            conv, state = self.kept[layer][num - 1]
            conv_pool[slot].copy_(conv[row])
            state_pool[slot].copy_(state[row])

    def _recompute(self, layer, accepted, conv_pool, state_pool) -> None:
        conv0, state0 = self.before[layer]
        members0 = self.steps[0][0]
        for i in accepted:
            row, slot = members0.index(i), self.batch.chunks[i].slot
            conv_pool[slot].copy_(conv0[row])
            state_pool[slot].copy_(state0[row])
        for j in range(max(accepted.values())):
            members, _ = self.steps[j]
            redo = [r for r, i in enumerate(members) if accepted.get(i, 0) > j]
            if not redo:
                continue
            slots = torch.tensor([self.batch.chunks[members[r]].slot for r in redo],
                                 dtype=torch.long, device=conv_pool.device)
            index = torch.tensor(redo, dtype=torch.long, device=conv_pool.device)
            rows = tuple(t.index_select(0, index) for t in self.inputs[layer][j])
            _step(self.layers[layer], rows, conv_pool, state_pool, slots)


def _carve(sizes: list[int], shapes) -> tuple[torch.Tensor, list[tuple]]:
    """One flat fp32 buffer holding, step after step, n rows of each shape in turn for a step of
    n slots (the layout ops/csrc/decode_step.c writes); and each step's views [n, *shape]."""
    numels = [math.prod(shape) for shape in shapes]
    flat = torch.empty(sum(sizes) * sum(numels), dtype=torch.float32)
    views, at = [], 0
    for n in sizes:
        step = []
        for shape, numel in zip(shapes, numels, strict=True):
            step.append(flat[at : at + n * numel].view(n, *shape))
            at += n * numel
        views.append(tuple(step))
    return flat, views


def verify_steps(gdn, rows: Rows, batch: StepBatch, layer: int, out: torch.Tensor) -> None:
    """The GDN mixer for batch.verify: token j of every verify chunk in one decode-kernel call,
    j = 0, 1, ...; rows are the step's flat in-projection outputs [T, *]; out [T, HV*V]."""
    record: VerifyRecord = batch.spec
    conv_pool, state_pool = batch.states.conv[layer], batch.states.recurrent[layer]
    if record.strategy == "recompute":
        slots0 = record.steps[0][1]
        record.before[layer] = (conv_pool.index_select(0, slots0),
                                state_pool.index_select(0, slots0))
        record.inputs[layer], record.layers[layer] = [], gdn
    kept = record.kept.setdefault(layer, []) if record.strategy == "keep" else None
    for j, (members, slots) in enumerate(record.steps):
        flat = [batch.offsets[i] + j for i in members]
        step_rows = tuple(t[flat] for t in rows)
        out[flat] = _step(gdn, step_rows, conv_pool, state_pool, slots).to(out.dtype)
        if kept is not None and j + 1 < len(record.steps):  # the last step's state is the slot's
            kept.append((conv_pool.index_select(0, slots), state_pool.index_select(0, slots)))
        elif kept is None:
            record.inputs[layer].append(step_rows)


def _step(gdn, rows: Rows, conv_pool, state_pool, slots: torch.Tensor) -> torch.Tensor:
    """One token per slot: the call GatedDeltaNet.forward_batch makes for its decode rows."""
    qkv, z, b, a = rows
    return gdn_decode_slots(qkv, z, b, a, conv_pool, gdn.conv1d.weight[:, 0], gdn.A_log,
                            gdn.dt_bias, state_pool, slots, gdn.norm.weight, gdn.norm.eps,
                            gdn.num_k_heads)
