"""Stage 5 (CPU is enough): teach the last attention layer to copy from context.

Stages 1-4 left the model without in-context retrieval: its attention stayed diffuse. Here every
layer is frozen except the last attention layer (q/k/v/o projections and q/k norms); its inputs
are computed once for a fixed set of needle rows, then only that layer, the MLP after it and the
head run per step. The loss is the needle-answer CE plus next-token CE on sampled positions, so
language-model quality is held while retrieval is learned.

    python scripts/train/finetune_attention.py --data build/stdlib-data --init-from DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data as batches  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--init-from", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-rows", type=int, default=384)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lm-positions", type=int, default=128, help="sampled LM positions per row")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--time-limit-s", type=float, default=1800)
    return ap.parse_args()


def load(path: Path):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    layer_idx = max(i for i, t in enumerate(model.config.layer_types) if t == "full_attention")
    attn = model.model.layers[layer_idx].self_attn
    for p in attn.parameters():
        p.requires_grad_(True)
    return model, layer_idx, attn


@torch.no_grad()
def precompute(model, layer_idx: int, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states entering the trained layer, [N, T, H], computed once."""
    out = []
    for i in range(0, len(tokens), 8):
        hs = model.model(input_ids=tokens[i : i + 8], output_hidden_states=True).hidden_states
        out.append(hs[layer_idx])
    return torch.cat(out)


def tail_forward(model, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
    """The trained layer and everything after it, from its input hidden states."""
    seq_len = hidden.shape[1]
    pos = torch.arange(seq_len).view(1, 1, -1).expand(3, hidden.shape[0], -1)
    rotary = model.model.rotary_emb(hidden, pos)
    for layer in model.model.layers[layer_idx:]:
        out = layer(hidden, position_embeddings=rotary, attention_mask=None)
        hidden = out[0] if isinstance(out, tuple) else out
    return model.model.norm(hidden)


def make_rows(args, nt, stream: np.ndarray):
    rng, key_rng = np.random.default_rng(args.seed), random.Random(args.seed)
    rows, masks = [], []
    for _ in range(args.num_rows):
        ids, mask = batches.needle_row(stream, nt, args.seq_len, rng, key_rng)
        rows.append(ids)
        masks.append(mask)
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(masks))


def step_loss(model, layer_idx, hidden, tokens, mask, lm_positions: int, gen):
    h = tail_forward(model, layer_idx, hidden)
    labels = tokens[:, 1:]
    answer_logits = model.lm_head(h[mask])
    answer = F.cross_entropy(answer_logits, labels[mask])
    pick = torch.randint(0, labels.shape[1], (labels.shape[0], lm_positions), generator=gen)
    h_lm = torch.gather(h, 1, pick[..., None].expand(-1, -1, h.shape[-1]))
    lm = F.cross_entropy(model.lm_head(h_lm).flatten(0, 1), torch.gather(labels, 1, pick).flatten())
    hit = (answer_logits.argmax(-1) == labels[mask]).float().mean()
    return answer, lm, hit


def main() -> None:
    args = parse_args()
    from tokenizers import Tokenizer

    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    stream = np.fromfile(args.data / "train.u16", dtype=np.uint16)
    nt = batches.NeedleTokens.build(tok)
    model, layer_idx, attn = load(args.init_from)
    t0 = time.time()
    tokens, masks = make_rows(args, nt, stream)
    hidden = precompute(model, layer_idx, tokens[:, :-1])
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "layer": layer_idx,
           "precompute_s": round(time.time() - t0, 1), "curve": []}
    print(json.dumps({k: log[k] for k in ("layer", "precompute_s")}), flush=True)
    opt = torch.optim.AdamW(attn.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    for step in range(args.steps):
        idx = torch.randint(0, args.num_rows, (args.batch,), generator=gen)
        answer, lm, hit = step_loss(model, layer_idx, hidden[idx], tokens[idx], masks[idx],
                                    args.lm_positions, gen)
        opt.zero_grad(set_to_none=True)
        (answer + lm).backward()
        opt.step()
        if step % 10 == 0:
            row = {"step": step, "answer": answer.item(), "lm": lm.item(), "answer_acc": hit.item(),
                   "elapsed_s": round(time.time() - t0, 1)}
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
        if time.time() - t0 > args.time_limit_s:
            break
    save(args, model, log)


def save(args, model, log: dict) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(args.init_from / "model.safetensors"))
    state = model.state_dict()
    for name in tensors:
        if name in state and not name.startswith("mtp."):
            tensors[name] = state[name].to(tensors[name].dtype).contiguous()
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    for f in args.init_from.iterdir():
        if f.name not in ("model.safetensors", "train_log.json", "log.txt") and f.is_file():
            shutil.copy(f, args.out / f.name)
    (args.out / "finetune_log.json").write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    main()
