"""Short prefill scans on CUDA GPUs (Triton): gdn_recurrent_ref's recurrence in one launch.

A prefill chunk of a few dozen tokens (a prefix-cache hit's new tokens, an image question, a
speculative verify span) costs ~0.7 ms of host time per layer through fla's chunk kernel (8 launches
through autotuners and wrappers) against tens of microseconds of GPU work. This kernel walks the
tokens in order, one program per (sequence, value head, block of 32 value columns) holding its
K x 32 slice of the state in registers: one launch per layer, host cost of one Triton call.
States at requested positions (prefix snapshots) are written as the walk passes them, in fp32:
the exact state the walk carries on from.
"""

from __future__ import annotations

import torch

from deltaserve.ops.backend import tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

BLOCK_V = 32  # value columns per program, as in the decode kernel (no register spills at K=128)

if triton is not None:

    @triton.jit
    def _scan_kernel(Q, KK, VV, Q_SB, Q_ST, K_SB, K_ST, V_SB, V_ST, G, BETA, S0, O, ST, SNAP_AT,
                     SNAPS, T, B, HV, GROUP, K: tl.constexpr, V: tl.constexpr,
                     BLOCK_V: tl.constexpr):
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // GROUP
        ks, vs = tl.arange(0, K), vb * BLOCK_V + tl.arange(0, BLOCK_V)
        state_at = ((b * HV + h) * K + ks[:, None]) * V + vs[None, :]
        s = tl.load(S0 + state_at)  # [K, BLOCK_V] fp32
        for t in range(0, T):
            q = tl.load(Q + b * Q_SB + t * Q_ST + kh * K + ks).to(tl.float32)
            k = tl.load(KK + b * K_SB + t * K_ST + kh * K + ks).to(tl.float32)
            v = tl.load(VV + b * V_SB + t * V_ST + h * V + vs).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) / tl.sqrt(K * 1.0)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
            row = (b * T + t) * HV + h
            s = s * tl.exp(tl.load(G + row))
            delta = (v - tl.sum(s * k[:, None], 0)) * tl.load(BETA + row)
            s += k[:, None] * delta[None, :]
            tl.store(O + row * V + vs, tl.sum(s * q[:, None], 0))
            snap = tl.load(SNAP_AT + t)  # -1, or the index of the snapshot taken after token t
            if snap >= 0:
                tl.store(SNAPS + (snap * B * HV) * K * V + state_at, s)
        tl.store(ST + state_at, s)


def _token_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] readable with (batch, token) strides: each token's heads contiguous."""
    if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]:
        return t
    return t.contiguous()


def gdn_scan_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, stops: tuple[int, ...] = (),
                  on_boundary=None) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/gdn.gdn_prefill's contract with qk L2 norms: q, k [B,T,H,K] (value head h reads key head
    h // (HV/H)), v [B,T,HV,V], any float dtype; g, beta [B,T,HV] fp32; state [B,HV,K,V] fp32 (read,
    not written). Returns (o [B,T,HV,V] fp32, final state); on_boundary(n, state) at each n in
    `stops` (0 < n <= T), with the fp32 state after token n."""
    bsz, seq_len, num_k_heads, k_dim = q.shape
    num_heads, v_dim = v.shape[2], v.shape[3]
    q, k, v = _token_rows(q), _token_rows(k), _token_rows(v)
    g, beta = g.float().contiguous(), beta.float().contiguous()
    state = state.float().contiguous()
    wanted = [n for n in stops if 0 < n <= seq_len]
    snap_at = torch.full((seq_len,), -1, dtype=torch.int32)
    for i, n in enumerate(wanted):
        snap_at[n - 1] = i
    snap_at = snap_at.to(q.device, non_blocking=True)
    snaps = torch.empty(max(len(wanted), 1), bsz, num_heads, k_dim, v_dim, dtype=torch.float32,
                        device=q.device)
    out = torch.empty(bsz, seq_len, num_heads, v_dim, dtype=torch.float32, device=q.device)
    final = torch.empty_like(state)
    block_v = min(BLOCK_V, v_dim)
    _scan_kernel[(bsz, num_heads, v_dim // block_v)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g, beta, state, out, final, snap_at, snaps, seq_len, bsz, num_heads,
        num_heads // num_k_heads, K=k_dim, V=v_dim, BLOCK_V=block_v, num_warps=4)
    if on_boundary is not None:
        for i, n in enumerate(wanted):
            on_boundary(n, snaps[i])
    return out, final
