"""Causal GQA softmax attention over a KV cache (torch SDPA), with a plain reference."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from deltaserve.env import env
from deltaserve.ops.native import native_lib


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B,HQ,T,D] are the last T positions of the S cached ones in k, v [B,HKV,S,D].

    Query i sits at position S-T+i and attends to keys 0..S-T+i. Returns [B,HQ,T,D].
    """
    seq_len, cache_len = q.shape[2], k.shape[2]
    if seq_len == 1:
        mask, causal = None, False
    elif seq_len == cache_len:
        mask, causal = None, True
    elif q.is_cuda:  # a chunk behind cached keys (a materialised [T,S] mask would send SDPA
        # to a masked kernel: most of a 32k prefill's time)
        split = _split_attention(q, k, v, scale) if seq_len >= SPLIT_MIN_QUERIES else None
        if split is not None:
            return split
        from torch.nn.attention.bias import causal_lower_right  # FA2's bottom-right variant

        mask, causal = causal_lower_right(seq_len, cache_len), False
    else:
        rows = torch.arange(cache_len - seq_len, cache_len, device=q.device)[:, None]
        mask, causal = torch.arange(cache_len, device=q.device)[None, :] <= rows, False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


_split_checked: bool | None = None  # the split's first result matched FA2's (once per process)
# cuDNN builds a plan per shape at its first call (~40 ms on the H200; the process's first, 1.6 s,
# is moved to start-up by warm_split_attention): the split takes chunks long enough to repay it
# (FA2 at 2,048 queries behind 8k keys is ~0.5 ms per layer), and at most MAX_SPLIT_SHAPES shapes
SPLIT_MIN_QUERIES = 2048
MAX_SPLIT_SHAPES = 256
_split_shapes: set[tuple] = set()


def _cudnn_part(q, k, v, causal: bool, scale: float):
    """cuDNN's attention kernel (Hopper's fastest here) with its log-sum-exp: (o [B,H,T,D],
    lse [B,H,T] fp32). Heads expanded: this internal op takes no GQA."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def _split_attention(q, k, v, scale: float) -> torch.Tensor | None:
    """q [B,HQ,T,D] behind S-T cached keys as two cuDNN calls, the cached keys (no mask) and the
    chunk's own (causal), merged by their log-sum-exps: ~570 TFLOP/s on the H200 where FA2's
    bottom-right variant runs ~300. None where it does not apply (not 16-bit, no cuDNN attention,
    or its first result in this process disagreed with FA2's: then FA2 from there on)."""
    global _split_checked
    if (_split_checked is False or q.dtype not in (torch.bfloat16, torch.float16)
            or not env().split_attention or not torch.backends.cudnn.is_available()
            or torch.cuda.is_current_stream_capturing()):  # (cuDNN builds plans at first use)
        return None
    seq_len, cached = q.shape[2], k.shape[2] - q.shape[2]
    shape = (*q.shape, k.shape[1], cached, q.dtype)
    if shape not in _split_shapes:
        if len(_split_shapes) >= MAX_SPLIT_SHAPES:
            return None
        _split_shapes.add(shape)
    q = q.contiguous()
    try:
        o_old, lse_old = _cudnn_part(q, k[:, :, :cached], v[:, :, :cached], False, scale)
        o_new, lse_new = _cudnn_part(q, k[:, :, cached:], v[:, :, cached:], True, scale)
        lse = torch.logaddexp(lse_old, lse_new)
        out = (o_old.float() * (lse_old - lse).exp()[..., None]
               + o_new.float() * (lse_new - lse).exp()[..., None]).to(q.dtype)
    except torch.cuda.OutOfMemoryError:  # expanded K/V, fp32 parts: FA2 needs neither
        return None
    except RuntimeError:  # this cuDNN / GPU has no such kernel for the shape
        _split_checked = False
        return None
    if _split_checked is None:  # an internal op's contract: checked once against FA2's result
        from torch.nn.attention.bias import causal_lower_right

        want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(
            seq_len, k.shape[2]), scale=scale, enable_gqa=True)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        _split_checked = err <= SPLIT_TOLERANCE
        if not _split_checked:
            return want
    return out


SPLIT_TOLERANCE = 1e-2  # bf16 rounding of two differently ordered sums


