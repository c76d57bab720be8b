"""Signals, configuration and what unauthenticated callers see, on real `deltaserve serve`
processes (issue 31): a second SIGTERM or SIGINT exits at once and cleanly; streams still running
when the drain window closes end with an error event and [DONE]; `--api-key ""` is refused;
/health never shows local paths."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.helpers import app_server, running_server

LONG = {"model": "stdlib-19m", "prompt": "x", "max_tokens": 1800, "temperature": 0,
        "ignore_eos": True}
SERVE = ("--dtype", "float32", "--max-model-len", "2048")


def _stream_lines(base: str, out: list[str], started: threading.Event) -> None:
    """The stream's lines into `out`; a connection the exiting server drops ends it too."""
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                started.set()
                out.append(line)
    except httpx.TransportError:
        out.append("<dropped>")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once_without_an_abort(sig) -> None:
    """The first signal starts the drain (a stream is running, the default 30 s window); the second ends the
    process within seconds, with the signal's exit status, never SIGABRT."""
    with running_server(*SERVE) as (base, proc):
        lines, started = [], threading.Event()
        client = threading.Thread(target=_stream_lines, args=(base, lines, started), daemon=True)
        client.start()
        assert started.wait(60)
        proc.send_signal(sig)
        time.sleep(0.5)
        assert proc.poll() is None  # draining: the stream is still running
        t0 = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=15)
        waited = time.monotonic() - t0
    output = proc.stdout.read()
    assert waited < 10, waited
    assert code in (128 + sig, -sig), (code, output[-2000:])
    assert "terminate called" not in output and "Traceback" not in output, output[-2000:]


def test_streams_past_the_drain_window_end_with_an_error_and_done() -> None:
    """--shutdown-timeout 1 with a 1800-token stream and a whole request running: at the end of the
    window the stream gets an error event then `data: [DONE]`, the whole request a 503 saying the
    server is shutting down, and the process exits."""
    with running_server(*SERVE, "--shutdown-timeout", "1") as (base, proc):
        lines, started, whole = [], threading.Event(), []
        streamer = threading.Thread(target=_stream_lines, args=(base, lines, started))
        streamer.start()
        waiter = threading.Thread(target=lambda: whole.append(httpx.post(
            f"{base}/v1/completions", json=LONG, timeout=120)))
        waiter.start()
        assert started.wait(60)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        streamer.join(60)
        waiter.join(60)
        proc.wait(timeout=60)
    frames = [line for line in lines if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]", frames[-3:]
    error = json.loads(frames[-2][6:])["error"]
    assert "shutting down" in error["message"]
    assert whole[0].status_code == 503 and "shutting down" in whole[0].json()["error"]["message"]


def test_an_empty_api_key_is_refused() -> None:
    """`--api-key ""` once switched authentication off without a word."""
    proc = subprocess.run([sys.executable, "-m", "deltaserve", "serve", "--api-key", "",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--api-key" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_health_and_errors_never_show_local_paths(tmp_path) -> None:
    """A load failure naming a file: /health (unauthenticated) and the requests' 503s say the
    model failed to load and that the log has the reason; the path is only in the log."""
    from deltaserve.errors import CheckpointError
    from deltaserve.server.app import build_app

    secret = str(tmp_path / "private-folder" / "model.safetensors")

    def load():
        raise CheckpointError(f"{secret} is truncated")

    with app_server(build_app(served_name="m", load=load)) as base:
        deadline = time.monotonic() + 30
        while "loading" in (health := httpx.get(f"{base}/health")).text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        answer = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x"},
                            timeout=30)
    assert health.status_code == 503 and "failed to load" in health.text
    assert answer.status_code == 503
    for text in (health.text, answer.text):
        assert "private-folder" not in text and str(tmp_path) not in text
