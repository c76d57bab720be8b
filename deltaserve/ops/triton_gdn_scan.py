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
    def _gates(G, BETA, A, B_RAW, AB_SB, AB_ST, ALOG, DTB, b, t, h, row, GATED: tl.constexpr):
        """(decay log g, beta) of token t, value head h: given, or from the raw projections a, b
        (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), as ops/gdn.gdn_gates)."""
        if GATED:
            x = tl.load(A + b * AB_SB + t * AB_ST + h).to(tl.float32) + tl.load(DTB + h)
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
            g = -tl.exp(tl.load(ALOG + h)) * softplus
            raw = tl.load(B_RAW + b * AB_SB + t * AB_ST + h).to(tl.float32)
            beta = 1.0 / (1.0 + tl.exp(-raw))
        else:
            g = tl.load(G + row)
            beta = tl.load(BETA + row)
        return g, beta

    @triton.jit
    def _scan_kernel(Q, KK, VV, Q_SB, Q_ST, K_SB, K_ST, V_SB, V_ST, G, BETA, A, B_RAW, AB_SB,
                     AB_ST, ALOG, DTB, S0, O, ST, SNAP_AT, SNAPS, T, B, HV, GROUP,
                     K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
                     GATED: tl.constexpr, HAS_SNAPS: tl.constexpr):
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // GROUP
        ks, vs = tl.arange(0, K), vb * BLOCK_V + tl.arange(0, BLOCK_V)
        state_at = ((b * HV + h) * K + ks[:, None]) * V + vs[None, :]
        s = tl.load(S0 + state_at)  # [K, BLOCK_V] fp32 (S0 may be ST: each program owns its slice)
        for t in range(0, T):
            q = tl.load(Q + b * Q_SB + t * Q_ST + kh * K + ks).to(tl.float32)
            k = tl.load(KK + b * K_SB + t * K_ST + kh * K + ks).to(tl.float32)
            v = tl.load(VV + b * V_SB + t * V_ST + h * V + vs).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) / tl.sqrt(K * 1.0)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
            row = (b * T + t) * HV + h
            g, beta = _gates(G, BETA, A, B_RAW, AB_SB, AB_ST, ALOG, DTB, b, t, h, row, GATED)
            s = s * tl.exp(g)
            delta = (v - tl.sum(s * k[:, None], 0)) * beta
            s += k[:, None] * delta[None, :]
            tl.store(O + row * V + vs, tl.sum(s * q[:, None], 0))
            if HAS_SNAPS:
                snap = tl.load(SNAP_AT + t)  # -1, or the index of the snapshot after token t
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
    final = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    gates = (g.float().contiguous(), beta.float().contiguous())
    out = _launch(q, k, v, gates, None, state.float().contiguous(), final, stops, on_boundary)
    return out, final


def gdn_scan_gated_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                        state: torch.Tensor, stops: tuple[int, ...] = (),
                        on_boundary=None) -> torch.Tensor:
    """The layer's form: the gates from the raw projections a, b [B,T,HV] (views of the input
    projection are read in place) and `state` [B,HV,K,V] fp32 updated in place to the final state:
    one launch instead of the gate ops, the scan and a state copy. Returns o [B,T,HV,V] fp32."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the in-place scan needs a contiguous fp32 state")
    raw = (_head_rows(a), _head_rows(b), a_log.float().contiguous(), dt_bias.float().contiguous())
    if raw[0].stride()[:2] != raw[1].stride()[:2]:
        raw = (raw[0].contiguous(), raw[1].contiguous(), *raw[2:])
    return _launch(q, k, v, None, raw, state, state, stops, on_boundary)


def _head_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, T, HV] readable with (batch, token) strides and unit head stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, v, gates, raw, state_in, state_out, stops, on_boundary) -> torch.Tensor:
    bsz, seq_len, num_k_heads, k_dim = q.shape
    num_heads, v_dim = v.shape[2], v.shape[3]
    q, k, v = _token_rows(q), _token_rows(k), _token_rows(v)
    wanted = sorted({n for n in stops if 0 < n <= seq_len})
    out = torch.empty(bsz, seq_len, num_heads, v_dim, dtype=torch.float32, device=q.device)
    snap_at = snaps = out  # placeholders the kernel never reads without HAS_SNAPS
    if wanted:
        marks = torch.full((seq_len,), -1, dtype=torch.int32)
        for i, n in enumerate(wanted):
            marks[n - 1] = i
        snap_at = marks.to(q.device, non_blocking=True)
        snaps = torch.empty(len(wanted), bsz, num_heads, k_dim, v_dim, dtype=torch.float32,
                            device=q.device)
    g, beta = gates if gates is not None else (out, out)
    a, b, a_log, dt_bias = raw if raw is not None else (out, out, out, out)
    block_v = min(BLOCK_V, v_dim)
    _scan_kernel[(bsz, num_heads, v_dim // block_v)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g, beta, a, b, a.stride(0), a.stride(1) if a.dim() > 1 else 0, a_log, dt_bias,
        state_in, out, state_out, snap_at, snaps, seq_len, bsz, num_heads,
        num_heads // num_k_heads, K=k_dim, V=v_dim, BLOCK_V=block_v, GATED=raw is not None,
        HAS_SNAPS=bool(wanted), num_warps=4)
    if on_boundary is not None:
        for i, n in enumerate(wanted):  # each its own tensor: the prefix cache counts its bytes
            on_boundary(n, snaps[i].clone())
    return out
