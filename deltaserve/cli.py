"""`deltaserve` command line: generate, chat, serve, make-checkpoint, validate, bench, trace."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from deltaserve.cli_serve import add_serve_parser, resolve_serve_args
from deltaserve.engine.args import EngineArgs
from deltaserve.errors import DeltaserveError


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the checkpoint's generation_config)",
    )
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    for name, what in (("presence", "OpenAI's, -2..2"), ("frequency", "OpenAI's, -2..2"),
                       ("repetition", "HF/vLLM's, > 0; 1 = off")):
        p.add_argument(f"--{name}-penalty", type=float, default=None,
                       help=f"{what} (default: the checkpoint's generation_config)")
    p.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="the output is JSON valid against this JSON schema file")


def _image_args(p: argparse.ArgumentParser, how: str) -> None:
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help=f"an image file for a vision model (repeatable); {how}")
    p.add_argument("--downsample-mode", choices=("16x", "4x"), default=None,
                   help="visual tokens per 448x448 piece: 64 (16x) or 256 (4x); default: "
                   "the checkpoint's")


def build_parser() -> argparse.ArgumentParser:
    from deltaserve import __version__

    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _parser_generate(sub)
    _parser_chat(sub)
    _parser_make_checkpoint(sub)
    _parser_validate(sub)
    _parser_bench(sub)
    add_serve_parser(sub)
    _parser_quantize(sub)
    _parser_import_gguf(sub)
    _parser_gate(sub)
    _parser_trace(sub)
    _parser_needle(sub)
    _parser_ops(sub)
    return parser


def _parser_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="complete a raw prompt")
    gen.add_argument(
        "--prompt", "-p", default=None, help="prompt text ('-' or omitted: read stdin)"
    )
    _sampling_args(gen, 128)
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the text"
    )
    _image_args(gen, "the prompt becomes one user chat message with the images before the "
                "text, unless it already holds one <|image_pad|> per image")
    gen.add_argument("--no-think", action="store_true",
                     help="with --image: disable Qwen3.5 thinking mode in the chat template")
    EngineArgs.add_cli_args(gen, ("model", "tp", "pp", "speculative"))


def _parser_chat(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="interactive chat with the checkpoint's template")
    _sampling_args(chat, 1024)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--no-think", action="store_true", help="disable Qwen3.5 thinking mode")
    _image_args(chat, "attached to the first message; '/image PATH' attaches one to the next")
    EngineArgs.add_cli_args(chat, ("model",))


def _parser_make_checkpoint(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser(
        "make-checkpoint", help="write a synthetic checkpoint of a real model's shape"
    )
    make.add_argument("--preset", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dry-run", action="store_true", help="only print tensor count and bytes")
    make.add_argument("--format", default="safetensors", choices=("safetensors", "gguf-q1_0"),
                      help="gguf-q1_0: one .gguf file (OUT) laid out as llama.cpp's converter and "
                      "`llama-quantize Q1_0` write it, random blocks at the real shape")
    make.add_argument("out", nargs="?", default=None)


def _parser_validate(sub: argparse._SubParsersAction) -> None:
    val = sub.add_parser("validate", help="compare logits and greedy tokens with transformers")
    val.add_argument("--prompt-len", type=int, default=64)
    val.add_argument("--num-tokens", type=int, default=32)
    val.add_argument("--seed", type=int, default=0)
    val.add_argument("--tolerance", type=float, default=None, help="max logits rel-L2")
    EngineArgs.add_cli_args(val, ("model",), dtype_default="float32")


def _parser_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench", help="prefill/decode tokens/s, ours and transformers in one run ('bench serve "
        "--help': load against a running server)"
    )
    bench.add_argument("--prefill-lens", default=None,
                       help="default 512,2048 on CPU; 2048,5120,8192,10240,32768 on GPU")
    bench.add_argument("--decode-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    bench.add_argument("--batch", default=None,
                       help="e.g. 1,8,32,64,128: aggregate and per-sequence decode tok/s instead")
    bench.add_argument("--shared-prefix", type=int, default=0,
                       help="N: time to first token behind an N-token cached system prompt, hit vs miss")
    bench.add_argument("--formats", default="bf16,int8,int4",
                       help="GPU: formats to measure (int8/int4 quantized on the fly)")
    bench.add_argument("--kv-cache-dtypes", default="auto",
                       help="GPU: batch-1 decode of the first format with each KV cache dtype "
                            "(e.g. auto,float32,float16)")
    bench.add_argument("--start-temp", type=float, default=60.0,
                       help="GPU: wait until the GPU is this cool (C) before each measurement")
    bench.add_argument("--stop-temp", type=float, default=85.0,
                       help="GPU: abort above this temperature (C); clocks are never changed")
    bench.add_argument("--out", default=None, help="write the JSON record here too")
    EngineArgs.add_cli_args(bench, ("model", "tp", "pp"))


def _parser_quantize(sub: argparse._SubParsersAction) -> None:
    qz = sub.add_parser("quantize", help="write a quantized copy of a checkpoint (int8, int4, q1)")
    qz.add_argument("--model", "-m", default=None, help="float checkpoint (default: the embedded model)")
    qz.add_argument("--format", required=True, choices=["int8", "int4", "q1"])
    qz.add_argument("--encoder", default="search", choices=["search", "minmax", "gptq"],
                    help="int4 groups: the least-squared-error scale and bias (default), the "
                         "group's min and max as MLX encodes them, or GPTQ (needs --calibration: "
                         "each layer's output error over that text, errors spread over later "
                         "columns)")
    qz.add_argument("--calibration", default=None, metavar="TEXT_FILE",
                    help="int4: weigh each input column's error by its mean square over this text "
                         "run through the float model (an importance matrix); with --encoder gptq, "
                         "the inputs' covariances over it")
    qz.add_argument("--calibration-tokens", type=int, default=4096,
                    help="tokens of the calibration text used (default 4096)")
    qz.add_argument("out", help="output folder (new or empty)")


def _parser_import_gguf(sub: argparse._SubParsersAction) -> None:
    gg = sub.add_parser("import-gguf", help="convert a qwen35 GGUF file into a checkpoint folder")
    gg.add_argument("gguf", help="the .gguf file")
    gg.add_argument("out", help="output folder")
    gg.add_argument("--tokenizer-from", default=None,
                    help="folder with the model's tokenizer.json (default: the file's own)")
    gg.add_argument("--dequantize", action="store_true",
                    help="write every tensor as fp32 through the gguf package's reference "
                         "dequantizer (a float checkpoint: for transformers or `validate`)")


def _parser_gate(sub: argparse._SubParsersAction) -> None:
    gate = sub.add_parser("gate", help="quality gate: model A against model B on natural prompts")
    gate.add_argument("--against", default=None, help="the reference model (default: embedded)")
    gate.add_argument("--against-dtype", default=None, help="its dtype (default: --dtype)")
    gate.add_argument("--against-device", default=None,
                      help="its device (default: --device), e.g. --device vulkan "
                      "--against-device cpu")
    gate.add_argument("--prompts", default=None, help="prompts JSON (default: the built-in set)")
    gate.add_argument("--thresholds", default="quantized", help="quantized, exact, or a JSON file")
    gate.add_argument("--out", default=None, help="write the JSON record here too")
    EngineArgs.add_cli_args(gate, ("model",), dtype_default="float32")


def _parser_trace(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("trace", help="MiniCPM-V vision path vs transformers, stage by stage")
    tr.add_argument("--model", "-m", required=True, help="MiniCPM-V-4.6 checkpoint folder")
    tr.add_argument("--image-size", type=int, nargs=2, default=[448, 448], metavar=("H", "W"),
                    help="pixels of one image piece (random values; multiples of 56 for 16x, "
                         "28 for 4x)")
    tr.add_argument("--image", default=None,
                    help="an image file: its processed pieces instead of random pixels")
    tr.add_argument("--mode", choices=["16x", "4x"], default="16x")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default=None, help="write the rows as JSON here too")


def _parser_needle(sub: argparse._SubParsersAction) -> None:
    hay = sub.add_parser("needle", help="needle-in-a-haystack retrieval rate (greedy, our engine)")
    hay.add_argument("--lengths", default="2048,8192", help="context lengths in tokens")
    hay.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths in [0, 1]")
    hay.add_argument("--keys", type=int, default=3, help="fresh keys per (length, depth)")
    hay.add_argument("--out", default=None, help="write the JSON record here too")
    EngineArgs.add_cli_args(hay, ("model",), dtype_default="float32")


def _parser_ops(sub: argparse._SubParsersAction) -> None:
    ops = sub.add_parser("ops", help="which implementation each op runs for this model and device")
    ops.add_argument("--prompt-tokens", type=int, default=200,
                     help="a prefill chunk of this many tokens and decode steps are run first")
    ops.add_argument("--json", action="store_true", help="one JSON record instead of the table")
    EngineArgs.add_cli_args(ops, ("model", "batching"))


def _ops(args: argparse.Namespace) -> int:
    """Runs a prompt and a few decode steps (one sequence, then four), then prints every op's
    choice for the cases it met (ops/dispatch.report)."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.ops import dispatch

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    vocab = llm.config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(args.prompt_tokens)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params)
    llm.generate([{"prompt_token_ids": prompt[: 8 + i]} for i in range(4)], params)
    rows = dispatch.report()
    if args.json:
        print(json.dumps({"device": str(llm.device), "dtype": str(llm.model.act_dtype),
                          "ops": rows}, indent=1))
        return 0
    print(f"ops run by {llm.config.model_type} on {llm.device}, {llm.model.act_dtype} "
          "(decode step: a step without prefill chunks)")
    for r in rows:
        shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
        step = "decode step" if r["native_rows"] else "with prefill"
        print(f"{r['op']:<15} {step:<12} {shape}\n    -> {r['chosen']}")
        for name, why in r["skipped"].items():
            print(f"       not {name}: {why}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir
    from deltaserve.quant.convert import check_request, quantize_checkpoint

    model_dir = default_model_dir() if args.model is None else resolve_model_dir(args.model)
    importance, search, gptq = None, args.encoder != "minmax", args.encoder == "gptq"
    # every refusal (gptq without calibration text among them) before the calibration run
    check_request(model_dir, args.format, Path(args.out), search,
                  calibrated=args.calibration is not None, gptq=gptq)
    if args.calibration is not None:
        from deltaserve.errors import ConfigError
        from deltaserve.quant.calibrate import MIN_TOKENS, input_statistics, read_calibration

        if args.calibration_tokens < MIN_TOKENS:
            raise ConfigError(f"--calibration-tokens must be at least {MIN_TOKENS}")
        importance = input_statistics(model_dir, read_calibration(Path(args.calibration)),
                                      args.calibration_tokens, covariance=gptq)
    summary = quantize_checkpoint(model_dir, args.format, Path(args.out), search=search,
                                  importance=importance)
    print(json.dumps(summary, indent=2))
    return 0


def _trace(args: argparse.Namespace) -> int:
    from deltaserve.checkpoint.hub import resolve_model_dir
    from deltaserve.multimodal.trace import format_table, run_trace

    model_dir = resolve_model_dir(args.model)
    if args.image is not None:
        from deltaserve.multimodal.trace import run_image_trace

        rows = run_image_trace(model_dir, args.image, args.mode)
    else:
        height, width = args.image_size
        if height % 14 or width % 14:
            raise DeltaserveError(f"--image-size {height} {width}: both sides must be multiples "
                                  "of 14")
        rows = run_trace(model_dir, (height // 14, width // 14), args.mode, args.seed)
    print(format_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    """The parsed flags; a mistake exits 2 with the subcommand's usage and one line (argparse
    reports unknown flags at the top level otherwise)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = commands.choices[args.command]
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        command.error("--threads must be at least 1")
    if args.command == "serve":
        resolve_serve_args(command, args)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "serve"]:  # a client of a running server: its own flags
        from deltaserve.bench.serve import main as bench_serve

        return bench_serve(argv[2:])
    args = parse(argv)
    if getattr(args, "gpu_backend", None):  # the env knob is the one place engines read it from
        os.environ["DELTASERVE_GPU_BACKEND"] = args.gpu_backend
    if getattr(args, "threads", None) is not None:
        os.environ["DELTASERVE_NUM_THREADS"] = str(args.threads)
    if getattr(args, "tp_compress", None):
        os.environ["DELTASERVE_TP_COMPRESS"] = args.tp_compress
    try:
        if args.command == "serve" and args.tp != 1:  # rank 0 serves, the others follow it
            from deltaserve.distributed.cli import generate_ranks

            code = generate_ranks(args, argv)
            if code is not None:
                return code
        if args.command == "generate" and (args.tp != 1 or args.pp != 1 or args.pp_layers):
            from deltaserve.distributed.cli import generate_ranks

            code = generate_ranks(args, argv)
            if code is not None:  # this process launched the ranks; they have finished
                return code
        if args.command == "generate":
            from deltaserve.cli_generate import run_generate

            return run_generate(args)
        if args.command == "chat":
            from deltaserve.cli_generate import run_chat

            return run_chat(args)
        if args.command == "make-checkpoint":
            return _make_checkpoint(args)
        if args.command == "validate":
            from deltaserve.validate.compare import run_validate

            return run_validate(args)
        if args.command == "quantize":
            return _quantize(args)
        if args.command == "trace":
            return _trace(args)
        if args.command == "serve":
            from deltaserve.server.main import run_serve

            return run_serve(args)
        if args.command == "import-gguf":
            from deltaserve.quant.gguf_import import import_gguf

            tok = Path(args.tokenizer_from) if args.tokenizer_from else None
            report = import_gguf(Path(args.gguf), Path(args.out), tok, dequantize=args.dequantize)
            print(json.dumps(report, indent=2))
            return 0
        if args.command == "gate":
            from deltaserve.bench.gate import run_gate

            return run_gate(args)
        if args.command == "ops":
            return _ops(args)
        if args.command == "needle":
            from deltaserve.bench.needle_run import run_needle

            return run_needle(args)
        from deltaserve.bench.cpu import run_bench

        return run_bench(args)
    except DeltaserveError as exc:
        print(f"deltaserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("deltaserve: interrupted", file=sys.stderr)
        return 130


def _make_gguf(p, args: argparse.Namespace) -> int:
    from pathlib import Path

    from deltaserve.checkpoint.gguf_synthetic import gguf_bytes, text_of, write_synthetic_gguf

    cfg = text_of(p.config)
    if args.dry_run:
        summary = {"preset": p.name, "format": args.format, "tensor_bytes": gguf_bytes(cfg)}
    else:
        if args.out is None or not args.out.endswith(".gguf"):
            raise DeltaserveError("make-checkpoint --format gguf-q1_0 needs an output file "
                                  "ending in .gguf (or --dry-run)")
        if Path(args.out).exists():
            raise DeltaserveError(f"output file {args.out} exists")
        summary = write_synthetic_gguf(cfg, Path(args.out), args.seed, p.name)
    print(json.dumps(summary))
    return 0


def _make_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import summarize, write_checkpoint

    p = preset(args.preset)
    if args.format != "safetensors":
        return _make_gguf(p, args)
    if args.dry_run:
        summary = summarize(p)
    else:
        if args.out is None:
            raise DeltaserveError("make-checkpoint needs an output folder (or --dry-run)")
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            raise DeltaserveError(f"output folder {out} exists and is not empty")
        summary = write_checkpoint(p, out, args.seed)
    summary["matches_published"] = (
        None
        if p.expected_bytes is None
        else summary["num_tensors"] == p.expected_tensors
        and summary["num_bytes"] == p.expected_bytes
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
