"""`deltaserve serve`: check the model folder, open the port, load the model in the background
(/health answers 503 until it is ready), unload it after --idle-unload-min idle minutes and reload it
on the next request. Shutdown on SIGINT / SIGTERM: new connections are refused, in-flight requests
get --shutdown-timeout seconds to finish, then the rest end with an error (an error event and
[DONE] on streams); a second signal exits at once. Under --tp N rank 0 serves HTTP and the other
ranks follow its engine (distributed/serve.py)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

from deltaserve.engine.args import EngineArgs
from deltaserve.errors import ConfigError


def _log(msg: str) -> None:
    print(f"serve: {msg}", file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> None:
    """Refusals that need no model: before anything loads."""
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave the flag out to serve "
                          "without one")
    if args.idle_unload_min is not None and args.idle_unload_min < 0:
        raise ConfigError("--idle-unload-min must be >= 0 (0 keeps the model loaded)")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ConfigError("--max-prompt-chars must be positive")
    if args.shutdown_timeout < 0:
        raise ConfigError("--shutdown-timeout must be >= 0")
    if args.max_body_mb <= 0:
        raise ConfigError("--max-body-mb must be positive")


def _server_log() -> None:
    """The server's own log lines (engine failures, restarts) on stderr like the rest."""
    logger = logging.getLogger("deltaserve.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("serve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir
    from deltaserve.checkpoint.reader import read_config
    from deltaserve.server.app import build_app
    from deltaserve.server.shutdown import DrainingServer

    _check_args(args)
    engine_args = EngineArgs.from_cli_args(args)  # every engine flag checked before the port opens
    _server_log()
    model_dir = default_model_dir() if args.model is None else resolve_model_dir(args.model)
    read_config(model_dir)  # a missing or broken config.json fails here, before the port opens
    idle_s = None if not args.idle_unload_min else 60.0 * args.idle_unload_min
    name = args.served_model_name or model_dir.name
    failed: list[str] = []
    mirror = _join_ranks(args)

    def build(path):
        from deltaserve.engine.llm import LLM

        return LLM.from_engine_args(replace(engine_args, model=path))

    if mirror is not None and not mirror.is_first:
        from deltaserve.distributed.serve import follow

        return follow(mirror, build)
    if mirror is not None and idle_s:  # a reload would have to be every rank's, together
        _log("--idle-unload-min is off under --tp: the model stays loaded")
        idle_s = None

    def load():
        path = model_dir
        if args.quant:  # rank 0 alone converts; the others load the copy
            from deltaserve.quant.cached import quantized_copy

            path = quantized_copy(model_dir, args.quant, log=_log)
        _log(f"loading {path} ({args.dtype}, {args.device}"
             f"{f', {args.tp} ranks' if mirror else ''})")
        if mirror is None:
            llm = build(path)
        else:
            from deltaserve.distributed.serve import loaded

            mirror.publish([("load", str(path))])
            llm = loaded(mirror, lambda: build(path))
        _log(f"{name} ready in {llm.load_s:.1f} s (max_model_len {llm.max_model_len})")
        return llm

    def first_load_failed(error: str) -> None:
        failed.append(error)
        _log(f"error: the model did not load: {error}")
        server.should_exit = True

    app = build_app(served_name=name, api_key=args.api_key, load=load, idle_unload_s=idle_s,
                    on_first_load_failed=first_load_failed,
                    max_body_bytes=int(args.max_body_mb * 2**20), mirror=mirror,
                    max_prompt_chars=args.max_prompt_chars,
                    special_tokens_in_content=args.special_tokens_in_content)
    app.state.drain_s = args.shutdown_timeout
    _log(f"{name} on http://{args.host}:{args.port}/v1 (loading; /health is 200 once ready"
         f"{'; API key required' if args.api_key else ''}"
         f"{f'; unloads after {args.idle_unload_min:g} idle min' if idle_s else ''})")
    # uvicorn's own wait outlasts the drain: by then every request has ended with an error
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                    timeout_graceful_shutdown=args.shutdown_timeout + 10),
                     app.state.host, args.shutdown_timeout)

    def group_ended(error: str | None) -> None:  # an engine failure breaks the ranks' group
        if error is not None:
            failed.append(error)
            _log(f"error: the tensor-parallel engine stopped: {error}")
            server.should_exit = True

    if mirror is not None:
        mirror.on_close = group_ended
    try:
        server.run()
    finally:
        if mirror is not None:  # the load failed, or the engine loop never ended: free the others
            mirror.close()
    return 1 if failed else 0


def _join_ranks(args: argparse.Namespace):
    """Under --tp N (our launcher or torchrun): the process group and its command channel, on
    every rank before anything loads; None for a single process."""
    from deltaserve.distributed.group import launched

    world = int(os.environ["WORLD_SIZE"]) if launched() else 1
    if world != args.tp:
        raise ConfigError(f"serve --tp {args.tp} but the launch started {world} processes")
    if args.tp == 1:
        return None
    from deltaserve.distributed.group import init_group
    from deltaserve.distributed.serve import Mirror

    group, _ = init_group(args.tp, args.device)
    return Mirror(group.rank, group.world_size)

