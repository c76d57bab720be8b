"""The tokenizer a GGUF carries: written here from a tokenizer.json by llama.cpp's converter rules
(tokens padded to the vocabulary with unused [PADn], special added tokens control, other added
tokens user-defined, merges as "a b", the `pre` name), rebuilt by the importer, and equal to the
HF tokenizer it came from on a broad text set; a GGUF alone (no folder around it) loads and
chats with the file's template; missing keys are one clear error."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from deltaserve import LLM, SamplingParams
from deltaserve.checkpoint.default import default_model_dir
from deltaserve.errors import CheckpointError
from deltaserve.quant.gguf_import import import_gguf
from deltaserve.quant.gguf_tokenizer import tokenizer_files

gguf = pytest.importorskip("gguf")

TEXTS = ["Hello world", "def f(x):\n    return x  # comment\n\n\n", "你好，世界！今日は晴れ",
         "emoji 🤖👩‍👩‍👧 done", "   leading and trailing   ", "\t\ttabs\r\nand CRLF\r\n",
         "<|im_start|>user\nhi<|im_end|>\n<think>\n</think>", "don't I'LL we've THEY'RE",
         "1234567890 3.14159 1e-9", "Ünïcödé çafé naïve e\u0301 \u212b", "x" * 60,
         "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
         "a\n\n\nb    c", "import os, sys\nfor i in range(10):\n\tprint(i ** 2)", " ", "",
         "Ω≈ç√∫ ¡™£¢∞§¶ 🇺🇸 ﷽", "mixed<|endoftext|>special"]


def tokenizer_meta(folder, vocab_size: int) -> dict:
    """What llama.cpp's converter (_set_vocab_gpt2) writes for the folder's tokenizer."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, 1
    for added in tok["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], 3 if added["special"] else 4
    ids = {t: i for i, t in enumerate(tokens)}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.ggml.eos_token_id": ids[cfg["eos_token"]],
            "tokenizer.ggml.padding_token_id": ids[cfg["pad_token"]]}
    template = folder / "chat_template.jinja"
    meta["tokenizer.chat_template"] = template.read_text() if template.is_file() else \
        cfg["chat_template"]
    return meta


def write_meta(writer, meta: dict) -> None:
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_add_bos_token(False)
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_chat_template(meta["tokenizer.chat_template"])


@pytest.mark.parametrize("which", ["qwen3.5", "default"])
def test_rebuilt_tokenizer_gives_the_hf_ids(which, tiny_dir) -> None:
    folder, vocab = (tiny_dir, 248320) if which == "qwen3.5" else (default_model_dir(), 8192)
    files = tokenizer_files(tokenizer_meta(folder, vocab))
    ours = Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
        ids = theirs.encode(text).ids
        assert ours.decode(ids, skip_special_tokens=False) == \
            theirs.decode(ids, skip_special_tokens=False), text
    eos = json.loads((folder / "tokenizer_config.json").read_text())["eos_token"]
    assert files["tokenizer_config.json"]["eos_token"] == eos
    assert theirs.token_to_id(eos) in files["eos_ids"]


def test_a_gguf_alone_loads_and_chats_with_its_template(tmp_path) -> None:
    from tests.quant.test_gguf_import import Q, write_gguf

    src = default_model_dir()
    (tmp_path / "alone").mkdir()
    write_gguf(src, tmp_path / "alone" / "m.gguf", Q.F32, Q.F32,
               extra=lambda writer: write_meta(writer, tokenizer_meta(src, 8192)))
    assert sorted(p.name for p in (tmp_path / "alone").iterdir()) == ["m.gguf"]
    ours, theirs = LLM(tmp_path / "alone" / "m.gguf", dtype="float32"), LLM(src, dtype="float32")
    messages = [{"role": "user", "content": "def fib(n):"}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    assert ours.chat(messages, greedy).outputs[0].token_ids == \
        theirs.chat(messages, greedy).outputs[0].token_ids
    assert ours.eos_token_ids == theirs.eos_token_ids | {0}  # <|endoftext|> ends a turn too


@pytest.mark.parametrize(("drop", "message"), [
    ("tokenizer.ggml.merges", "lacks tokenizer.ggml.merges"),
    ("tokenizer.ggml.tokens", "lacks tokenizer.ggml.tokens")])
def test_missing_tokenizer_keys_are_one_clear_error(drop, message) -> None:
    meta = tokenizer_meta(default_model_dir(), 8192)
    del meta[drop]
    with pytest.raises(CheckpointError, match=message):
        tokenizer_files(meta)
    with pytest.raises(CheckpointError, match="pre-tokenizer 'llama-bpe' is not supported"):
        tokenizer_files({**tokenizer_meta(default_model_dir(), 8192),
                         "tokenizer.ggml.pre": "llama-bpe"})


def test_a_file_without_a_tokenizer_names_the_way_out(tmp_path) -> None:
    from tests.quant.test_gguf_import import Q, write_gguf

    write_gguf(default_model_dir(), tmp_path / "m.gguf", Q.F32, Q.F32)
    with pytest.raises(CheckpointError, match="carries no tokenizer.*--tokenizer-from"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")


def test_bad_files_given_as_the_model_are_one_error_line(tmp_path, capsys, monkeypatch) -> None:
    """`--model FILE.gguf` with a truncated file, another architecture, a config that does not
    fit the tensors, an unknown type or a missing part: exit 1 and one `error:` line."""
    from deltaserve.cli import main
    from tests.quant.test_gguf_import import Q, write_gguf

    src = default_model_dir()
    meta = lambda writer: write_meta(writer, tokenizer_meta(src, 8192))  # noqa: E731
    write_gguf(src, tmp_path / "good.gguf", Q.F32, Q.F32, extra=meta)
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "good.gguf").read_bytes()[:100_000])
    write_gguf(src, tmp_path / "q5.gguf", Q.MXFP4, Q.Q8_0, extra=meta)
    wrong = tmp_path / "arch.gguf"
    w = gguf.GGUFWriter(str(wrong), "llama")
    w.add_uint32("llama.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    original = gguf.GGUFWriter.add_uint32
    monkeypatch.setattr(gguf.GGUFWriter, "add_uint32", lambda self, key, val: original(
        self, key, 320 if key == "qwen35.embedding_length" else val))
    write_gguf(src, tmp_path / "shape.gguf", Q.F32, Q.F32, extra=meta)
    monkeypatch.undo()
    write_gguf(src, tmp_path / "s.gguf", Q.F32, Q.F32, split_max_tensors=40, extra=meta)
    parts = sorted(tmp_path.glob("s-*-of-*.gguf"))
    parts[1].unlink()
    for name, needle in (("cut.gguf", "cannot read GGUF file"),
                         ("arch.gguf", "architecture 'llama' is not supported"),
                         ("q5.gguf", "has type MXFP4; supported"),
                         ("shape.gguf", "has shape [8192, 384] but the config expects"),
                         (parts[0].name, f"missing {parts[1].name}")):
        code = main(["generate", "--model", str(tmp_path / name), "-p", "x", "--max-tokens", "1"])
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert code == 1 and len(err) == 1 and needle in err[0], (name, err)
