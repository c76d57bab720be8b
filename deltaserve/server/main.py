"""`deltaserve serve`: load the model, build the app, run uvicorn (graceful shutdown on SIGINT /
SIGTERM: in-flight requests finish first)."""

from __future__ import annotations

import argparse
import sys


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir
    from deltaserve.engine.llm import LLM
    from deltaserve.server.app import build_app

    model_dir = default_model_dir() if args.model is None else resolve_model_dir(args.model)
    print(f"serve: loading {model_dir} ({args.dtype}, {args.device})", file=sys.stderr)
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_waiting=args.max_queue)
    name = args.served_model_name or model_dir.name
    app = build_app(llm, name, api_key=args.api_key)
    print(f"serve: {name} on http://{args.host}:{args.port}/v1 (max_model_len "
          f"{llm.max_model_len}{', API key required' if args.api_key else ''})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=30)
    return 0