def warm_split_attention(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device) -> None:
    """Load cuDNN's attention and run the split's self-check once, at engine start-up, on a small
    shape (its first call in a process takes ~1.6 s on the H200: not the first long prompt's)."""
    if (_split_checked is not None or device.type != "cuda" or not env().split_attention
            or dtype not in (torch.bfloat16, torch.float16)):
        return
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, num_heads, 64, head_dim, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(1, num_kv_heads, 128, head_dim, generator=gen, device=device).to(dtype)
            for _ in range(2))
    _split_attention(q, k, v, head_dim**-0.5)


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Two GEMMs and a masked softmax in fp32, heads expanded explicitly."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(groups, dim=1) for x in (k, v))
    seq_len, cache_len = q.shape[2], k.shape[2]
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    rows = torch.arange(cache_len - seq_len, cache_len, device=q.device)[:, None]
    keys = torch.arange(cache_len, device=q.device)[None, :]
    scores = scores.masked_fill(keys > rows, float("-inf"))
    return scores.softmax(-1) @ v


def qk_prep_ref(proj: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                blocks: torch.Tensor, rows: torch.Tensor, num_heads: int, eps: float
                ) -> torch.Tensor:
    """The gated-attention prologue as the torch layers compose it: proj [T, P] = per head
    [query D | gate D], then k [HKV*D], v [HKV*D]. Returns q [T, HQ, D] after the (1+w) RMSNorm
    and partial rotary; k (normed, rotated) and v of token t go to block blocks[t], row rows[t]."""
    from deltaserve.layers.rotary import apply_rotary
    from deltaserve.ops.norm import rms_norm_ref

    num_tokens = proj.shape[0]
    _, num_kv_heads, _, head_dim = k_pool.shape
    q_end = 2 * num_heads * head_dim
    qg = proj[:, :q_end].reshape(num_tokens, num_heads, 2 * head_dim)
    k = proj[:, q_end : q_end + num_kv_heads * head_dim].reshape(num_tokens, num_kv_heads, -1)
    v = proj[:, q_end + num_kv_heads * head_dim :].reshape(num_tokens, num_kv_heads, -1)
    q = rms_norm_ref(qg[..., :head_dim], q_w, eps, 1.0).transpose(0, 1)[None]  # [1,HQ,T,D]
    k = rms_norm_ref(k, k_w, eps, 1.0).transpose(0, 1)[None]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k_pool[blocks, :, rows] = k[0].transpose(0, 1).to(k_pool.dtype)
    v_pool[blocks, :, rows] = v.to(v_pool.dtype)
    return q[0].transpose(0, 1).contiguous()


def paged_decode_attention_ref(q: torch.Tensor, proj: torch.Tensor, k_pool: torch.Tensor,
                               v_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q [B, HQ, D]: row b attends to its first lengths[b] positions, stored in blocks tables[b]
    of k_pool / v_pool [NB, HKV, L, D]; the result times sigmoid(gate) (gate: the second half of
    each head's [query D | gate D] slice of proj [B, P]). Returns [B, HQ*D] fp32."""
    bsz, num_heads, head_dim = q.shape
    outs = []
    for b in range(bsz):
        length = int(lengths[b])
        k = k_pool[tables[b]].transpose(0, 1).flatten(1, 2)[:, :length]  # [HKV,S,D]
        v = v_pool[tables[b]].transpose(0, 1).flatten(1, 2)[:, :length]
        o = causal_attention_ref(q[b][None, :, None].float(), k[None].float(), v[None].float(),
                                 scale)  # [1,HQ,1,D]
        outs.append(o[0, :, 0])
    gate = proj[:, : 2 * num_heads * head_dim].reshape(bsz, num_heads, 2 * head_dim)[..., head_dim:]
    return (torch.stack(outs) * torch.sigmoid(gate.float())).reshape(bsz, -1)


def paged_decode_attention_cpu(q: torch.Tensor, gate: torch.Tensor, k_pool: torch.Tensor,
                               v_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """paged_decode_attention_ref's contract with the gate given apart (gate [B, HQ, D]), on CPU
    fp32 by the native kernel that the one-call decode step (ops/decode_step.py) also runs, so a
    decode or draft-verify row computed either way is the same bits (its dispatch,
    layers/attention.ATTENTION, checked the kernels are built and every tensor CPU fp32)."""
    fn = native_lib().ds_attend_rows
    if fn.argtypes is None:  # registered beside its one Python caller
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_long] * 2 + [ctypes.c_long]
                       + [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_void_p] * 2
                       + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_int])
        fn.restype = None
    bsz, num_heads, head_dim = q.shape
    q, gate = q.contiguous(), gate.contiguous()
    tables, lengths = tables.to(torch.long).contiguous(), lengths.to(torch.long).contiguous()
    out = torch.empty(bsz, num_heads * head_dim)
    fn(q.data_ptr(), num_heads * head_dim, gate.data_ptr(), num_heads * head_dim, head_dim,
       k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), tables.shape[1],
       lengths.data_ptr(), out.data_ptr(), bsz, num_heads, k_pool.shape[1], head_dim,
       k_pool.shape[2], scale, torch.get_num_threads())
    return out
