"""`deltaserve serve`'s flags: ours, vLLM's spellings (`vllm serve MODEL ...`) and llama-server's
(`--alias`, `--jinja`, ...), and one-line refusals for the peers' flags that mean nothing here."""

from __future__ import annotations

import argparse

from deltaserve.engine.args import EngineArgs

QUANT_FORMATS = ("int8", "int4", "q1")  # --quant / --quantization: cached quantized copies
TOOL_PARSERS = ("qwen3_coder", "qwen3_xml")  # Qwen3.5 writes <tool_call><function=...> blocks
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # both read a <think>...</think> block
# peers' flags with no meaning for this engine: the reason each is refused
REFUSED = {
    ("--trust-remote-code",): "deltaserve runs no code from checkpoints; drop the flag",
    ("--n-gpu-layers", "-ngl", "--gpu-layers"): "the whole model runs on --device; there is no "
    "partial offload (use --device cpu or cuda)",
    ("--cpu-offload-gb",): "weights are not offloaded: the whole model runs on --device",
    ("--swap-space",): "sequences are never swapped to host memory: a request that does not fit "
    "waits (--max-queue)",
    ("--block-size",): "the KV block length is fixed at 64 tokens",
    ("--flash-attn", "-fa"): "attention kernels are chosen per device (deltaserve ops shows "
    "them); there is nothing to switch",
    ("--mlock",): "weights are not locked in RAM",
    ("--load-format",): "the format is read from the files (safetensors, GGUF, MLX)",
    ("--tokenizer",): "the tokenizer is the checkpoint's (or the GGUF file's own)",
}


class Refuse(argparse.Action):
    """A flag the peers have and this engine refuses: parsing stops with its reason."""

    def __init__(self, option_strings, dest, why: str = "", **kwargs):
        kwargs.setdefault("nargs", "?")
        super().__init__(option_strings, dest=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {self.why}")


def _choice(kind: str, allowed: tuple[str, ...], why: str):
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r}: {kind} must be one of "
                                             f"{', '.join(allowed)} ({why})")
        return value
    return check


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    sv = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server on the "
                        "batched engine")
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="checkpoint folder, .gguf file or hub id (as `vllm serve MODEL`; or "
                    "--model)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None,
                    help="require this key (Authorization: Bearer or X-Api-Key) on every "
                         "endpoint but /health and /v1/models")
    sv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the model ids clients may send; the first is the one responses name "
                    "(default: the checkpoint folder's name)")
    sv.add_argument("--alias", action="append", default=None, metavar="NAME",
                    help="another model id clients may send (llama-server's flag)")
    sv.add_argument("--quant", "--quantization", "-q", dest="quant", default=None,
                    type=_choice("--quantization", QUANT_FORMATS, "a quantized copy is made "
                                 "once into the cache folder; GGUF and quantized checkpoints "
                                 "need no flag"),
                    metavar="{int8,int4,q1}",
                    help="serve a quantized copy of a float checkpoint (converted once into the "
                         "cache folder, reused on later starts)")
    sv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                    help="a Jinja chat template (a file, or the template itself) instead of the "
                    "checkpoint's")
    sv.add_argument("--seed", type=int, default=None,
                    help="requests without a seed sample reproducibly from this one (in arrival "
                    "order)")
    sv.add_argument("--allowed-origins", default=None, metavar="JSON_OR_LIST",
                    help="CORS: origins browsers may call from, as vLLM's JSON list or "
                    "comma-separated (default: none; '*' any: mind that a page anywhere can "
                    "then reach a server without --api-key)")
    sv.add_argument("--allowed-methods", default=None, metavar="JSON_OR_LIST",
                    help="CORS methods (default: GET, POST, OPTIONS)")
    sv.add_argument("--allowed-headers", default=None, metavar="JSON_OR_LIST",
                    help="CORS request headers (default: any)")
    sv.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    sv.add_argument("--log-level", default="info",
                    choices=("debug", "info", "warning", "error", "critical"),
                    help="the server's log level (default info)")
    sv.add_argument("--disable-log-requests", action="store_true",
                    help="no log line per request (id, status, tokens, TTFT, total time)")
    sv.add_argument("--metrics-without-key", action="store_true",
                    help="answer /metrics without --api-key (for a Prometheus scraper that "
                    "holds no key)")
    _serve_limits(sv)
    _peer_flags(sv)
    EngineArgs.add_cli_args(sv, ("model", "tp", "speculative", "batching", "images"))
    return sv


