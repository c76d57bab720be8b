"""Servers for the tests: `deltaserve serve` as a real process, or an app built here run by a real
uvicorn server on a thread (when the test must reach into the model, e.g. to poison its logits)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, check_alive, ready_status: int = 200, timeout_s: float = 120) -> None:
    """Polls base/health until it answers ready_status; check_alive() raises if the server died."""
    deadline = time.monotonic() + timeout_s
    while True:
        check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError("server did not come up")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == ready_status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None, ready_status: int = 200):
    """`deltaserve serve ARGS` on a free loopback port, up (its /health answers ready_status)
    until the block ends; yields (base URL, process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + proc.stdout.read())

    try:
        wait_healthy(base, alive, ready_status)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def app_server(app):
    """A real uvicorn server for `app` on a thread; yields its base URL once it listens."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
