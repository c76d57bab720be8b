"""The compact short-context GDN state: the recurrent matrix kept as its history instead of K x V.

From a zero state, S_T = sum_t exp(G_T - G_t) k_t d_t^T (k_t normalised keys, d_t the delta-rule
deltas, G_t cumulative log-decays), so a decode step needs only T x (K + V) numbers per head where
the dense state reads and writes K x V: fewer bytes while T < K*V / (K + V) (64 for 128 x 128).
Measured against the dense step by scripts/cpu/gdn_history_bench.py (verdict in BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.ops.gdn import l2norm


@dataclass(slots=True)
class History:
    keys: torch.Tensor  # [B,HV,Tmax,K] normalised keys
    deltas: torch.Tensor  # [B,HV,Tmax,V]
    log_decay: torch.Tensor  # [B,HV,Tmax] cumulative log-decay G_t at each step
    length: int = 0

    @classmethod
    def empty(cls, bsz: int, num_heads: int, k_dim: int, v_dim: int, capacity: int) -> History:
        return cls(torch.zeros(bsz, num_heads, capacity, k_dim),
                   torch.zeros(bsz, num_heads, capacity, v_dim),
                   torch.zeros(bsz, num_heads, capacity))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def dense(self) -> torch.Tensor:
        """The equivalent recurrent matrix [B,HV,K,V] (to leave compact mode past capacity)."""
        n = self.length
        if n == 0:
            return torch.zeros(*self.keys.shape[:2], self.keys.shape[3], self.deltas.shape[3])
        w = (self.log_decay[..., n - 1 : n] - self.log_decay[..., :n]).exp()
        return (self.keys[:, :, :n] * w[..., None]).transpose(-1, -2) @ self.deltas[:, :, :n]


def gdn_step_history(q, k, v, g, beta, hist: History) -> torch.Tensor:
    """gdn_step (qk_l2norm=True) on a History instead of a dense state; appends one step.
    q, k [B,HV,K]; v [B,HV,V]; g, beta [B,HV]. Returns o [B,HV,V] fp32."""
    n = hist.length
    if n >= hist.capacity:
        raise RuntimeError(f"compact GDN history is full ({n} steps): switch to the dense state")
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    g_now = g.float() + (hist.log_decay[..., n - 1] if n else 0.0)  # [B,HV]
    keys, deltas = hist.keys[:, :, :n], hist.deltas[:, :, :n]
    w = (g_now[..., None] - hist.log_decay[..., :n]).exp()  # [B,HV,T]
    dots = keys @ torch.stack([k, q], dim=-1)  # [B,HV,T,2]: one pass over the keys for both
    weights = (dots * w[..., None]).transpose(-1, -2)  # [B,HV,2,T]
    mixed = weights @ deltas  # [B,HV,2,V]: S^T k and S^T q before this step's update
    delta = (v.float() - mixed[:, :, 0]) * beta.float()[..., None]
    out = mixed[:, :, 1] + (k * q).sum(-1, keepdim=True) * delta
    hist.keys[:, :, n], hist.deltas[:, :, n], hist.log_decay[..., n] = k, delta, g_now
    hist.length = n + 1
    return out
