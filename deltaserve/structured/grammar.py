"""Compiling StructuredOutputsParams into xgrammar grammars for one tokenizer, and the masks.

xgrammar was chosen over llguidance by measurement (scripts/cpu/grammar_engines.py, record
docs/benchmarks/2026-12-03-cpu-694c66f-grammar-engines.json, the 248k Qwen3.5 vocabulary): per-step mask
3.9 µs against 6.8 µs at batch 1 (worst step 0.15 ms against 2.0 ms), 0.43 ms against 0.88 ms at
batch 64, tokenizer set-up 1.5 s against 5.1 s; it also knows Qwen's XML tool-call parameters.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import torch

from deltaserve.errors import RequestError
from deltaserve.structured.params import StructuredOutputsParams

log = logging.getLogger("deltaserve.structured")
CACHE_ENTRIES = 256  # compiled grammars kept (xgrammar keeps its own byte-bounded cache too)
# free whitespace in JSON is bounded per gap (llama.cpp's schema grammars allow 20 as well): a
# model cannot spend its whole budget on spaces, and indented output still fits
MAX_JSON_WHITESPACE = 20
BATCH_FILL_FROM = 4  # constrained rows from which masks are filled on xgrammar's threads


class Grammars:
    """One per engine: the tokenizer's xgrammar info (built on first use: ~1 s for a 248k
    vocabulary) and compiled grammars cached by StructuredOutputsParams.key()."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._compiler = None
        self._batch = None  # xgrammar's BatchGrammarMatcher (its thread pool), on first use
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # compiles may come from the server's worker threads

    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            start = time.perf_counter()
            fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.eos_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            log.info("grammar engine ready for a %d-token vocabulary in %.1f s",
                     self.vocab_size, time.perf_counter() - start)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (cached); a RequestError naming why it cannot be compiled."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                compiled = _compile(self.compiler(), params)
            except RequestError:
                raise
            except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
                raise RequestError(f"the {params.kind} constraint cannot be compiled: "
                                   f"{str(exc).strip().splitlines()[0] if str(exc) else exc}"
                                   ) from None
            self._cache[key] = compiled
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, params: StructuredOutputsParams):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(params))

    def fill(self, matchers: list, words: torch.Tensor, rows: list[int]) -> None:
        """Each matcher's next-token bitmask into words[rows[i]] ([K, ceil(V/32)] int32 on the
        host); several on xgrammar's threads (a mask takes ~4 us to 0.2 ms on the 248k vocabulary:
        the threads pay from a few rows on)."""
        import xgrammar as xgr

        if len(matchers) < BATCH_FILL_FROM:
            for matcher, row in zip(matchers, rows, strict=True):
                matcher.fill_next_token_bitmask(words, row)
            return
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, words, rows)


def _compile(compiler, params: StructuredOutputsParams):
    kind, ws = params.kind, not params.disable_any_whitespace
    if kind == "json":
        schema = params.json
        text = json.dumps({} if schema is True else schema)
        return _json(compiler, text, ws, strict=True)
    if kind == "json_object":
        return _json(compiler, '{"type": "object"}', ws, strict=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(params.choice))
    if kind == "grammar":
        return compiler.compile_grammar(params.grammar)
    import xgrammar as xgr

    tag = xgr.Grammar.from_structural_tag(params.structural_tag)
    return compiler.compile_grammar(tightened(str(tag)))


def _json(compiler, schema: str, any_whitespace: bool, strict: bool):
    """A JSON schema's grammar, bounded (bounded())."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace, strict_mode=strict,
        max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None,
        separators=None if any_whitespace else (",", ":"))
    return compiler.compile_grammar(tightened(str(grammar)))


def tightened(ebnf: str) -> str:
    """xgrammar's printed grammar with its unbounded runs bounded as llama.cpp's schema grammars
    bound them (at most 16 integer, fraction and exponent digits, 20 blanks in a row: a model
    that starts repeating a digit or a newline would otherwise write it until its token limit),
    and the characters of length-bounded strings kept to what JSON allows unescaped (xgrammar
    lets control characters into them, which no JSON parser reads)."""
    out = ebnf.replace(_FREE_INTEGER, f"[1-9] [0-9]{{0,{MAX_DIGITS - 1}}}")
    out = out.replace(_FREE_DIGITS, f"basic_number_digits{{1,{MAX_DIGITS}}}")
    out = out.replace(_LOOSE_CHAR, r'[^\0-\x1f\"\\\r\n]')
    return out.replace(_FREE_BLANKS, f"[ \\n\\r\\t]{{0,{MAX_JSON_WHITESPACE}}}")


MAX_DIGITS = 16
# how xgrammar (0.2) prints an unbounded integer part, fraction / exponent digits, blanks and a
# bounded string's character; a test (tests/structured) checks that they still appear, so a new
# xgrammar cannot drop the repair silently
_FREE_INTEGER, _FREE_DIGITS = "[1-9] [0-9]*", "basic_number_digits{1, -1}"
_FREE_BLANKS = "[ \\n\\r\\t]*"
_LOOSE_CHAR = r'[^\"\\\r\n]'


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """root ::= "a" | "b" ... (each choice as an escaped EBNF string literal)."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


def _literal(text: str) -> str:
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif code < 0x20 or code == 0x7F:  # \u takes exactly 4 digits (\x would read on)
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
