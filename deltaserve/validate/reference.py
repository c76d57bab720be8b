"""The ground truth: transformers' Qwen3_5ForCausalLM on the same checkpoint (test/validate extra)."""

from __future__ import annotations

from pathlib import Path

import torch

from deltaserve.checkpoint.reader import TensorIndex, read_config
from deltaserve.errors import DeltaserveError


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' text model with the checkpoint's language-model tensors (mtp/vision ignored)."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError as exc:
        raise DeltaserveError(
            "validation needs transformers: pip install 'deltaserve[validate]'"
        ) from exc
    raw = read_config(model_dir)
    text = raw if raw["model_type"] == "qwen3_5_text" else dict(raw["text_config"])
    text = {k: v for k, v in text.items() if k != "model_type"}
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    config = Qwen3_5TextConfig(**text)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    index = TensorIndex.scan(model_dir)
    state = model.state_dict()
    wanted = [n for n in state if n in index.locations]
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(state) - set(wanted) - tied
    if missing:
        raise DeltaserveError(
            f"transformers expects tensors the checkpoint lacks: {sorted(missing)[:3]}"
        )
    with torch.no_grad():
        for name, tensor in index.tensors(wanted):
            state[name].copy_(tensor)
        # rotary inv_freq is a non-persistent buffer that to_empty left uninitialised
        rotary = model.model.rotary_emb
        inv_freq, _ = rotary.compute_default_rope_parameters(config)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq = inv_freq.clone()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
