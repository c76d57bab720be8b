"""`deltaserve validate`: our engine vs transformers on the same checkpoint and prompt."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

import torch

from deltaserve.cache.sequence import Sequence
from deltaserve.engine.args import EngineArgs
from deltaserve.engine.llm import LLM
from deltaserve.progress import bar
from deltaserve.validate.reference import load_reference

DEFAULT_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}


@dataclass(frozen=True, slots=True)
class Comparison:
    logits_rel_l2: float  # over every prompt position
    num_greedy_tokens: int
    num_greedy_equal: int  # identical prefix length
    first_divergence: int | None  # index into the generated tokens, None if all equal
    ours_tokens: list[int]
    reference_tokens: list[int]


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


class _Ticks:
    """A transformers streamer that advances a bar one step per generated token (put() is told
    of the prompt first)."""

    def __init__(self, shown) -> None:
        self.shown, self.prompt_seen = shown, False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.shown.update(1)
        self.prompt_seen = True

    def end(self) -> None:
        pass


def compare(llm: LLM, reference, prompt_ids: list[int], num_tokens: int,
            shown=None) -> Comparison:
    """shown: a progress bar told of 2 * (num_tokens + 1) steps (the reference's prompt forward
    and its tokens, then ours); None: a bar of its own."""
    ids = torch.tensor([prompt_ids], device=llm.device)  # the reference sits on the same device
    with torch.no_grad(), shown or bar(2 * (num_tokens + 1), "validate", "step") as shown:
        ref_logits = reference(ids).logits[0].float()
        shown.update(1)
        ref_tokens = reference.generate(
            ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
            streamer=_Ticks(shown))[0, len(prompt_ids) :].tolist()
        seq = Sequence(llm.model, len(prompt_ids) + num_tokens)
        ours_logits = seq.forward(prompt_ids, all_logits=True)
        shown.update(1)
        ours_tokens, logits = [], ours_logits[-1]
        for _ in range(num_tokens):  # greedy, EOS ignored, exactly as the reference is asked to
            ours_tokens.append(int(logits.argmax()))
            logits = seq.forward(ours_tokens[-1:])[0]
            shown.update(1)
    diverge = next(
        (i for i, (a, b) in enumerate(zip(ours_tokens, ref_tokens, strict=True)) if a != b), None
    )
    return Comparison(
        rel_l2(ours_logits, ref_logits),
        num_tokens,
        num_tokens if diverge is None else diverge,
        diverge,
        ours_tokens,
        ref_tokens,
    )


def run_validate(args: argparse.Namespace) -> int:
    # on cpu whatever --device says: the reference runs there
    llm = LLM.from_engine_args(replace(EngineArgs.from_cli_args(args), device="cpu"))
    dtype = str(llm.model.dtype).removeprefix("torch.")
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[dtype]
    gen = torch.Generator().manual_seed(args.seed)
    text_vocab = min(llm.config.vocab_size, 248044)  # ordinary tokens, no specials
    prompt_ids = torch.randint(0, text_vocab, (args.prompt_len,), generator=gen).tolist()
    print(
        f"validate: {llm.model_dir} ours={dtype} reference=transformers float32, "
        f"{args.prompt_len}-token prompt, {args.num_tokens} greedy tokens",
        file=sys.stderr,
    )
    with bar(2 * (args.num_tokens + 1) + 1, "validate", "step") as shown:
        shown.set_postfix_str("loading transformers")  # seconds, minutes for a large model
        reference = load_reference(llm.model_dir)
        shown.update(1)
        shown.set_postfix_str("")
        result = compare(llm, reference, prompt_ids, args.num_tokens, shown)
    logits_ok = result.logits_rel_l2 <= tolerance
    tokens_ok = (
        result.first_divergence is None or dtype != "float32"
    )  # low precision may flip near-ties
    print(
        f"logits rel-L2: {result.logits_rel_l2:.3e} (tolerance {tolerance:.0e}) "
        f"{'ok' if logits_ok else 'FAIL'}"
    )
    print(
        f"greedy tokens: {result.num_greedy_equal}/{result.num_greedy_tokens} identical "
        f"{'ok' if tokens_ok else 'FAIL'}"
    )
    print(
        f"first divergence: {'none' if result.first_divergence is None else result.first_divergence}"
    )
    print(json.dumps({"dtype": dtype, "tolerance": tolerance, **asdict(result)}), file=sys.stderr)
    return 0 if logits_ok and tokens_ok else 3
