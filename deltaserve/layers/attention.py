"""Gated softmax attention of Qwen3.5: per-head query/gate split, (1+w) q/k norms, partial RoPE, GQA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.cache.batch import StepBatch
from deltaserve.cache.state import KVCache
from deltaserve.config import TextConfig
from deltaserve.layers.linear import Linear
from deltaserve.layers.norm import RMSNorm
from deltaserve.layers.rotary import apply_rotary
from deltaserve.ops.attention import causal_attention, paged_decode_attention_cpu
from deltaserve.ops.dispatch import REFERENCE, Case, Op
from deltaserve.ops.native import native_lib
from deltaserve.ops.norm import ROWS, row_case, triton_rows_why_not


class GatedAttention(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        hidden, q_dim = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv_dim = cfg.num_key_value_heads * cfg.head_dim
        # q rows are per head [query D | gate D], then k, then v
        self.qkv_proj = Linear(
            hidden, [2 * q_dim, kv_dim, kv_dim], dtype, parts=["q_proj", "k_proj", "v_proj"]
        )
        self.o_proj = Linear(q_dim, hidden, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv: KVCache
    ) -> torch.Tensor:
        """x [B,T,N] -> [B,T,N]; appends this chunk's K/V to `kv`."""
        bsz, seq_len, _ = x.shape
        qg, k, v = self.qkv_proj.split(self.qkv_proj(x))
        qg = qg.reshape(bsz, seq_len, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = self.q_norm(q).transpose(1, 2)  # [B,HQ,T,D]
        k = self.k_norm(k.reshape(bsz, seq_len, self.num_kv_heads, self.head_dim))
        v = v.reshape(bsz, seq_len, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        k_all, v_all = kv.append(k, v.transpose(1, 2))
        out = causal_attention(q, k_all, v_all, self.head_dim**-0.5)  # [B,HQ,T,D]
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1) * torch.sigmoid(
            gate.reshape(bsz, seq_len, -1)
        )
        return self.o_proj(out)

    def forward_batch(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: StepBatch,
        layer: int,
    ) -> torch.Tensor:
        """x [1,T,N] holding every chunk of the step; K/V go to and come from batch.kv's blocks."""
        c = row_case(x)
        c = Case(c.device, c.dtype, (*c.shape, _is_pow2(self.head_dim),
                                     _is_pow2(batch.kv.block_len), batch.kv.k[layer].dtype),
                 c.native_rows)
        return ATTENTION(c, self, x, cos_sin, batch, layer)

    def _forward_torch(self, x: torch.Tensor, cos_sin, batch: StepBatch, layer: int,
                       native_decode: bool) -> torch.Tensor:
        """torch's ops: SDPA per prefill chunk and over all decode rows (padded keys masked), or
        for the decode rows with native_decode the CPU kernel the one-call decode step runs."""
        num_tokens = x.shape[1]
        qg, k, v = self.qkv_proj.split(self.qkv_proj(x))
        qg = qg.reshape(1, num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        q = self.q_norm(q).transpose(1, 2)  # [1,HQ,T,D]
        k = self.k_norm(k.reshape(1, num_tokens, self.num_kv_heads, self.head_dim))
        v = v.reshape(1, num_tokens, self.num_kv_heads, self.head_dim)
        q, k = _rotary_batch(q, k.transpose(1, 2), cos_sin)
        batch.kv.write(layer, batch.kv_blocks, batch.kv_rows, k[0].transpose(0, 1), v[0])
        out = q.new_empty(1, self.num_heads, num_tokens, self.head_dim)
        scale = self.head_dim**-0.5
        if _fresh_graph_chunk(batch):  # no decode rows, no prefill chunks: to the gate below
            out = _fresh_chunk_attention(q, batch, layer, scale)
        rows = batch.attend_rows() if batch.decode_tables is not None else None
        gated = None  # CPU: the native step's kernel, the rows gated already
        if rows is not None and native_decode:
            gated = paged_decode_attention_cpu(
                q[0, :, rows].transpose(0, 1), gate[0, rows], batch.kv.k[layer],
                batch.kv.v[layer], batch.decode_tables, batch.decode_lengths, scale)
        if rows is not None and gated is None:  # one SDPA over all decode rows, padded keys masked
            k_all, v_all = (t.to(q.dtype) for t in batch.kv.gather_batch(layer, batch.decode_tables))
            q_dec = q[0, :, rows].transpose(0, 1).unsqueeze(2)  # [BD,HQ,1,D]
            o = F.scaled_dot_product_attention(q_dec, k_all, v_all, attn_mask=batch.decode_mask(),
                                               scale=scale, enable_gqa=True)
            out[0, :, rows] = o[:, :, 0].transpose(0, 1)
        for i in batch.prefill:
            chunk, span = batch.chunks[i], batch.span(i)
            table = batch.chunk_table(i, x.device)
            k_all, v_all = (t.to(q.dtype) for t in batch.kv.gather(layer, table, chunk.end_pos))
            out[:, :, span] = causal_attention(q[:, :, span], k_all, v_all, scale)
        out = out.transpose(1, 2).reshape(1, num_tokens, -1) * torch.sigmoid(
            gate.reshape(1, num_tokens, -1)
        )
        if gated is not None:  # those rows come gated already
            out[0, rows] = gated
        return self.o_proj(out)

    def _forward_fused(self, x: torch.Tensor, cos_sin, batch: StepBatch, layer: int
                       ) -> torch.Tensor:
        """The Triton path: one prep kernel (norms, rotary, K/V into the pool), paged attention
        for the decode rows (with the gate), SDPA for prefill chunks."""
        from deltaserve.ops import triton_attention as ta
        from deltaserve.ops.triton_act import sigmoid_gate_cuda

        num_tokens, dim = x.shape[1], self.head_dim
        proj = self.qkv_proj(x)[0]  # [T, P]
        k_pool, v_pool = batch.kv.k[layer], batch.kv.v[layer]
        q = ta.qk_prep_cuda(proj, self.q_norm.weight, self.k_norm.weight, *cos_sin, k_pool,
                            v_pool, batch.kv_blocks, batch.kv_rows, self.num_heads,
                            self.q_norm.eps)  # [T,HQ,D]
        out = proj.new_empty(num_tokens, self.num_heads * dim)
        scale = dim**-0.5
        if _fresh_graph_chunk(batch):
            o = _fresh_chunk_attention(q.transpose(0, 1)[None], batch, layer, scale)[0]
            sigmoid_gate_cuda(o, proj, out)
            return self.o_proj(out[None])
        if batch.decode_tables is not None:
            rows = batch.attend_rows()
            rows = None if isinstance(rows, slice) else rows
            ta.paged_decode_attention_cuda(q, proj, k_pool, v_pool, batch.decode_tables,
                                           batch.decode_lengths, scale, out, rows)
        for i in batch.prefill:
            chunk, span = batch.chunks[i], batch.span(i)
            table = batch.chunk_table(i, x.device)
            k_all, v_all = (t.to(q.dtype) for t in batch.kv.gather(layer, table, chunk.end_pos))
            o = causal_attention(q[span].transpose(0, 1)[None], k_all, v_all, scale)[0]
            sigmoid_gate_cuda(o, proj[span], out[span])  # o * sigmoid(gate) into the rows
        return self.o_proj(out[None])


def _is_pow2(n: int) -> bool:
    """The Triton kernels tile head and block dims whole (every Qwen3.5 config: 64, 256)."""
    return n > 0 and n & (n - 1) == 0


ATTENTION = Op("attention", "gated softmax attention of a step over the paged KV pool",
               (*ROWS, "pow2 head dim", "pow2 block", "K/V dtype"))


def _fused_why_not(c: Case) -> str | None:
    """Triton prologue and paged attention for decode-sized steps and any 16-bit step; fp32
    prefill keeps the torch norms, as transformers runs them (ops/norm.cuda_kernel_rows)."""
    why = triton_rows_why_not(c)
    if why is not None:
        return why
    if not (c.shape[2] and c.shape[3]):
        return "head and block dims not powers of two (the kernels tile them whole)"
    return None


def _native_decode_why_not(c: Case) -> str | None:
    if c.device != "cpu" or c.dtype != torch.float32 or c.shape[4] != torch.float32:
        return "not CPU fp32 activations and K/V"
    return None if native_lib() is not None else "no native kernels"


@ATTENTION.register("triton_fused", 30, _fused_why_not)
def _attention_fused(layer, x, cos_sin, batch, idx):
    return layer._forward_fused(x, cos_sin, batch, idx)


@ATTENTION.register("torch_native_decode", 20, _native_decode_why_not)
def _attention_native_decode(layer, x, cos_sin, batch, idx):
    return layer._forward_torch(x, cos_sin, batch, idx, native_decode=True)


@ATTENTION.register(REFERENCE, 0)
def _attention_torch(layer, x, cos_sin, batch, idx):
    return layer._forward_torch(x, cos_sin, batch, idx, native_decode=False)


ROTARY = Op("rotary", "partial rotary embedding of q and k", ROWS)


def _rotary_batch(q: torch.Tensor, k: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1,HQ,T,D], k [1,HKV,T,D]; on CUDA for decode-sized steps one Triton kernel each."""
    return ROTARY(row_case(q[0, 0]), q, k, *cos_sin)


@ROTARY.register("triton", 30, triton_rows_why_not)
def _rotary_triton(q, k, cos, sin):
    from deltaserve.ops import triton_rope

    return triton_rope.apply_rotary_cuda(q, cos, sin), triton_rope.apply_rotary_cuda(k, cos, sin)


@ROTARY.register(REFERENCE, 0)
def _rotary_torch(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _fresh_graph_chunk(batch: StepBatch) -> bool:
    return batch.graph_chunk is not None and batch.graph_chunk.fresh


def _fresh_chunk_attention(q: torch.Tensor, batch: StepBatch, layer: int, scale: float
                           ) -> torch.Tensor:
    """q [1,HQ,T,D] of a padded graph chunk at position 0 over its own rows' K/V as the pool holds
    them (padding rows read the spare block's row they wrote), causal: no real row sees a padding
    row. Returns [1,HQ,T,D]."""
    k_seq, v_seq = (t.to(q.dtype) for t in batch.kv.read(layer, batch.kv_blocks, batch.kv_rows))
    return causal_attention(q, k_seq, v_seq, scale)
