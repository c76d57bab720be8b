"""Qwen3.5 hybrid decoder (model_type qwen3_5 / qwen3_5_text, and the LM inside minicpmv4_6)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.cache.batch import Injection, StepBatch
from deltaserve.config import FULL, TextConfig
from deltaserve.layers.attention import GatedAttention
from deltaserve.layers.gated_deltanet import GatedDeltaNet
from deltaserve.layers.linear import Linear, linear
from deltaserve.layers.mlp import MLP
from deltaserve.layers.norm import RMSNorm
from deltaserve.layers.rotary import Rotary
from deltaserve.ops.dispatch import stepping
from deltaserve.ops.greedy_head import greedy_tokens
from deltaserve.quant.linear import embed, is_quantized, quant_linear


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_full = cfg.layer_types[layer_idx] == FULL
        if self.is_full:
            self.self_attn = GatedAttention(cfg, dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, h: torch.Tensor, idx: int, batch: StepBatch, cos_sin) -> torch.Tensor:
        """The token mixer of a batched step on the normed input h [1,T,N]."""
        if self.is_full:
            return self.self_attn.forward_batch(h, cos_sin, batch, idx)
        return self.linear_attn.forward_batch(h, batch, idx)

    def mlp_block(self, mixed: torch.Tensor, residual: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(post_attention_layernorm(residual + mixed)), residual + mixed). A decode row on
        the Triton GEMVs computes the add + norm inside gate|up's GEMV (ops/gemv_prologue)."""
        norm = self.post_attention_layernorm
        if mixed.dtype == residual.dtype and self.mlp.gate_up_proj.fuses_prologue(mixed):
            prologue = norm.add_prologue(residual)
            return self.mlp(mixed, prologue), prologue.total
        h, residual = norm.add_forward(mixed, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    """Named `model` in the checkpoint: embed_tokens, layers.*, norm."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    """Forward = embed, 3:1 GDN/attention decoder, final norm, head (tied to the embedding or not)."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.dtype, self.act_dtype = cfg, dtype, act_dtype
        self.model = Backbone(cfg, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self._rotary: Rotary | None = None

    tp = None  # distributed.sharded.TPModel on a tensor-parallel shard: vocabulary-parallel ends
    pp = None  # distributed.pipeline.PPStage on a pipeline stage: a contiguous range of layers

    @property
    def head(self) -> nn.Module:
        """The module whose weight [vocab, N] maps hidden states to logits (maybe quantized)."""
        return self.model.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def rotary(self) -> Rotary:
        if self._rotary is None:
            device = self.device
            self._rotary = Rotary(self.cfg.rotary_dim, self.cfg.rope_theta, device)
        return self._rotary

    @torch.inference_mode()
    def forward_batch(
        self, input_ids: torch.Tensor, batch: StepBatch, all_logits: bool = False,
        greedy: bool = False, inject: Injection | None = None, return_hidden: bool = False,
    ):
        """input_ids [T]: the step's chunks back to back (batch says whose). Logits fp32 of each
        chunk's last token [num_chunks, vocab], or of every token [T, vocab] if all_logits; with
        greedy, the argmax tokens [num_chunks] int64 instead (the logits never materialised).
        inject (rows [R] int64, embeddings [R,N]): those rows of the step take the given input
        embeddings instead of their token's (image placeholders take the vision tower's output).
        return_hidden: (that, every row's final-normed hidden [T,N]) (the MTP drafter's input)."""
        with stepping(batch.native_rows, batch.scratch):
            h = self.hidden_batch(input_ids, batch, inject)
            if h is None:  # the last stage's output comes back: [rows] tokens or [rows, V]
                rows = len(input_ids) if all_logits or not batch.prefill else len(batch.logit_rows())
                out = self.pp.share(None, (rows,) if greedy else (rows, self.cfg.vocab_size),
                                    torch.int64 if greedy else torch.float32)
                return (out, None) if return_hidden else out
            every = h
            if batch.graph_chunk is not None and not all_logits:  # the last real row, on the device
                h = h.index_select(0, batch.graph_chunk.last_row())
            elif not all_logits and batch.prefill:
                h = h.index_select(0, batch.logit_index())
            out = self.head_out(h, greedy)
            if self.pp is not None:
                out = self.pp.share(out, tuple(out.shape), out.dtype)
            return (out, every) if return_hidden else out

    @torch.inference_mode()
    def hidden_batch(self, input_ids: torch.Tensor, batch: StepBatch,
                     inject: Injection | None = None) -> torch.Tensor | None:
        """The final-normed hidden states [T,N] of every row of the step; None on a pipeline
        stage before the last, which sends its residual stream on."""
        with stepping(batch.native_rows, batch.scratch):
            return self._layers(self.embed_input(input_ids[None], inject), batch)

    def _layers(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        cos_sin = self.rotary().cos_sin(batch.positions, self.act_dtype)
        layers, pp = self.model.layers, self.pp
        last_stage = pp is None or pp.is_last
        # each residual add rides in the norm after it (one kernel on GPUs): the mixer's output
        # into post_attention_layernorm, the MLP's into the next layer's input norm (the final norm)
        h, residual = layers[0].input_layernorm(x), x
        for idx, layer in enumerate(layers):
            out, residual = layer.mlp_block(layer.mix(h, idx, batch, cos_sin), residual)
            if idx + 1 < len(layers):
                h, residual = layers[idx + 1].input_layernorm.add_forward(out, residual)
            elif last_stage:
                h, residual = self.model.norm.add_forward(out, residual)
            else:  # the residual stream goes on: the next stage's first input norm takes it
                residual = residual + out
        if not last_stage:
            pp.send(residual)
            return None
        return h[0]

    def embed_input(self, ids: torch.Tensor, inject: Injection | None = None) -> torch.Tensor:
        """ids [B,T] -> the first layer's input [B,T,N]: the embeddings (image rows injected), or
        on a later pipeline stage the residual stream the stage before sent."""
        if self.pp is not None and not self.pp.is_first:
            return self.pp.recv((*ids.shape, self.cfg.hidden_size), self.act_dtype)
        x = self._embed(ids)
        if inject is not None:
            rows, embeds = inject
            x[0].index_copy_(0, rows, embeds.to(x.dtype))
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B,T] -> input embeddings [B,T,N] in the activation dtype."""
        if self.tp is not None:
            return self.tp.embed(self.model.embed_tokens, ids, self.act_dtype)
        return embed(self.model.embed_tokens, ids).to(self.act_dtype)

    def head_out(self, h: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        """h [..., N] -> fp32 logits [..., vocab], or with greedy (h [R,N]) argmax tokens [R]."""
        head = self.head
        if self.tp is not None:
            return self.tp.greedy(h, head) if greedy else self.tp.logits(h, head)
        if greedy:
            return greedy_tokens(h, head)
        return (quant_linear(h, head) if is_quantized(head) else linear(h, head.weight)).float()
