"""Gated delta rule: the sequential recurrence (the spec), the chunked prefill form and the decode step.

All take q and k expanded to HV heads and keep the recurrent state in fp32. With qk_l2norm (the
model's setting) q and k are L2-normalised in fp32 and q is scaled by K^-0.5 inside the op, as
transformers' and fla's kernels do (use_qk_l2norm_in_kernel).
S <- S*exp(g); d = (v - S^T k)*beta; S <- S + k d^T; o = S^T q.
"""

from __future__ import annotations

import functools

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
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0)  # strictly lower part L of (I + L)
    eye = torch.eye(chunk_len, device=q.device)
    rhs = torch.cat([v * beta, k_beta * g.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :v_dim], solved[..., v_dim:]  # u [..,L,V]; w [..,L,K]
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk scores, diagonal included
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


def fla_usable(q: torch.Tensor) -> bool:
    """fla-core's chunk kernel for the prefill scan: CUDA, 16-bit activations (in fp32 mode its
    tensor-core dots would round to TF32; the torch scan keeps fp32 exact), the triton backend."""
    from deltaserve.env import env
    from deltaserve.ops.backend import triton_enabled

    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and env().fla
            and not env().reference_ops and triton_enabled()
            and _fla_installed())


@functools.cache
def _fla_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


SCAN_MAX_TOKENS = 128  # CUDA: chunks up to this many tokens take the one-launch recurrent scan


def scan_kernel_usable(q: torch.Tensor, v: torch.Tensor) -> bool:
    """ops/triton_gdn_scan for a short chunk on CUDA (triton backend): one launch per layer where
    fla's kernel costs ~0.7 ms of host time (SCAN_MAX_TOKENS: scripts/gpu/scan_tune.py)."""
    return _scan_kernel_takes(q, q.shape[1], q.shape[-1], v.shape[-1])


def _scan_kernel_takes(x: torch.Tensor, seq_len: int, k_dim: int, v_dim: int) -> bool:
    from deltaserve.env import env
    from deltaserve.ops.backend import triton_enabled

    return (x.is_cuda and seq_len <= SCAN_MAX_TOKENS and v_dim % 32 == 0
            and k_dim & (k_dim - 1) == 0 and not env().reference_ops and triton_enabled())


def takes_fla_stages(x: torch.Tensor, k_dim: int, v_dim: int) -> bool:
    """gdn_prefill on a chunk like x [B,T,...] runs ops/fla_scan's stages (so its q and k may come
    L2-normalised already: qk_normed)."""
    if _scan_kernel_takes(x, x.shape[1], k_dim, v_dim) or not fla_usable(x):
        return False
    from deltaserve.ops.fla_scan import stages_available

    return stages_available()


def takes_fla_stages_at(num_tokens: int, dtype: torch.dtype, device, k_dim: int, v_dim: int
                        ) -> bool:
    """takes_fla_stages for a chunk of num_tokens rows of dtype on device (asked at start-up,
    before any chunk exists)."""
    probe = torch.empty(1, num_tokens, 1, dtype=dtype, device=device)
    return takes_fla_stages(probe, k_dim, v_dim)


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, stops: tuple[int, ...] = (), on_boundary=None, qk_normed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill scan with qk L2 norms (qk_normed: q and k come normalised, contiguous; only
    where takes_fla_stages). q, k [B,T,H,K] (H key heads: value head h reads key
    head h // (HV/H)); v [B,T,HV,V]; g, beta [B,T,HV] fp32; state [B,HV,K,V] fp32 (read, not
    written). Returns (o [B,T,HV,V], final state fp32); on_boundary(n, state) is called at least
    at each n in `stops` (token counts, sorted, in (0, T]).

    Short chunks on CUDA: the recurrent Triton scan; longer 16-bit ones: fla-core's stages
    (ops/fla_scan, one pass over all segments between stops); else gdn_chunked."""
    if qk_normed:  # the caller asked takes_fla_stages (GatedDeltaNet._scan, once per layer call)
        from deltaserve.ops.fla_scan import fla_prefill

        return fla_prefill(q, k, v, g, beta, state, stops, on_boundary, qk_normed=True)
    if scan_kernel_usable(q, v):
        from deltaserve.ops.triton_gdn_scan import gdn_scan_cuda

        return gdn_scan_cuda(q, k, v, g, beta, state, stops, on_boundary)
    repeat = v.shape[2] // q.shape[2]
    if not fla_usable(q):
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        return gdn_chunked(q, k, v, g, beta, state, qk_l2norm=True, on_boundary=on_boundary)
    from deltaserve.ops.fla_scan import fla_prefill, stages_available

    if stages_available():
        return fla_prefill(q, k, v, g, beta, state, stops, on_boundary)
    return fla_public_prefill(q, k, v, g, beta, state, stops, on_boundary)


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
