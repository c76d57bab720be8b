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
    elif q.is_cuda:  # a chunk behind cached keys: flash attention's bottom-right causal variant
        # (a materialised [T,S] mask sends SDPA to a masked kernel: most of a 32k prefill's time)
        from torch.nn.attention.bias import causal_lower_right

        mask, causal = causal_lower_right(seq_len, cache_len), False
    else:
        rows = torch.arange(cache_len - seq_len, cache_len, device=q.device)[:, None]
        mask, causal = torch.arange(cache_len, device=q.device)[None, :] <= rows, False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


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
                               scale: float) -> torch.Tensor | None:
    """paged_decode_attention_ref's contract with the gate given apart (gate [B, HQ, D]), on CPU
    fp32 by the native kernel that the one-call decode step (ops/decode_step.py) also runs, so a
    decode or draft-verify row computed either way is the same bits. None where it cannot run."""
    lib = native_lib()
    tensors = (q, gate, k_pool, v_pool)
    if lib is None or env().reference_ops or any(
            t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    fn = lib.ds_attend_rows
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
