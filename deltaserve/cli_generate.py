"""The `generate` and `chat` commands: text on stdout, progress and speed on stderr."""

from __future__ import annotations

import argparse
import json
import resource
import sys

from deltaserve.engine.llm import LLM
from deltaserve.engine.sampling import SamplingParams


def _load(args: argparse.Namespace) -> LLM:
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    note = " (the embedded default: a 19M-parameter Python-code model)" if llm.is_default_model else ""
    print(
        f"deltaserve: loaded {llm.model_dir} ({llm.model.dtype}, {args.device}) in {llm.load_s:.1f} s{note}",
        file=sys.stderr,
    )
    return llm


def _params(llm: LLM, args: argparse.Namespace) -> SamplingParams:
    base = llm.get_default_sampling_params()
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return SamplingParams(
        temperature=pick(args.temperature, base.temperature),
        top_k=pick(args.top_k, base.top_k),
        top_p=pick(args.top_p, base.top_p),
        min_p=pick(args.min_p, base.min_p),
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _footer(metrics: dict[str, float], llm=None) -> None:
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    report = getattr(getattr(llm, "_engine", None), "memory_report", None)
    print(
        "==========\n"
        f"Prompt: {int(metrics['num_prompt_tokens'])} tokens, {metrics['prefill_tok_s']:.3f} tokens-per-sec\n"
        f"Generation: {int(metrics['num_generated_tokens'])} tokens, "
        f"{metrics['decode_tok_s']:.3f} tokens-per-sec\n"
        f"Peak memory: {peak_gb:.3f} GB" + (f"\n{report.summary()}" if report else ""),
        file=sys.stderr,
    )


def run_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    llm = _load(args)
    params = _params(llm, args)
    if args.json:
        out = llm.generate(prompt, params)[0]
        record = {
            "model": str(llm.model_dir),
            "prompt": prompt,
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.outputs[0].token_ids,
            "text": out.outputs[0].text,
            "finish_reason": out.outputs[0].finish_reason,
            "timings": out.metrics,
        }
        print(json.dumps(record, ensure_ascii=False))
        _footer(out.metrics, llm)
        return 0
    metrics: dict[str, float] = {}
    for event in llm.stream(prompt, params, metrics):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _footer(metrics, llm)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    params = _params(llm, args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    print("deltaserve chat: /reset clears the conversation, /exit or Ctrl-D quits", file=sys.stderr)
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = llm.tokenizer.apply_chat_template(messages, enable_thinking=not args.no_think)
        reply, metrics = "", {}
        for event in llm.stream(prompt, params, metrics):
            reply += event.text
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
        print(
            f"[{int(metrics['num_generated_tokens'])} tokens, {metrics['decode_tok_s']:.1f} tok/s]",
            file=sys.stderr,
        )