def _serve_limits(sv: argparse.ArgumentParser) -> None:
    sv.add_argument("--max-body-mb", type=float, default=32.0,
                    help="request body limit in MiB (images travel as base64 data: URLs)")
    sv.add_argument("--idle-unload-min", type=float, default=5.0,
                    help="free the model after this many idle minutes, reload it on the next "
                         "request (default 5; 0 = never)")
    sv.add_argument("--max-prompt-chars", type=int, default=None,
                    help="refuse longer prompts before tokenizing them (default: what the "
                         "context can hold: max-model-len x the longest token's characters)")
    sv.add_argument("--special-tokens-in-content", action="store_true",
                    help="special-token strings in chat messages (<|im_start|>...) become "
                         "control tokens (default: encoded as plain text)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGINT/SIGTERM, seconds in-flight requests get to finish before "
                         "they are ended with an error (a second signal exits at once)")


def _peer_flags(sv: argparse.ArgumentParser) -> None:
    """vLLM's and llama-server's spellings of what this server always does, checked values."""
    sv.add_argument("--jinja", action="store_true",
                    help="accepted (llama-server): chat templates are always rendered with Jinja")
    sv.add_argument("--metrics", action="store_true",
                    help="accepted (llama-server): /metrics is always served")
    sv.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted (vLLM): tool calls are always parsed when a request has tools")
    sv.add_argument("--tool-call-parser", default=None,
                    type=_choice("--tool-call-parser", TOOL_PARSERS, "Qwen3.5 writes "
                                 "<tool_call><function=...> blocks; hermes' JSON calls are not "
                                 "its format"),
                    help=f"accepted with {' or '.join(TOOL_PARSERS)} (the family's format)")
    sv.add_argument("--reasoning-parser", default=None,
                    type=_choice("--reasoning-parser", REASONING_PARSERS,
                                 "the family thinks in <think>...</think>"),
                    help="accepted with qwen3 or deepseek_r1: the <think> block always becomes "
                    "reasoning_content")
    sv.add_argument("--pipeline-parallel-size", "--pp", dest="serve_pp", type=int, default=1,
                    metavar="N", help="1 only: serve runs tensor parallelism (--tp); pipeline "
                    "parallelism is `generate --pp`")
    for flags, why in REFUSED.items():
        sv.add_argument(*flags, action=Refuse, why=why)


def resolve_serve_args(sv: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Folds the peers' spellings into one value each, refusing contradictions (parser errors:
    the subcommand's usage and one line)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            sv.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.serve_pp != 1:
        sv.error("--pipeline-parallel-size: serve runs tensor parallelism only (--tp N); "
                 "pipeline parallelism is `deltaserve generate --pp N`")
    names = list(args.served_model_name or []) + list(args.alias or [])
    if any(not n.strip() for n in names):
        sv.error("--served-model-name / --alias: a name is empty")
    args.served_model_names = list(dict.fromkeys(names))  # order kept, repeats dropped
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        setattr(args, flag, _names(sv, flag, getattr(args, flag)))


def _names(sv: argparse.ArgumentParser, flag: str, value: str | None) -> tuple[str, ...] | None:
    """A JSON list (vLLM's form) or comma-separated names."""
    if value is None:
        return None
    import json

    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            sv.error(f"--{flag.replace('_', '-')}: not a JSON list: {exc}")
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            sv.error(f"--{flag.replace('_', '-')}: give a JSON list of strings")
    else:
        items = [i.strip() for i in text.split(",") if i.strip()]
    return tuple(items)
