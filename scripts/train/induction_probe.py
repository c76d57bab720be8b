"""Does a small Qwen3.5 hybrid learn in-context copying? A minutes-long check before a long run.

Trains a 4-layer model (hidden 128, [GDN x3, attention]) on rows that are half plain text, half
`[chunk, chunk]` repeats, and prints the held-out loss of the first and of the second copy: a
model that copies drives the second far below the first. stdlib-19m v1 never did.

    python scripts/train/induction_probe.py --head-dim 256 --heads 1 --steps 300 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data as batches  # noqa: E402

from deltaserve.checkpoint.presets import text_config  # noqa: E402


def build(head_dim: int, heads: int, device: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = text_config(128, 384, 4, heads, 1, 2, 2, True)
    cfg.update(head_dim=head_dim, linear_key_head_dim=64, linear_value_head_dim=64,
               vocab_size=8192, max_position_embeddings=4096)
    freqs = head_dim // 8  # rotary dim = head_dim / 4, one frequency per pair
    cfg["rope_parameters"]["mrope_section"] = [freqs - 2 * (freqs // 3), freqs // 3, freqs // 3]
    hf_cfg = Qwen3_5TextConfig(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(hf_cfg).to(device)


def copy_losses(model, pairs: torch.Tensor) -> tuple[float, float]:
    """Mean CE over the first copy and over the second copy of each [chunk, chunk] row."""
    half = pairs.shape[1] // 2
    with torch.no_grad():
        logp = model(pairs[:, :-1]).logits.float().log_softmax(-1)
    ce = -logp.gather(-1, pairs[:, 1:, None]).squeeze(-1)
    return round(ce[:, : half - 1].mean().item(), 3), round(ce[:, half:].mean().item(), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("build/stdlib-data"))
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = build(args.head_dim, args.heads, args.device)
    stream = np.fromfile(args.data / "train.u16", dtype=np.uint16)
    held = np.fromfile(args.data / "heldout.u16", dtype=np.uint16).astype(np.int64)
    chunks = [held[i * 997 : i * 997 + 128] for i in range(8)]
    pairs = torch.from_numpy(np.stack([np.concatenate([c, c]) for c in chunks])).to(args.device)
    stream_t = torch.from_numpy(stream.astype(np.int64)).to(args.device)
    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0 = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 30)
        starts = torch.randint(0, stream_t.numel() - args.seq_len - 1, (args.batch,))
        tokens = stream_t[starts[:, None].to(args.device) + torch.arange(args.seq_len + 1,
                                                                         device=args.device)]
        for row in range(args.batch // 2):
            tokens[row] = torch.from_numpy(batches.repeat_row(stream, 0, args.seq_len, rng))
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            first, second = copy_losses(model, pairs)
            print(json.dumps({"head_dim": args.head_dim, "step": step, "loss": round(loss.item(), 3),
                              "first_copy": first, "second_copy": second,
                              "elapsed_s": round(time.time() - t0)}), flush=True)


if __name__ == "__main__":
    main()
