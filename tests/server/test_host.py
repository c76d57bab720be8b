"""The served model's life behind a real uvicorn server: 503 while it loads, idle unload and reload,
a failed first load, `--quant`, and a request whose logits go non-finite."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.bench.soak import metric
from deltaserve.server.app import build_app
from tests.server.helpers import app_server, running_server

NAME = "m"
PROMPT = {"model": NAME, "prompt": "def parse(text):", "max_tokens": 12, "temperature": 0}


def _llm():
    from deltaserve import LLM

    return LLM(dtype="float32", max_model_len=256)


def test_health_is_503_while_loading_and_requests_wait_for_the_model() -> None:
    gate, answers = threading.Event(), []

    def load():
        assert gate.wait(60)
        return _llm()

    with app_server(build_app(served_name=NAME, load=load)) as base:
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "loading" in health.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == NAME  # answers now
        waiter = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=120)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not answers  # queued behind the load, not refused
        assert httpx.get(f"{base}/health", timeout=1).status_code == 503  # never queued itself
        gate.set()
        waiter.join(120)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"]
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_idle_unload_frees_the_model_and_the_next_request_reloads_it() -> None:
    loads = []

    def load():
        llm = _llm()
        forward = llm.model.forward_batch

        def slow(*args, **kw):  # a step of 20 ms: a 40-token stream outlasts the idle limit
            time.sleep(0.02)
            return forward(*args, **kw)

        llm.model.forward_batch = slow
        loads.append(llm)
        return llm

    with app_server(build_app(served_name=NAME, load=load, idle_unload_s=0.5)) as base:
        _wait_health(base, "ok")
        first = httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=60).json()
        long = {**PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as r:
            frames = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert len(frames) >= 2 and len(loads) == 1  # not unloaded under a running request
        _wait_health(base, "unloaded")
        assert metric(base, "deltaserve:model_loaded") == 0
        again = httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=60).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert len(loads) == 2 and metric(base, "deltaserve:model_loads_total") == 2
        assert metric(base, "vllm:generation_tokens_total") >= 12 + 40 + 12  # across loads


def test_the_engine_steps_on_the_thread_that_loaded_the_model(monkeypatch) -> None:
    """CPU torch keeps one OpenMP team per calling thread; a second team (the loader's, the event
    loop's zeroing the engine's state slots, the engine's) made every engine step 2-2.7x slower
    (host.py), so the load, the engine's pools and its steps all run on one thread."""
    from deltaserve.cache.pools import StatePool

    seen: dict[str, set[int]] = {"load": set(), "step": set()}
    reset = StatePool.reset

    def spied_reset(self, slot):
        seen["step"].add(threading.get_ident())
        return reset(self, slot)

    monkeypatch.setattr(StatePool, "reset", spied_reset)

    def load():
        seen["load"].add(threading.get_ident())
        llm = _llm()
        forward = llm.model.forward_batch

        def spy(*args, **kw):
            seen["step"].add(threading.get_ident())
            return forward(*args, **kw)

        llm.model.forward_batch = spy
        return llm

    with app_server(build_app(served_name=NAME, load=load)) as base:
        _wait_health(base, "ok")
        assert httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=60).status_code == 200
    assert len(seen["load"]) == 1 and seen["step"] == seen["load"]


def _wait_health(base: str, status: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{base}/health")
        if r.status_code == 200 and r.json()["status"] == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"/health never said {status}")


def test_non_finite_logits_end_the_request_with_a_500_and_the_server_keeps_serving() -> None:
    import torch

    llm, marker = _llm(), 1234
    forward = llm.model.forward_batch

    def poisoned(input_ids, *args, **kw):  # any step holding the marker token goes NaN
        out = forward(input_ids, *args, **kw)
        return torch.full_like(out, float("nan")) if bool((input_ids == marker).any()) else out

    llm.model.forward_batch = poisoned
    bad = {**PROMPT, "prompt": [17, marker, 42]}
    with app_server(build_app(llm, NAME)) as base:
        for body in (bad, {**bad, "stream": True}):
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "non_finite_logits"
        ok = httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        errors = [line for line in httpx.get(f"{base}/metrics").text.splitlines()
                  if 'finished_reason="error"' in line]
        assert errors and errors[0].endswith(" 2.0")
        assert llm.engine.cache.usage()["blocks_held_by_requests"] == 0


def test_a_first_load_that_fails_stops_the_server_with_its_reason(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    from deltaserve.checkpoint.default import default_model_dir

    broken = tmp_path / "broken"
    shutil.copytree(default_model_dir(), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = subprocess.run([sys.executable, "-m", "deltaserve", "serve", "--model", str(broken),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "did not load" in proc.stderr
    assert "Traceback" not in proc.stderr
    missing = subprocess.run([sys.executable, "-m", "deltaserve", "serve", "--model",
                              str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr


def test_quant_serves_an_int8_copy_converted_once(tmp_path: Path) -> None:
    from deltaserve import LLM, SamplingParams

    env = {"DELTASERVE_CACHE_DIR": str(tmp_path / "cache")}
    body = {**PROMPT, "model": "stdlib-19m"}
    with running_server("--quant", "int8", "--dtype", "float32", env=env) as (base, _):
        served = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    copies = list((tmp_path / "cache" / "quantized").glob("stdlib-19m-int8-*"))
    assert len(copies) == 1 and (copies[0] / ".complete").is_file()
    assert '"quantization"' in (copies[0] / "config.json").read_text()
    direct = LLM(copies[0], dtype="float32").generate(
        [body["prompt"]], SamplingParams(temperature=0, max_tokens=12))[0]
    assert served["choices"][0]["text"] == direct.outputs[0].text
    with running_server("--quant", "int8", "--dtype", "float32", env=env) as (base, proc):
        pass
    assert "quantizing" not in proc.stdout.read()  # the second start reused the copy


def test_sigterm_lets_an_in_flight_stream_finish_then_exits_cleanly() -> None:
    import signal

    body = {**PROMPT, "model": "stdlib-19m", "max_tokens": 120, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with running_server("--dtype", "float32") as (base, proc):
        lines = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream: the first chunk is out
                lines.append(line)
        # uvicorn re-raises the signal once shut down: the status says SIGTERM, after the drain
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    frames = [line for line in lines if line.startswith("data: {")]
    usage = [f for f in frames if '"usage": {' in f][-1]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert '"completion_tokens": 120' in usage


def test_model_thread_runs_calls_in_order_on_one_daemon_thread() -> None:
    from deltaserve.server.bridge import ModelThread

    worker = ModelThread()
    idents = [worker.submit(threading.get_ident) for _ in range(3)]
    assert len({f.result(5) for f in idents}) == 1 and idents[0].result() != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0).result(5)
    assert worker.submit(lambda: "still serving").result(5) == "still serving"
    assert worker._thread.daemon  # a loop never stopped cannot hold the process at exit
    worker.shutdown()
    assert not worker._thread.is_alive()
