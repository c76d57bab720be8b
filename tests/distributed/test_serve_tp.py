"""`deltaserve serve --tp 2` on CPU (gloo): rank 0 serves HTTP, rank 1 follows its engine. Its
answers must be one process's (greedy text, echo logprobs), a client that goes away must free its
request, idle ranks must not spin, SIGTERM must end every rank, and a dead rank must end the
server instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.engine.sampling import SamplingParams
from tests.server.helpers import free_port, running_server, wait_healthy

MODEL = "tiny"  # the served name: the checkpoint folder's
PROMPTS = ["The quick brown fox", "def main():\n", "1, 2, 3, 4,", "Once upon a time"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_dir):
    with running_server("--model", str(tiny_dir), "--tp", "2", "--device", "cpu",
                        "--dtype", "float32", "--max-model-len", "512",
                        "--served-model-name", MODEL) as (base, proc):
        yield base, proc, _children(proc.pid)


def _children(pid: int) -> list[int]:
    """The launcher's rank processes (from /proc: no psutil here)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _reference(llm, prompts: list[str]) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def test_answers_equal_one_process(server, tiny_llm) -> None:
    """Completions (4 at once, one streamed) and a chat, all concurrent, equal one process's
    greedy text."""
    base = server[0]
    messages = [{"role": "user", "content": "Name three colors."}]
    chat_text = tiny_llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    want = _reference(tiny_llm, [*PROMPTS, chat_text])

    async def one(client, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return (await client.post(f"{base}/v1/completions", json=body)).json()

    async def streamed(client, prompt):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True}
        text = ""
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def chat(client):
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
        return (await client.post(f"{base}/v1/chat/completions", json=body)).json()

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client, p) for p in PROMPTS[:3]],
                                        streamed(client, PROMPTS[3]), chat(client))

    *whole, stream_text, chat_reply = asyncio.run(burst())
    assert [r["choices"][0]["text"] for r in whole] == want[:3]
    assert stream_text == want[3]
    assert chat_reply["choices"][0]["message"]["content"] == want[4]
    assert all(r["usage"]["completion_tokens"] >= 1 for r in whole)


def test_echo_logprobs_equal_one_process(server, tiny_llm) -> None:
    """Teacher-forced prompt logprobs run the model on every rank (the vocabulary-parallel head
    gathered), not on rank 0 alone."""
    from deltaserve.server.logprobs import completion_logprobs

    ids = tiny_llm.tokenizer.encode("The capital of France is Paris.")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    got = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    lp = got.json()["choices"][0]["logprobs"]
    want = completion_logprobs(tiny_llm, ids, 0, 2)
    assert lp["tokens"] == want["tokens"] and lp["token_logprobs"][0] is None
    for a, b in zip(lp["token_logprobs"][1:], want["token_logprobs"][1:], strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b))
    assert [list(t) for t in lp["top_logprobs"][1:]] == [list(t) for t in want["top_logprobs"][1:]]


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_disconnect_mid_stream_aborts_on_every_rank(server, tiny_llm) -> None:
    base = server[0]
    aborted = _metric(base, "deltaserve:requests_aborted_total")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())  # a token arrived; the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _metric(base, "deltaserve:requests_open") > 0:
        time.sleep(0.1)
    assert _metric(base, "deltaserve:requests_aborted_total") == aborted + 1
    assert _metric(base, "vllm:num_requests_running") == 0
    # both engines dropped it alike: the next request still decodes (rank 1 did not diverge)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    again = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert again["choices"][0]["text"] == _reference(tiny_llm, PROMPTS[:1])[0]


def test_idle_ranks_do_not_spin(server) -> None:
    ranks = server[2]
    assert len(ranks) == 2
    before = [_cpu_s(p) for p in ranks]
    time.sleep(2.0)
    used = [_cpu_s(p) - b for p, b in zip(ranks, before, strict=True)]
    assert max(used) < 0.4, used  # a spinning rank would use ~2 s


def test_sigterm_ends_every_rank(server) -> None:
    """Last in the module: stops the shared server."""
    _, proc, ranks = server
    assert all(_alive(p) for p in ranks)
    proc.send_signal(signal.SIGTERM)
    # 128 + SIGTERM, as one process's uvicorn exits; a rank that did not end cleanly on rank 0's
    # shutdown message would give its own code and be named in the output
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "rank 1 failed" not in proc.stdout.read()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in ranks):
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks)


def test_a_dead_rank_ends_the_server(tiny_dir, tmp_path) -> None:
    """Ranks started as torchrun starts them (its variables, no launcher to stop the others):
    rank 1 killed, the next request fails and rank 0 exits 1 instead of waiting forever."""
    from deltaserve.distributed.launch import free_port as rdzv_port
    from deltaserve.distributed.launch import rank_env

    port, rdzv = free_port(), rdzv_port()
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--model", str(tiny_dir), "--tp", "2",
           "--device", "cpu", "--dtype", "float32", "--port", str(port),
           "--served-model-name", MODEL]
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    procs = [subprocess.Popen(cmd, env={**os.environ, **rank_env(r, 2, rdzv, 1)},
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    base = f"http://127.0.0.1:{port}"
    def alive() -> None:
        assert all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()

    try:
        wait_healthy(base, alive)
        procs[1].kill()
        procs[1].wait()
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{base}/v1/completions", json=body, timeout=60).raise_for_status()
        assert procs[0].wait(timeout=60) == 1
        assert "tensor-parallel engine stopped" in (tmp_path / "rank0.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()


@pytest.mark.parametrize(("args", "needle"), [
    (["--tp", "3"], "divide"),
    (["--tp", "2", "--device", "cuda"], "needs 2 CUDA GPUs"),
])
def test_clear_errors_before_any_rank_starts(tiny_dir, capsys, args, needle) -> None:
    import torch

    from deltaserve.cli import main

    if "cuda" in args and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    assert main(["serve", "--model", str(tiny_dir), *args]) == 1
    assert needle in capsys.readouterr().err


def test_an_image_request_reaches_the_other_ranks_whole() -> None:
    """The wire form of an add with images pickles on the CPU and lands on the follower's device
    with the same embeddings, positions and cache keys (no process group needed)."""
    import pickle
    from types import SimpleNamespace

    import torch

    from deltaserve.distributed.serve import apply, wire
    from deltaserve.engine.request import ImageInputs

    images = ImageInputs((1, 2), torch.randn(2, 8), (5, -7, -7, 6))
    params = SamplingParams(temperature=0, max_tokens=3)
    cmd = ("add", "r1", [5, 9, 9, 6], params, None, None, images, 0)
    sent = pickle.loads(pickle.dumps(wire(cmd)))
    added = []
    engine = SimpleNamespace(add_request=lambda *a: added.append(a))
    assert apply(SimpleNamespace(engine=engine, device=torch.device("cpu")), sent)
    rid, ids, got_params, got = added[0]
    assert (rid, ids, got_params) == ("r1", [5, 9, 9, 6], params)
    assert got.positions == images.positions and got.key_ids == images.key_ids
    assert torch.equal(got.embeds, images.embeds)
    assert wire(("call", lambda: 0, None, None, None)) is None  # rank 0's own (the tower)
