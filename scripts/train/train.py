"""Train the embedded default model (a small Qwen3.5 hybrid) on one GPU; writes a checkpoint dir.

    python scripts/train/train.py --data build/stdlib-data --out OUT [--steps N] [--smoke]

Loss = next-token CE + 0.3 x MTP (token t+2) CE + needle-answer CE (the answer tokens of the
retrieval episodes, averaged on their own so the rare tokens carry weight). The checkpoint that
retrieves best (then: lowest held-out loss) is kept. Everything needed to reproduce it goes
into train_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import data as batches  # noqa: E402
from model import MAX_CONTEXT_LEN, MODEL_NAME, MTPHead, model_config, use_fla  # noqa: E402

MTP_WEIGHT = 0.3


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=MAX_CONTEXT_LEN)
    ap.add_argument("--num-needle", type=int, default=2, help="needle episodes per batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit-s", type=float, default=540.0)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--long-every", type=int, default=0,
                    help="every Nth step uses --long-len rows (batch --long-batch, half needle)")
    ap.add_argument("--long-len", type=int, default=MAX_CONTEXT_LEN)
    ap.add_argument("--long-batch", type=int, default=2)
    ap.add_argument("--num-repeat", type=int, default=0, help="repeat rows per batch")
    ap.add_argument("--num-random-repeat", type=int, default=0,
                    help="rows of repeated random key-alphabet strings per batch")
    ap.add_argument("--single-episode", action="store_true",
                    help="one needle episode per needle row (stage 1) instead of packed episodes")
    ap.add_argument("--answer-weight", type=float, default=1.0)
    ap.add_argument("--init-from", type=Path, help="continue from a saved checkpoint dir")
    ap.add_argument("--attn-head-dim", type=int, default=64)
    ap.add_argument("--attn-heads", type=int, default=6)
    ap.add_argument("--attn-kv-heads", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu only for a quick check of the script")
    return ap.parse_args()


def build(args, vocab_size: int, device):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = model_config(vocab_size, args.attn_head_dim, args.attn_heads, args.attn_kv_heads)
    hf_cfg = Qwen3_5TextConfig(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(hf_cfg).to(device)
    mtp = MTPHead(hf_cfg, cfg["layer_types"].index("full_attention")).to(device)
    mtp.apply(model._init_weights)
    if args.init_from:
        load_weights(args.init_from, model, mtp)
    return cfg, model, mtp


def load_weights(path: Path, model, mtp) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    mtp_sd = {k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")}
    lm_sd = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(lm_sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"init-from mismatch: missing {missing}, unexpected {unexpected}")
    mtp.load_state_dict(mtp_sd)
    model.tie_weights()


def losses(model, mtp, tokens, answer_mask):
    """(lm, mtp, answer) mean CE (answer is 0 without needle rows) and the next-token logits."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast(tokens.device.type, torch.bfloat16):
        hidden = model.model(input_ids=x).last_hidden_state
        logits = model.lm_head(hidden).float()
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        next_emb = model.model.embed_tokens(x[:, 1:])
        h2 = mtp(hidden[:, :-1], next_emb, model.model.rotary_emb)
        logits2 = model.lm_head(h2).float()
        ce2 = F.cross_entropy(logits2.flatten(0, 1), y[:, 1:].flatten())
    answer = ce[answer_mask].mean() if answer_mask.any() else ce.new_zeros(())
    return ce.mean(), ce2, answer, logits


@torch.no_grad()
def evaluate(model, mtp, heldout: torch.Tensor, seq_len: int, needle_sets) -> dict:
    model.eval()
    n_win = (heldout.numel() - 1) // seq_len
    tot, tot2, count = 0.0, 0.0, 0
    for i in range(0, n_win, 4):
        idx = torch.arange(i, min(i + 4, n_win), device=heldout.device)[:, None] * seq_len
        tokens = heldout[idx + torch.arange(seq_len + 1, device=heldout.device)]
        lm, l2, _, _ = losses(model, mtp, tokens, torch.zeros_like(tokens[:, 1:], dtype=torch.bool))
        tot, tot2, count = tot + lm.item() * len(idx), tot2 + l2.item() * len(idx), count + len(idx)
    out = {"heldout_loss": tot / count, "heldout_mtp_loss": tot2 / count, **copy_losses(model, heldout)}
    for name, (tokens, mask) in needle_sets.items():
        ok = []
        for j in range(0, len(tokens), 4):
            _, _, _, logits = losses(model, mtp, tokens[j : j + 4], mask[j : j + 4])
            hit = (logits.argmax(-1) == tokens[j : j + 4, 1:]) | ~mask[j : j + 4]
            ok += hit.all(-1).tolist()
        out[f"needle_{name}"] = sum(ok) / len(ok)
    model.train()
    return out


