"""`deltaserve serve`: check the model folder, open the port, load the model in the background
(/health answers 503 until it is ready), unload it after --idle-unload-min idle minutes and reload it
on the next request; graceful shutdown on SIGINT / SIGTERM (in-flight requests finish first)."""

from __future__ import annotations

import argparse
import sys

from deltaserve.errors import ConfigError


def _log(msg: str) -> None:
    print(f"serve: {msg}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir
    from deltaserve.checkpoint.reader import read_config
    from deltaserve.server.app import build_app

    model_dir = default_model_dir() if args.model is None else resolve_model_dir(args.model)
    read_config(model_dir)  # a missing or broken config.json fails here, before the port opens
    if args.idle_unload_min is not None and args.idle_unload_min < 0:
        raise ConfigError("--idle-unload-min must be >= 0 (0 keeps the model loaded)")
    idle_s = None if not args.idle_unload_min else 60.0 * args.idle_unload_min
    name = args.served_model_name or model_dir.name
    limits = image_limits(args)
    from deltaserve.spec.config import from_cli

    spec = from_cli(args.speculative, args.num_speculative_tokens, args.speculative_config)
    failed: list[str] = []

    def load():
        from deltaserve.engine.llm import LLM

        path = model_dir
        if args.quant:
            from deltaserve.quant.cached import quantized_copy

            path = quantized_copy(model_dir, args.quant, log=_log)
        _log(f"loading {path} ({args.dtype}, {args.device})")
        llm = LLM(path, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_queue,
                  image_limits=limits, speculative_config=spec)
        _log(f"{name} ready in {llm.load_s:.1f} s (max_model_len {llm.max_model_len})")
        return llm

    def first_load_failed(error: str) -> None:
        failed.append(error)
        _log(f"error: the model did not load: {error}")
        server.should_exit = True

    app = build_app(served_name=name, api_key=args.api_key, load=load, idle_unload_s=idle_s,
                    on_first_load_failed=first_load_failed,
                    max_body_bytes=int(args.max_body_mb * 2**20))
    _log(f"{name} on http://{args.host}:{args.port}/v1 (loading; /health is 200 once ready"
         f"{'; API key required' if args.api_key else ''}"
         f"{f'; unloads after {args.idle_unload_min:g} idle min' if idle_s else ''})")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=30))
    server.run()
    return 1 if failed else 0


def image_limits(args: argparse.Namespace):
    from deltaserve.multimodal.inputs import ImageLimits

    values = (args.max_images, args.max_visual_tokens, args.max_image_mb, args.max_image_mpx,
              args.max_body_mb)
    if min(values) <= 0:
        raise ConfigError("--max-images, --max-visual-tokens, --max-image-mb, --max-image-mpx "
                          "and --max-body-mb must be positive")
    return ImageLimits(args.max_images, int(args.max_image_mb * 2**20),
                       int(args.max_image_mpx * 1e6), args.max_visual_tokens)
