"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), rebuilt as the `tokenizers` JSON the
engine loads, with its chat template and special tokens: what llama.cpp's converter wrote from the
model's tokenizer.json, read back (gpt2-style byte-level BPE; token types 1 normal, 3 control,
4 user-defined, 5 unused padding).

The pre-tokenizer regex is not in the file, only its name (`tokenizer.ggml.pre`); the names of this
family map to the split rules of the HF tokenizers they came from (llama.cpp's llama-vocab.cpp
holds the same expressions). Qwen's tokenizers normalize to NFC and use a word found whole in the
vocabulary before its merges (`ignore_merges`); neither is recorded in GGUF, so both are set here
for these names.
"""

from __future__ import annotations

from deltaserve.errors import CheckpointError

_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
           r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen35": _QWEN35, "qwen2": _QWEN2}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# llama.cpp finds end-of-turn tokens by their text (llama-vocab.cpp); so do we
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>")


def tokenizer_files(meta: dict) -> dict:
    """{"tokenizer.json": dict, "tokenizer_config.json": dict, "chat_template.jinja": str | None,
    "eos_ids": [int]} from a GGUF's metadata; a CheckpointError naming what is missing."""
    def need(key: str):
        if key not in meta:
            raise CheckpointError(f"GGUF metadata lacks {key}: the file carries no usable "
                                  "tokenizer (pass --tokenizer-from FOLDER to import-gguf)")
        return meta[key]

    model = need("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model '{model}' is not supported (gpt2 BPE only)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF pre-tokenizer '{pre}' is not supported (known: "
                              f"{', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = [str(t) for t in need("tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    merges = [str(m) for m in need("tokenizer.ggml.merges")]
    if len(types) != len(tokens):
        raise CheckpointError("GGUF tokenizer: token_type and tokens differ in length")
    vocab, added = {}, []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        # added tokens go in the model's vocabulary too: tokenizers keeps an added token's id
        # only where the model knows it (else it numbers them after the vocabulary)
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": kind == CONTROL})
        if kind != UNUSED:
            vocab[text] = i
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]},
    }

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
              "unk_token": token("unknown"), "clean_up_tokenization_spaces": False}
    eos = [int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta \
        else []
    index = {t["content"]: t["id"] for t in added}
    eos += [index[t] for t in _END_OF_TURN if t in index and index[t] not in eos]
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config,
            "chat_template.jinja": meta.get("tokenizer.chat_template"), "eos_ids": eos}