def copy_losses(model, heldout: torch.Tensor, chunk_len: int = 200) -> dict:
    """Held-out CE on the first and the second copy of [chunk, chunk] rows: a model that copies
    in context drives the second far below the first (the precondition for needle retrieval)."""
    chunks = [heldout[i * 9973 : i * 9973 + chunk_len] for i in range(8)]
    pairs = torch.stack([torch.cat([c, c]) for c in chunks])
    with torch.autocast(pairs.device.type, torch.bfloat16):
        logits = model(pairs[:, :-1]).logits.float()
    ce = F.cross_entropy(logits.transpose(1, 2), pairs[:, 1:], reduction="none")
    return {"copy_first": ce[:, : chunk_len - 1].mean().item(),
            "copy_second": ce[:, chunk_len:].mean().item()}


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab: int) -> float:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def param_groups(modules, wd: float):
    decay, no_decay = [], []
    for mod in modules:
        for name, p in mod.named_parameters():
            (decay if p.ndim == 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def main() -> None:
    args = parse_args()
    from tokenizers import Tokenizer

    device = torch.device(args.device)
    t_start = time.time()
    tok = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    train_np = np.fromfile(args.data / "train.u16", dtype=np.uint16)
    held_np = np.fromfile(args.data / "heldout.u16", dtype=np.uint16)
    train_gpu = torch.from_numpy(train_np.astype(np.int64)).to(device)
    held_gpu = torch.from_numpy(held_np.astype(np.int64)).to(device)
    cfg, model, mtp = build(args, vocab, device)
    use_torch = args.no_fla or device.type != "cuda"
    kernel = "torch chunked path" if use_torch else use_fla(model)
    nt = batches.NeedleTokens.build(tok)
    needle_sets = {
        f"{n}@0.6": tuple(t.to(device) for t in batches.eval_needles(held_np, nt, n, 16, 0.6, 1))
        for n in sorted({512, 2048, args.seq_len, args.long_len})
    }
    opt = torch.optim.AdamW(param_groups([model, mtp], 0.1), lr=args.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=device.type == "cuda")
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "kernel": kernel,
           "num_params": sum(p.numel() for p in model.parameters()),
           "num_mtp_params": sum(p.numel() for p in mtp.parameters()),
           "unigram_heldout_loss": unigram_loss(train_np, held_np, vocab),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "torch": torch.__version__,
           "curve": [], "evals": []}
    print(json.dumps({k: log[k] for k in ("kernel", "num_params", "num_mtp_params",
                                          "unigram_heldout_loss")}), flush=True)
    best = train_loop(args, model, mtp, opt, train_gpu, train_np, held_gpu, nt, needle_sets, log)
    log["wall_s"] = time.time() - t_start
    save(args, cfg, best, log)


def train_loop(args, model, mtp, opt, train_gpu, train_np, held_gpu, nt, needle_sets, log):
    rng, key_rng = np.random.default_rng(args.seed), random.Random(args.seed)
    torch.manual_seed(args.seed)
    best, t0, tokens_seen = None, time.time(), 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        long = args.long_every and step % args.long_every == args.long_every - 1
        shape = ((args.long_batch, args.long_len, args.long_batch // 2) if long
                 else (args.batch, args.seq_len, args.num_needle))
        tokens, mask = batches.make_batch(train_gpu, train_np, nt, *shape, rng, key_rng,
                                          0 if long else args.num_repeat, args.single_episode,
                                          0 if long else args.num_random_repeat)
        lm, l2, answer, _ = losses(model, mtp, tokens, mask)
        loss = lm + MTP_WEIGHT * l2 + args.answer_weight * answer
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), 1.0)
        opt.step()
        tokens_seen += tokens.shape[0] * (tokens.shape[1] - 1)
        if step == 15:  # fit the schedule to the time limit, from the measured step time
            fit_steps_to_time(args, step, time.time() - t0, log)
        if step % 10 == 0 or step == args.steps - 1:
            row = {"step": step, "tokens": tokens_seen, "lm": lm.item(), "mtp": l2.item(),
                   "answer": answer.item(), "grad_norm": gnorm.item(), "lr": lr_at(step, args),
                   "elapsed_s": round(time.time() - t0, 1)}
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
        last = step == args.steps - 1 or time.time() - t0 > args.time_limit_s
        if (step + 1) % args.eval_every == 0 or last:
            ev = {"step": step, "tokens": tokens_seen,
                  **evaluate(model, mtp, held_gpu, max(args.seq_len, args.long_len), needle_sets)}
            log["evals"].append(ev)
            print(json.dumps(ev), flush=True)
            if best is None or selection_key(ev) > selection_key(best["eval"]):
                best = {"eval": ev, "model": _cpu(model), "mtp": _cpu(mtp)}
        if last:
            log["stopped_at_step"] = step
            break
    log["train_s"] = time.time() - t0
    log["tokens_per_s"] = tokens_seen / log["train_s"]
    return best


def selection_key(ev: dict) -> tuple[float, float]:
    """Keep the checkpoint that retrieves best (mean over the needle sets), then the lowest loss."""
    scores = [v for k, v in ev.items() if k.startswith("needle_")]
    return (round(sum(scores) / max(1, len(scores)), 3), -ev["heldout_loss"])


def fit_steps_to_time(args, step: int, elapsed_s: float, log: dict) -> None:
    step_s = elapsed_s / (step + 1)  # includes the first steps' kernel compilation: conservative
    fitted = max(step + 2, int(args.time_limit_s / step_s))
    if fitted < args.steps:
        args.steps = fitted
        args.eval_every = max(1, fitted // 6)
    log["fitted"] = {"step_s": step_s, "steps": args.steps, "eval_every": args.eval_every}
    print(json.dumps(log["fitted"]), flush=True)


def _cpu(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def save(args, cfg: dict, best: dict, log: dict) -> None:
    from safetensors.torch import save_file

    out = args.out / MODEL_NAME
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in best["model"].items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        tensors[name] = t
    tensors.update({f"mtp.{k}": v for k, v in best["mtp"].items()})
    for name, t in tensors.items():
        keep_f32 = name.endswith("linear_attn.A_log") or name.endswith("linear_attn.norm.weight")
        tensors[name] = t.to(torch.float32 if keep_f32 else torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": True, "temperature": 0.7,
           "top_k": 20, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "manifest.json",
                 "tokenizer_report.json"):
        shutil.copy(args.data / name, out / name)
    log["best"] = best["eval"]
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(json.dumps({"saved": str(out), "best": best["eval"], "tokens_per_s": log["tokens_per_s"]}))


if __name__ == "__main__":
    main()
