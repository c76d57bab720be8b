"""The trained model's shape, its MTP head, and the fla fast path for training on a GPU.

Training runs transformers' own Qwen3_5ForCausalLM (the reference implementation, built for
training); the MTP block is assembled from its decoder layer and norms.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.checkpoint.presets import text_config

MODEL_NAME = "stdlib-19m"
MAX_CONTEXT_LEN = 8192


def model_config(
    vocab_size: int, attn_head_dim: int = 64, attn_heads: int = 6, attn_kv_heads: int = 2
) -> dict:
    """8 layers (GDN x3 + gated attention) x 2, hidden 384: ~19M parameters, ~37-39 MB in bf16."""
    cfg = text_config(384, 896, 8, attn_heads, attn_kv_heads, 6, 6, True)
    cfg.update(
        architectures=["Qwen3_5ForCausalLM"],
        head_dim=attn_head_dim,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        vocab_size=vocab_size,
        max_position_embeddings=MAX_CONTEXT_LEN,
        eos_token_id=2,  # <|im_end|>; <|endoftext|> (0) also stops, via generation_config
        bos_token_id=None,
        pad_token_id=0,
    )
    # rotary dim = head_dim * 0.25 (16 at head_dim 64): head_dim / 8 frequencies over three axes
    freqs = attn_head_dim // 8
    first = -(-freqs // 3)
    second = -(-(freqs - first) // 2)
    cfg["rope_parameters"]["mrope_section"] = [first, second, freqs - first - second]
    return cfg


class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction block: h_t (final-normed) and embed(x_{t+1}) -> x_{t+2}."""

    def __init__(self, hf_config, full_layer_idx: int) -> None:
        super().__init__()
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        h, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = m.Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = m.Qwen3_5RMSNorm(h, eps=eps)
        self.norm = m.Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList([m.Qwen3_5DecoderLayer(hf_config, full_layer_idx)])

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, rotary) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x)
        batch, seq_len = x.shape[:2]
        pos = torch.arange(seq_len, device=x.device).view(1, 1, -1).expand(3, batch, -1)
        out = self.layers[0](x, position_embeddings=rotary(x, pos), attention_mask=None)
        return self.norm(out[0] if isinstance(out, tuple) else out)


def use_fla(model: nn.Module) -> str:
    """Swap transformers' torch chunked delta rule for fla's Triton kernel where fla is installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - any import failure means the torch path
        return f"torch chunked path (fla unavailable: {type(exc).__name__}: {exc})"
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    calls = {"n": 0}

    def fla_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
        calls["n"] += 1
        return chunk_gated_delta_rule(
            query, key, value, g=g, beta=beta, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )

    m.torch_chunk_gated_delta_rule = fla_chunk
    for mod in model.modules():
        for name in ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"):
            if type(mod).__name__ == "Qwen3_5GatedDeltaNet" and hasattr(mod, name):
                setattr(mod, name, fla_chunk)
    device = next(model.parameters()).device
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        model(torch.zeros(1, 128, dtype=torch.long, device=device))
    return "fla chunk_gated_delta_rule" if calls["n"] else "torch chunked path (fla patch not used)"
