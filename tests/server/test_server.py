"""The OpenAI-compatible server as users meet it: a real uvicorn process on loopback serving the
embedded default model, driven by the `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

KEY = "test-key-123"
MODEL = "stdlib-19m"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--port", str(port),
                             "--api-key", KEY, "--max-model-len", "512", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited: " + proc.stdout.read())
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("server did not come up")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def _client(base):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=KEY)


def test_openai_client_streaming_and_not_give_the_same_text(server) -> None:
    client = _client(server)
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content and text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=16,
                                     temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="import os\n", max_tokens=16, temperature=0, stream=True))
    assert comp.choices[0].text and streamed == comp.choices[0].text
    assert comp.usage.completion_tokens == 16 and comp.choices[0].finish_reason == "length"


def test_64_concurrent_requests_all_complete_correctly(server) -> None:
    body = {"model": MODEL, "prompt": "class Stack:\n", "max_tokens": 8, "temperature": 0}
    alone = httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS, timeout=60).json()

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{server}/v1/completions", json=body,
                                                      headers=HEADERS) for _ in range(64)])

    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies)
    texts = {r.json()["choices"][0]["text"] for r in replies}
    assert texts == {alone["choices"][0]["text"]}


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", headers=HEADERS, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_disconnect_frees_its_slot(server) -> None:
    aborted = _metric(server, "deltaserve:requests_aborted_total")
    body = {"model": MODEL, "prompt": "def main():\n", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=HEADERS,
                      timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # one token arrived, then the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _metric(server, "deltaserve:requests_open") == 0 and \
                _metric(server, "deltaserve:requests_aborted_total") > aborted:
            break
        time.sleep(0.2)
    assert _metric(server, "deltaserve:requests_open") == 0
    assert _metric(server, "deltaserve:requests_aborted_total") == aborted + 1
    assert _metric(server, "vllm:num_requests_running") == 0


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400,
     "temperature"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "does not exist"),
    (json.dumps({"model": MODEL, "prompt": "x " * 2000}).encode(), 400,
     "maximum context length is 512 tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100000}).encode(), 400,
     "maximum context length is 512 tokens"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, needle) -> None:
    resp = httpx.post(f"{server}/v1/completions", content=body,
                      headers={**HEADERS, "content-type": "application/json"}, timeout=30)
    assert needle in _error(resp, status)["message"]


def test_keys_sizes_and_the_server_keeps_serving(server) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert _error(httpx.post(f"{server}/v1/completions", json=body), 401)["code"] == \
        "invalid_api_key"
    assert _error(httpx.post(f"{server}/v1/completions", json=body,
                             headers={"Authorization": "Bearer wrong"}), 401)
    ok = httpx.post(f"{server}/v1/completions", json=body, headers={"X-Api-Key": KEY})
    assert ok.status_code == 200
    big = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * (5 << 20) + b'"}'
    _error(httpx.post(f"{server}/v1/completions", content=big,
                      headers={**HEADERS, "content-type": "application/json"}), 413)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # open, no key
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS).status_code == 200
