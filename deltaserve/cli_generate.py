"""The `generate` and `chat` commands: text on stdout, progress and speed on stderr."""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import sys

from deltaserve.engine.args import EngineArgs
from deltaserve.engine.llm import LLM
from deltaserve.engine.sampling import SamplingParams
from deltaserve.errors import ConfigError, RequestError
from deltaserve.multimodal.processor import IMAGE_PAD
from deltaserve.structured.params import StructuredOutputsParams


def _load(args: argparse.Namespace) -> LLM:
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
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
        presence_penalty=pick(args.presence_penalty, base.presence_penalty),
        frequency_penalty=pick(args.frequency_penalty, base.frequency_penalty),
        repetition_penalty=pick(args.repetition_penalty, base.repetition_penalty),
        structured_outputs=_schema(args.json_schema),
    )


def _schema(path) -> StructuredOutputsParams | None:
    """--json-schema FILE: the file's schema as the output's constraint."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--json-schema: cannot read {path}: {exc.strerror}") from None
    return StructuredOutputsParams(json=text)


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
    spec = getattr(getattr(llm, "_engine", None), "spec", None)
    if spec is not None:
        s = spec.stats
        print(f"Speculative ({spec.config.method}, k={spec.config.num_speculative_tokens}): "
              f"{s.num_draft_tokens} drafted, {s.num_accepted_tokens} accepted "
              f"({s.acceptance_rate:.1%}) in {s.num_drafts} verify steps", file=sys.stderr)


def _with_images(llm: LLM, text: str, args: argparse.Namespace):
    """generate's prompt: as given, or with --image one user message (images, then the text)
    rendered by the chat template, unless the text already has one placeholder per image."""
    if not args.image:
        return text
    if text.count(IMAGE_PAD) != len(args.image):
        content = [{"type": "image", "image": path} for path in args.image]
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
        text = llm.tokenizer.apply_chat_template(messages, enable_thinking=not args.no_think)
    return {"prompt": text, "multi_modal_data": {"image": list(args.image)},
            "mm_processor_kwargs": {"downsample_mode": args.downsample_mode}}


def run_generate(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.prompt in (None, "-") else args.prompt
    llm = _load(args)
    params = _params(llm, args)
    prompt = _with_images(llm, text, args)
    if args.json:
        out = llm.generate(prompt, params)[0]
        record = {
            "model": str(llm.model_dir),
            "prompt": text,
            "images": list(args.image),
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": out.outputs[0].token_ids,
            "text": out.outputs[0].text,
            "finish_reason": out.outputs[0].finish_reason,
            "timings": out.metrics,
        }
        if llm.engine.spec is not None:
            record["speculative"] = llm.engine.spec.stats.as_dict()
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
    attached = list(args.image)  # images for the next user message
    print("deltaserve chat: /image PATH attaches an image, /reset clears the conversation, "
          "/exit or Ctrl-D quits", file=sys.stderr)
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages, attached = (messages[:1] if args.system else []), []
            continue
        if line.startswith("/image "):
            attached.append(line[len("/image "):].strip())
            continue
        if not line.strip():
            continue
        text = line.rstrip("\n")
        parts = [{"type": "image", "image": path} for path in attached]
        messages.append({"role": "user",
                         "content": [*parts, {"type": "text", "text": text}] if parts else text})
        try:
            prompt = llm.chat_prompt(messages, enable_thinking=not args.no_think)
            if isinstance(prompt, dict):
                prompt["mm_processor_kwargs"] = {"downsample_mode": args.downsample_mode}
            stream = llm.stream(prompt, params, metrics := {})
            first = next(stream)
        except RequestError as exc:  # a bad image: say so, drop the turn, keep the conversation
            print(f"error: {exc}", file=sys.stderr)
            messages.pop()
            attached = []
            continue
        attached = []
        reply = ""
        for event in itertools.chain([first], stream):
            reply += event.text
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
        print(
            f"[{int(metrics['num_generated_tokens'])} tokens, {metrics['decode_tok_s']:.1f} tok/s]",
            file=sys.stderr,
        )
