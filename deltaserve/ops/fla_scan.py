"""fla-core's chunked gated delta rule for long prefill chunks, driven from its stage functions.

The public `chunk_gated_delta_rule` returns only the final state, so a chunk that must leave prefix
snapshots at every 64th position called it once per 64-token segment: 8 launches and ~0.8 ms of
host time per segment and layer (a 4k-token prompt: 1,152 calls, ~1 s on an H200 that computes it
in 0.14 s). The stages are independent per 64-token chunk except the state pass, so here they run
once over the whole span: L2 norms, the chunk-local decay cumsum, the intra-chunk WY
representation, the state pass (one launch; with stops it runs on fp32 inputs so the per-chunk
states it stores are the fp32 states it carries: the snapshots) and the output stage. fla's
64-token chunks are counted from the call's first token, so a stop off that grid (a chunk starting
mid-grid, a granularity not a multiple of 64) starts a new call there.
"""

from __future__ import annotations

import functools

import torch

CHUNK_LEN = 64  # fla's chunk size (its fused intra-chunk path is written for 64)
TUNE_TOKENS = (1024, 8192)  # tune() clamps its length into this range
tuned: int | None = None  # the prefill length the process tuned fla at (engine/runner.py)


def tune(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, seq_len: int,
         dtype: torch.dtype, device) -> None:
    """One pass of the stages on random inputs of a GDN layer's shape at seq_len tokens (clamped
    to TUNE_TOKENS), without and with snapshot stops (their state pass runs in fp32: its own
    configs), so fla's autotuner picks its configs at a prefill length, not at whatever comes first.
    Its keys leave out the length: a 300-token first call made the 8k WY solve 2.9 ms, not 0.9, on
    the H200. deltaserve.ops keeps the choice per process (FLA_CACHE_RESULTS=0)."""
    seq_len = min(max(seq_len, TUNE_TOKENS[0]), TUNE_TOKENS[1])
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k = (rnd(1, seq_len, num_k_heads, k_dim).to(dtype) for _ in range(2))
    v = rnd(1, seq_len, num_v_heads, v_dim).to(dtype)
    g = -torch.rand(1, seq_len, num_v_heads, device=device, generator=gen)
    beta = torch.rand(1, seq_len, num_v_heads, device=device, generator=gen)
    state = torch.zeros(1, num_v_heads, k_dim, v_dim, device=device)
    for stops in ((), (CHUNK_LEN,)):
        fla_prefill(q, k, v, g, beta, state, stops, lambda n, s: None)


def _stages():
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    return l2norm_fwd, chunk_local_cumsum, RCP_LN2, chunk_gated_delta_rule_fwd_intra, \
        chunk_gated_delta_rule_fwd_h, chunk_fwd_o


@functools.cache
def stages_available() -> bool:
    """fla-core's stage functions import under the names this driver calls (fla 0.6); asked per
    GDN layer call, answered once per process."""
    try:
        _stages()
    except (ImportError, AttributeError):
        return False
    return True


def _aligned_span(q, k, v, g, beta, state, cuts, on_stop):
    """The stages over one span whose cuts are multiples of CHUNK_LEN from its first token; q and
    k already L2-normalised. on_stop(n, state) after each cut. Returns (o, final state)."""
    _, cumsum, rcp_ln2, intra, state_pass, output = _stages()
    g = cumsum(g, chunk_size=CHUNK_LEN, scale=rcp_ln2)
    w, u, _ = intra(k=k, v=v, g=g, beta=beta, chunk_size=CHUNK_LEN)
    if cuts:
        # fla's state pass stores each chunk's starting state in its inputs' dtype; fed fp32, it
        # stores the fp32 state it carries, so one launch leaves every snapshot exact
        h, v_new, s = state_pass(k=k.float(), w=w.float(), u=u.float(), g=g, initial_state=state,
                                 output_final_state=True, chunk_size=CHUNK_LEN)
        for n in cuts:
            on_stop(n, h[:, n // CHUNK_LEN].clone())
        h, v_new = h.to(q.dtype), v_new.to(q.dtype)
    else:
        h, v_new, s = state_pass(k=k, w=w, u=u, g=g, initial_state=state,
                                 output_final_state=True, chunk_size=CHUNK_LEN)
    o = output(q=q, k=k, v=v_new, h=h, g=g, scale=q.shape[-1] ** -0.5, chunk_size=CHUNK_LEN)
    return o, s


def fla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, stops: tuple[int, ...] = (),
                on_boundary=None, qk_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/gdn.gdn_prefill's contract (16-bit q, k, v on CUDA; qk L2 norms inside unless
    qk_normed: the conv normalised them, ops/conv1d.causal_conv1d_qkv). Returns
    (o [B,T,HV,V] in q's dtype, final state fp32)."""
    if not qk_normed:
        l2norm, *_ = _stages()
        q, _ = l2norm(q.contiguous())
        k, _ = l2norm(k.contiguous())
    v, g = v.contiguous(), g.float().contiguous()
    state = state.float().contiguous()  # the state pass indexes its initial state as contiguous
    beta = beta.to(q.dtype).contiguous()
    seq_len = q.shape[1]
    cuts = sorted(n for n in set(stops) if 0 < n < seq_len)

    def stop_at(offset: int):
        return lambda n, s: on_boundary(offset + n, s) if on_boundary is not None else None

    # spans whose cuts sit on fla's chunk grid counted from the span's first token
    spans, start, inner = [], 0, []
    for n in cuts:
        if (n - start) % CHUNK_LEN == 0:
            inner.append(n)
        else:
            spans.append((start, n, inner))
            start, inner = n, []
    spans.append((start, seq_len, inner))
    outs, s = [], state
    for start, end, inner in spans:
        part = slice(start, end)
        o, s = _aligned_span(*(t[:, part].contiguous() for t in (q, k, v, g, beta)), s,
                             [n - start for n in inner], stop_at(start))
        outs.append(o)
        if end < seq_len or seq_len in stops:
            stop_at(0)(end, s)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), s
