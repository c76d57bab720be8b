"""A model's tensor-parallel ends: the vocabulary-parallel embedding and head, and the reductions
hooked onto its row-parallel projections. Set on a model built from the local config
(shard.TPPlan.local_config) whose tensors were sliced by the same plan.

Shapes: T tokens, R rows (hidden states that reach the head), N hidden, Vr vocabulary rows per rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from deltaserve.distributed.comm import Comm
from deltaserve.distributed.shard import TPPlan
from deltaserve.layers.linear import linear
from deltaserve.ops.greedy_head import greedy_tokens
from deltaserve.quant.linear import embed, is_quantized, quant_linear, row_view

# row-parallel projection (module attribute name) -> its reduction's tensor class
ROW_PARALLEL = {"o_proj": "attn", "out_proj": "gdn", "down_proj": "ffn"}


class TPModel:
    """model.tp: what the model's forward calls at its two vocabulary ends."""

    def __init__(self, plan: TPPlan, comm: Comm) -> None:
        self.plan, self.comm = plan, comm
        self.rank, self.size = plan.rank, plan.size

    def embed(self, table: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [..., T] -> [..., T, N] in dtype: each rank looks up the ids in its vocabulary
        rows (others give zeros), one exact all-reduce adds them (a row plus zeros is exact)."""
        local = ids - self.plan.vocab_start
        inside = (local >= 0) & (local < self.plan.vocab_valid)
        rows = embed(table, local.clamp(0, self.plan.vocab_valid - 1)).to(dtype)
        rows = torch.where(inside.unsqueeze(-1), rows, 0.0)
        return self.comm.all_reduce(rows)

    def logits(self, h: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """h [..., N] -> fp32 logits [..., vocab]: local [..., Vr] gathered in rank order."""
        local = (quant_linear(h, head) if is_quantized(head) else linear(h, head.weight)).float()
        return self.comm.all_gather_last(local)[..., : self.plan.cfg.vocab_size]

    def greedy(self, h: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """h [R, N] -> argmax tokens [R] int64 without gathering logits: each rank's best token
        and its logit, gathered; the highest wins (the lower rank, so the lower id, on ties)."""
        valid = self.plan.vocab_valid
        view = head if valid == self.plan.vocab_rows else _head_rows(head, valid)
        idx = greedy_tokens(h, view)  # [R] local ids
        # the winner's logit again, from its head row: the same dot product the head computed
        value = (embed(head, idx).float() * h.float()).sum(-1)  # [R]
        both = torch.stack([value, (idx + self.plan.vocab_start).to(value.dtype)])  # [2, R]
        gathered = self.comm.all_gather_last(both[:, :, None])  # [2, R, ranks]
        best = gathered[0].argmax(-1, keepdim=True)  # first maximum: lowest rank
        return gathered[1].gather(-1, best)[:, 0].long()


def _head_rows(head: nn.Module, rows: int):
    """The head restricted to its first `rows` vocabulary rows (the padding dropped)."""
    if not is_quantized(head):
        return SimpleNamespace(weight=head.weight[:rows])
    return row_view(head, 0, rows)


def attach(model: nn.Module, plan: TPPlan, comm: Comm) -> None:
    """Hook the reductions onto every row-parallel Linear and set model.tp."""
    from deltaserve.layers.linear import Linear

    for name, module in model.named_modules():
        cls = ROW_PARALLEL.get(name.rpartition(".")[2])
        if cls is not None and isinstance(module, Linear):
            module.reduce = comm.reducer(cls)
    model.tp = TPModel(plan, comm)
