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

_LEVELS = ["debug", "info", "warning", "error", "critical"]  # uvicorn's access log stays off


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


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template: a file's text or the template itself, compiled here so that a broken one
    fails before the port opens."""
    if value is None:
        return None
    from pathlib import Path

    from jinja2 import TemplateError

    from deltaserve.chat import _compiled

    path = Path(value).expanduser()
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline and not path.is_file():
        raise ConfigError(f"--chat-template {value}: no such file (give a file, or the template "
                          "itself)")
    text = value if looks_inline else path.read_text(encoding="utf-8")
    try:
        _compiled(text)
    except TemplateError as exc:
        raise ConfigError(f"--chat-template: the template does not compile: {exc}") from exc
    return text


def check_device(device: str) -> None:
    """--device names a device this machine has: one line, not a traceback, before anything
    loads."""
    import torch

    if device == "vulkan":
        from deltaserve.vulkan.device import adapter_or_reason

        adapter, why = adapter_or_reason()
        if adapter is None:
            raise ConfigError(f"--device vulkan: {why}")
        return
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device!r} is not a device (cpu, cuda, cuda:1, ...)") from exc
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ConfigError(f"--device {device}: only cpu, cuda and vulkan devices are supported")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: this machine has no usable CUDA GPU (torch "
                          f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'})")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} "
                          "CUDA GPU(s)")


def listen(host: str, port: int):
    """The listening socket, bound before the model loads: a port in use is one line and exit 1
    (never uvicorn's errno after a "loading" line)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server_log(level: str = "info", log_requests: bool = True) -> None:
    """The server's own log lines (engine failures, restarts, one per request) on stderr like
    the rest."""
    logger = logging.getLogger("deltaserve.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("serve: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())
    requests = logging.getLogger("deltaserve.server.requests")
    requests.setLevel(logging.NOTSET if log_requests else logging.WARNING)


def kernels_line(llm) -> str:
    """What runs the model: dtype, device and the kernel paths (ops/native.isa_paths on CPU; the
    GPU backend and fla on CUDA)."""
    import importlib.util

    device = llm.device
    if device.type == "cuda":
        import torch

        from deltaserve.ops.backend import gpu_backend

        fla = importlib.util.find_spec("fla") is not None
        paths = f"{gpu_backend()} GPU kernels{', fla prefill' if fla else ''} on " \
            f"{torch.cuda.get_device_name(device)}"
    else:
        from deltaserve.ops.native import isa_paths

        found = isa_paths()
        paths = f"native CPU kernels ({', '.join(found)})" if found else \
            "torch's CPU ops (no native kernels: DELTASERVE_NATIVE=0 or no C compiler)"
    return f"weights {llm.model.dtype}, activations {llm.model.act_dtype}, {device}: {paths}"


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir
    from deltaserve.checkpoint.reader import read_config
    from deltaserve.server.app import build_app
    from deltaserve.server.shutdown import DrainingServer

    _check_args(args)
    engine_args = EngineArgs.from_cli_args(args)  # every engine flag checked before the port opens
    check_device(args.device)
    template = chat_template_arg(args.chat_template)
    _server_log(getattr(args, "log_level", "info"), not getattr(args, "disable_log_requests",
                                                                  False))
    model_dir = default_model_dir() if args.model is None else \
        resolve_model_dir(args.model, mmproj=getattr(args, "mmproj", None))
    read_config(model_dir)  # a missing or broken config.json fails here, before the port opens
    idle_s = None if not args.idle_unload_min else 60.0 * args.idle_unload_min
    names = getattr(args, "served_model_names", None) or [model_dir.name]
    name = names[0]
    failed: list[str] = []
    mirror = _join_ranks(args)

    def build(path):
        from deltaserve.engine.llm import LLM

        return LLM.from_engine_args(replace(engine_args, model=path, mmproj=None))  # resolved

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
        if template is not None:
            llm.tokenizer.chat_template = template
        _log(f"{name} ready in {llm.load_s:.1f} s (max_model_len {llm.max_model_len})")
        _log(kernels_line(llm))
        return llm

    def first_load_failed(error: str) -> None:
        failed.append(error)
        _log(f"error: the model did not load: {error}")
        server.should_exit = True

    sock = listen(args.host, args.port)
    app = build_app(served_name=name, api_key=args.api_key, load=load, idle_unload_s=idle_s,
                    on_first_load_failed=first_load_failed,
                    max_body_bytes=int(args.max_body_mb * 2**20), mirror=mirror,
                    max_prompt_chars=args.max_prompt_chars,
                    special_tokens_in_content=args.special_tokens_in_content,
                    aliases=tuple(names[1:]), seed=getattr(args, "seed", None),
                    cors=_cors(args), metrics_without_key=args.metrics_without_key)
    app.state.drain_s = args.shutdown_timeout
    _log(f"{name} on http://{args.host}:{args.port}/v1 (loading; /health is 200 once ready"
         f"{'; API key required' if args.api_key else ''}"
         f"{f'; unloads after {args.idle_unload_min:g} idle min' if idle_s else ''})")
    # uvicorn's own wait outlasts the drain: by then every request has ended with an error
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                    log_level=max(args.log_level, "warning", key=_LEVELS.index),
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
        server.run(sockets=[sock])
    finally:
        if mirror is not None:  # the load failed, or the engine loop never ended: free the others
            mirror.close()
    return 1 if failed else 0


def _cors(args: argparse.Namespace) -> dict | None:
    origins = getattr(args, "allowed_origins", None)
    if not origins:
        return None
    return {"allow_origins": list(origins),
            "allow_methods": list(args.allowed_methods or ("GET", "POST", "OPTIONS")),
            "allow_headers": list(args.allowed_headers or ("*",)),
            "allow_credentials": args.allow_credentials}


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

