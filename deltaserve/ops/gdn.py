"""Gated delta rule: the sequential recurrence (the spec), the chunked prefill form and the decode step.

All take q and k expanded to HV heads and keep the recurrent state in fp32. With qk_l2norm (the
model's setting) q and k are L2-normalised in fp32 and q is scaled by K^-0.5 inside the op, as
transformers' and fla's kernels do (use_qk_l2norm_in_kernel).
S <- S*exp(g); d = (v - S^T k)*beta; S <- S + k d^T; o = S^T q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) in fp32: eps sits on the sum, as transformers and fla place it."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Projections a, b [..., HV] -> (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), fp32."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _prep_qk(
    q: torch.Tensor, k: torch.Tensor, qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if not qk_l2norm:
        return q.float(), k.float()
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def gdn_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. q, k [B,T,HV,K]; v [B,T,HV,V]; g, beta [B,T,HV]; state [B,HV,K,V].

    Returns (o [B,T,HV,V] fp32, final state [B,HV,K,V] fp32).
    """
    bsz, seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    q, k = _prep_qk(q, k, qk_l2norm)
    s = torch.zeros(bsz, num_heads, k_dim, v_dim) if state is None else state.float().clone()
    s = s.to(q.device)
    out = torch.empty(bsz, seq_len, num_heads, v_dim, dtype=torch.float32, device=q.device)
    for t in range(seq_len):
        s = s * g[:, t].float().exp()[..., None, None]
        kv = torch.einsum("bhkv,bhk->bhv", s, k[:, t].float())
        delta = (v[:, t].float() - kv) * beta[:, t].float()[..., None]
        s = s + k[:, t].float()[..., None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t].float())
    return out, s


def gdn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    qk_l2norm: bool = False,
) -> torch.Tensor:
    """One decode step, updating `state` in place. q, k [B,HV,K]; v [B,HV,V]; g, beta [B,HV].

    state [B,HV,K,V] fp32. Returns o [B,HV,V] fp32.
    """
    q, k = _prep_qk(q, k, qk_l2norm)
    state.mul_(g.float().exp()[..., None, None])
    kv = torch.matmul(k.float().unsqueeze(-2), state).squeeze(-2)  # [B,HV,V]
    delta = (v.float() - kv) * beta.float()[..., None]
    state.add_(k.float().unsqueeze(-1) * delta.unsqueeze(-2))
    return torch.matmul(q.float().unsqueeze(-2), state).squeeze(-2)


def _matmul_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T over matching batch dims (a [..., L, D], b [..., M, D], both contiguous) as one bmm
    on views: the N-d matmul copied every b^T first (87 of 4,930 ms of a 512-token CPU prefill)."""
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]).transpose(1, 2))
    return out.reshape(*a.shape[:-1], b.shape[-2])


def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_len: int = 64,
    qk_l2norm: bool = False,
    on_boundary=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) form of gdn_recurrent_ref; same arguments and results.

    on_boundary(num_tokens_done, state [B,HV,K,V] fp32) is called after each full chunk: the state
    the scan carries there anyway, a fresh tensor (prefix snapshots keep it without a copy).

    Inside a chunk the delta-rule updates collapse into a unit-lower-triangular solve and a few GEMMs;
    across chunks a short sequential scan carries the state. Any T (the tail chunk is zero-padded:
    k = beta = g = 0 leaves the state untouched).
    """
    bsz, seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    pad = (-seq_len) % chunk_len
    # [B,HV,T,*] fp32, padded to a multiple of chunk_len, then split into [B,HV,NC,L,*]
    q, k = _prep_qk(q, k, qk_l2norm)
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)) for x in (g, beta))
    num_chunks = (seq_len + pad) // chunk_len
    q, k, v = (x.reshape(bsz, num_heads, num_chunks, chunk_len, -1) for x in (q, k, v))
    g = g.reshape(bsz, num_heads, num_chunks, chunk_len).cumsum(-1)  # cumulative log-decay G
    beta = beta.reshape(bsz, num_heads, num_chunks, chunk_len, 1)

    causal = torch.ones(chunk_len, chunk_len, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(G_i - G_j) for j <= i (all exponents <= 0, so nothing overflows)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta
    system = _matmul_t(k_beta, k) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0)  # strictly lower part L of (I + L)
    eye = torch.eye(chunk_len, device=q.device)
    rhs = torch.cat([v * beta, k_beta * g.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :v_dim], solved[..., v_dim:]  # u [..,L,V]; w [..,L,K]
    attn = _matmul_t(q, k) * decay  # intra-chunk scores, diagonal included
    q_decayed = q * g.exp().unsqueeze(-1)
    k_to_end = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B,HV,NC,1,1]

    s = (
        torch.zeros(bsz, num_heads, k_dim, v_dim, device=q.device)
        if state is None
        else state.float()
    )
    out = torch.empty(bsz, num_heads, num_chunks, chunk_len, v_dim, device=q.device)
    for c in range(num_chunks):
        v_new = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = q_decayed[:, :, c] @ s + attn[:, :, c] @ v_new
        s = s * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
        if on_boundary is not None and (c + 1) * chunk_len <= seq_len:
            on_boundary((c + 1) * chunk_len, s)
    out = out.reshape(bsz, num_heads, -1, v_dim)[:, :, :seq_len].transpose(1, 2)
    return out, s


def fla_public_prefill(q, k, v, g, beta, state, stops=(), on_boundary=None):
    """fla-core's public chunk kernel, one call per segment between stops (fla versions whose
    stage functions ops/fla_scan cannot import; and the comparison in its tests)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    seq_len, outs, start, s = q.shape[1], [], 0, state
    for stop in [*stops, seq_len]:
        if stop <= start:
            continue
        part = slice(start, stop)
        o, s = chunk_gated_delta_rule(
            q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part].to(q.dtype),
            initial_state=s, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
        if on_boundary is not None and stop in stops:
            on_boundary(stop, s)
        start = stop
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), s
