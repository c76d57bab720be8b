"""The GDN prefill mixer after the in-projection, as one op: causal conv + SiLU, gates, the chunked
delta rule with qk L2 norms (the state updated in place), over a chunk of T > 1 tokens. Its
implementations, best first (ops/dispatch chooses once per case):

- triton_recurrent: chunks up to SCAN_MAX_TOKENS on CUDA: one launch computes the gates, scans
  and leaves the state in place (fla's kernel costs ~0.7 ms of host time per layer there);
- fla_stages_qkv_conv: longer 16-bit chunks: the conv writes contiguous L2-normalised q, k
  (DELTASERVE_CONV_QKV) for fla-core's stages (ops/fla_scan);
- fla_stages: the same stages normalising q, k themselves;
- fla_public: fla-core's public kernel, one call per segment (fla versions without the stages);
- reference: the torch conv, gates and chunked scan (CPU, fp32, DELTASERVE_REFERENCE_OPS=1).

Shapes: qkv [B,T,C] with C = 2 H K + HV V; a, b [B,T,HV]; window [B,C,W-1]; state [B,HV,K,V] fp32.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from deltaserve.env import env
from deltaserve.ops.conv1d import causal_conv1d, causal_conv1d_qkv
from deltaserve.ops.dispatch import REFERENCE, Case, Op, case
from deltaserve.ops.gdn import fla_public_prefill, gdn_chunked, gdn_gates

SCAN_MAX_TOKENS = 128  # CUDA: chunks up to this many tokens take triton_recurrent (scan_tune.py)

GDN_PREFILL = Op("gdn_prefill", "GDN prefill mixer: conv + SiLU, gates, delta-rule scan",
                  (f"T<={SCAN_MAX_TOKENS}", "T>=W-1", "H", "K", "V"))


def gdn_prefill(qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads: int,
                stops: tuple[int, ...] = (), on_boundary=None):
    """Returns (o [B,T,HV,V], new window [B,C,W-1]); `state` ends as the chunk's final state.
    on_boundary(n, state) is called at least at each n in `stops` (sorted, in (0, T])."""
    return GDN_PREFILL(prefill_case(qkv, state, num_k_heads, conv_w.shape[-1]), qkv, a, b,
                       conv_w, window, a_log, dt_bias, state, num_k_heads, stops, on_boundary)


def prefill_case(x: torch.Tensor, state: torch.Tensor, num_k_heads: int, width: int) -> Case:
    """The case of a chunk like x [B,T,...] over a state like `state` [B,HV,K,V]."""
    seq_len, (k_dim, v_dim) = x.shape[1], state.shape[-2:]
    return case(x, (seq_len <= SCAN_MAX_TOKENS, seq_len >= width - 1, num_k_heads, k_dim, v_dim))


def case_at(num_tokens: int, dtype: torch.dtype, device, cfg) -> Case:
    """The case of a chunk of num_tokens rows (asked at start-up, before any chunk exists)."""
    state = torch.empty(1, 1, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                        device=device)
    probe = torch.empty(1, num_tokens, 1, dtype=dtype, device=device)
    return prefill_case(probe, state, cfg.linear_num_key_heads, cfg.linear_conv_kernel_dim)


def _split(qkv, num_k_heads: int, state):
    """The conv output [B,T,C] as q, k [B,T,H,K] and v [B,T,HV,V]."""
    bsz, seq_len, _ = qkv.shape
    _, num_v_heads, k_dim, v_dim = state.shape
    key_dim = num_k_heads * k_dim
    q, k, v = torch.split(qkv, [key_dim, key_dim, num_v_heads * v_dim], dim=-1)
    return (q.reshape(bsz, seq_len, num_k_heads, k_dim), k.reshape(bsz, seq_len, num_k_heads, k_dim),
            v.reshape(bsz, seq_len, num_v_heads, v_dim))


def _triton_why_not(c: Case) -> str | None:
    short, _, _, k_dim, v_dim = c.shape
    if c.device != "cuda":
        return "not a CUDA tensor"
    if not short:
        return f"over {SCAN_MAX_TOKENS} tokens"
    if v_dim % 32 or k_dim & (k_dim - 1):
        return f"head dims K={k_dim} (a power of two) V={v_dim} (a multiple of 32) not tiled"
    from deltaserve.ops.backend import triton_enabled

    return None if triton_enabled() else "the triton backend is off"


@GDN_PREFILL.register("triton_recurrent", 40, _triton_why_not)
def _triton_recurrent(qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
                      on_boundary):
    from deltaserve.ops.triton_gdn_scan import gdn_scan_gated_cuda

    conv, window = causal_conv1d(qkv, conv_w, window)
    q, k, v = _split(conv, num_k_heads, state)
    if state.dtype == torch.float32 and state.is_contiguous():  # (the engine's pools always)
        return gdn_scan_gated_cuda(q, k, v, a, b, a_log, dt_bias, state, stops, on_boundary), window
    live = state.float().contiguous()
    o = gdn_scan_gated_cuda(q, k, v, a, b, a_log, dt_bias, live, stops, on_boundary)
    state.copy_(live)
    return o, window


def _fla_why_not(c: Case) -> str | None:
    """fla-core's kernels: CUDA, 16-bit activations (in fp32 mode their tensor-core dots would
    round to TF32; the torch scan keeps fp32 exact), the triton backend, chunks the recurrent
    kernel does not take."""
    if c.device != "cuda" or c.dtype not in (torch.bfloat16, torch.float16):
        return "not 16-bit CUDA activations"
    if _triton_why_not(c) is None:
        return "triton_recurrent takes it"
    if not env().fla:
        return "DELTASERVE_FLA=0"
    from deltaserve.ops.backend import triton_enabled

    if not triton_enabled():
        return "the triton backend is off"
    return None if fla_installed() else "fla-core is not installed"


def _stages_why_not(c: Case) -> str | None:
    from deltaserve.ops.fla_scan import stages_available

    return _fla_why_not(c) or (None if stages_available() else
                               "this fla-core's stage functions cannot be imported")


def _qkv_conv_why_not(c: Case) -> str | None:
    from deltaserve.ops.triton_conv1d import qkv_usable

    _, enough, num_k_heads, k_dim, _ = c.shape
    if not env().conv_qkv:
        return "DELTASERVE_CONV_QKV=0"
    if not enough:
        return "fewer tokens than the conv window"
    if not qkv_usable(num_k_heads * k_dim, k_dim):
        return f"head dim {k_dim} is not whole-tiled by the qkv conv"
    return _stages_why_not(c)


@GDN_PREFILL.register("fla_stages_qkv_conv", 30, _qkv_conv_why_not)
def _fla_stages_qkv_conv(qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
                         on_boundary):
    from deltaserve.ops import fla_scan

    bsz, seq_len, _ = qkv.shape
    _, num_v_heads, k_dim, v_dim = state.shape
    q, k, v, window = causal_conv1d_qkv(qkv, conv_w, window, num_k_heads * k_dim, k_dim)
    q, k = (t.reshape(bsz, seq_len, num_k_heads, k_dim) for t in (q, k))
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    o, final = fla_scan.fla_prefill(q, k, v.reshape(bsz, seq_len, num_v_heads, v_dim), g, beta,
                                    state, stops, on_boundary, qk_normed=True)
    state.copy_(final)
    return o, window


@GDN_PREFILL.register("fla_stages", 25, _stages_why_not)
def _fla_stages(qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
                on_boundary):
    from deltaserve.ops import fla_scan

    return _unfused(fla_scan.fla_prefill, qkv, a, b, conv_w, window, a_log, dt_bias, state,
                    num_k_heads, stops, on_boundary)


@GDN_PREFILL.register("fla_public", 20, _fla_why_not)
def _fla_public(qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
                on_boundary):
    return _unfused(fla_public_prefill, qkv, a, b, conv_w, window, a_log, dt_bias, state,
                    num_k_heads, stops, on_boundary)


@GDN_PREFILL.register(REFERENCE, 0)
def _torch_chunked(qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
                   on_boundary):
    def scan(q, k, v, g, beta, s, stops, on_boundary):
        repeat = v.shape[2] // q.shape[2]
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        return gdn_chunked(q, k, v, g, beta, s, qk_l2norm=True, on_boundary=on_boundary)

    return _unfused(scan, qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
                    on_boundary)


def _unfused(scan, qkv, a, b, conv_w, window, a_log, dt_bias, state, num_k_heads, stops,
             on_boundary):
    """conv, split, gates, then scan(q, k, v, g, beta, state, stops, on_boundary) -> (o, final)."""
    conv, window = causal_conv1d(qkv, conv_w, window)
    q, k, v = _split(conv, num_k_heads, state)
    g, beta = gdn_gates(a, b, a_log, dt_bias)  # [B,T,HV]
    o, final = scan(q, k, v, g, beta, state, stops, on_boundary)
    state.copy_(final)
    return o, window


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None
