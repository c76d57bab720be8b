"""Gated DeltaNet layer: fused in-projections, causal conv + SiLU, delta-rule scan, gated norm, out."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.batch import StepBatch, window_at
from deltaserve.config import TextConfig
from deltaserve.layers.linear import Linear
from deltaserve.layers.norm import GatedRMSNorm
from deltaserve.ops.gdn_decode import gdn_decode_slots
from deltaserve.ops.gdn_prefill import gdn_prefill


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        hidden = cfg.hidden_size
        # rows: [q H*K | k H*K | v HV*V] (conv input), z HV*V, b HV, a HV
        self.in_proj = Linear(
            hidden,
            [cfg.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads],
            dtype,
            parts=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"],
        )
        # conv weight [C,1,W] as in the checkpoint; small, so kept in fp32 with the other 1-D params
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.zeros(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), False)
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, hidden, dtype)

    def _scan(self, qkv, z, b, a, conv_window, recurrent, dtype, stops=(), on_boundary=None):
        """Prefill mixer (ops/gdn_prefill: conv, gates, chunked delta rule; state `recurrent`
        [B,HV,K,V] updated in place), gated norm. Returns (o [B,T,HV*V] in dtype, new window)."""
        bsz, seq_len, _ = qkv.shape
        o, conv_window = gdn_prefill(qkv, a, b, self.conv1d.weight[:, 0], conv_window, self.A_log,
                                     self.dt_bias, recurrent, self.num_k_heads, stops, on_boundary)
        # z as [rows, HV*V]: a view of the projection the norm kernel reads in place
        o = self.norm(o, z.reshape(bsz * seq_len, self.value_dim), dtype)
        o = o.reshape(bsz, seq_len, self.value_dim)
        return o, conv_window

    def forward_batch(self, x: torch.Tensor, batch: StepBatch, layer: int) -> torch.Tensor:
        """x [1,T,N] holding every chunk of the step; states live in batch.states' slots."""
        if batch.graph_chunk is not None:
            return self._graph_chunk(x, batch, layer)
        qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        conv_pool, state_pool = batch.states.conv[layer], batch.states.recurrent[layer]
        out = x.new_empty(x.shape[1], self.value_dim)
        if batch.decode:
            rows = batch.decode_rows()
            all_decode = isinstance(rows, slice)  # then the kernel writes `out` in place
            o = gdn_decode_slots(qkv[0, rows], z[0, rows], b[0, rows], a[0, rows], conv_pool,
                                 self.conv1d.weight[:, 0], self.A_log, self.dt_bias, state_pool,
                                 batch.decode_slots, self.norm.weight, self.norm.eps,
                                 self.num_k_heads, out if all_decode else None)
            if not all_decode:
                out[rows] = o.to(out.dtype)
        if batch.verify:  # drafts: token by token through the same decode kernel (spec/rollback.py)
            from deltaserve.spec.rollback import verify_steps

            verify_steps(self, (qkv[0], z[0], b[0], a[0]), batch, layer, out)
        for i in batch.prefill:
            chunk, span = batch.chunks[i], batch.span(i)
            window = conv_pool[chunk.slot : chunk.slot + 1]
            state = state_pool[chunk.slot : chunk.slot + 1]
            stops = tuple(p - chunk.start_pos for p in chunk.snapshot_at)
            keep = batch.snapshot_hook(i, layer, window, qkv[:, span]) if stops else None
            o, new_window = self._scan(qkv[:, span], z[:, span], b[:, span], a[:, span], window,
                                       state, x.dtype, stops, keep)
            conv_pool[chunk.slot].copy_(new_window[0])
            if len(batch.chunks) == 1:  # the step's only chunk: no copy into the step's rows
                return self.out_proj(o)
            out[span] = o[0]
        return self.out_proj(out.unsqueeze(0))

    def _graph_chunk(self, x: torch.Tensor, batch: StepBatch, layer: int) -> torch.Tensor:
        """One sequence's chunk padded to a fixed length, every index on the device (a captured
        prefill graph, engine/prefill_graph.py): the slot's state and window are gathered, scanned
        and scattered back. Pad rows leave them as they were: their beta = sigmoid(-inf) = 0 and
        decay exp(-A softplus(-inf)) = 1 add exactly nothing, and the new window is taken at the
        real length, not at the padded end."""
        chunk = batch.graph_chunk
        qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        pad = chunk.pad_rows()[None, :, None]  # [1,T,1] True past the real tokens
        b, a = b.masked_fill(pad, float("-inf")), a.masked_fill(pad, float("-inf"))
        conv_pool, state_pool = batch.states.conv[layer], batch.states.recurrent[layer]
        window = conv_pool.index_select(0, chunk.slot)  # [1,C,W-1]
        state = state_pool.index_select(0, chunk.slot)  # [1,HV,K,V], scanned in place
        stops, keep = (), None
        if chunk.snap_states is not None:  # every grid position's state and window, kept
            stops, keep = chunk.snapshot_hook(layer, window[0], qkv[0])
        o, _ = self._scan(qkv, z, b, a, window, state, x.dtype, stops, keep)
        new_window = window_at(window[0], qkv[0], chunk.window_rows(window.shape[-1]))
        conv_pool.index_copy_(0, chunk.slot, new_window[None].to(conv_pool.dtype))
        state_pool.index_copy_(0, chunk.slot, state)
        return self.out_proj(o)
