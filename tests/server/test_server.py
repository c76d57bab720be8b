"""The OpenAI-compatible server as users meet it: a real uvicorn process on loopback serving the
embedded default model, driven by the `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest

from deltaserve.bench.soak import metric
from deltaserve.cache.sequence import prompt_logits
from tests.server.helpers import running_server

KEY = "test-key-123"
MODEL = "stdlib-19m"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SERVER_PID: list[int] = []


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", KEY, "--max-model-len", "512",
                        "--dtype", "float32", "--max-body-mb", "4") as (base, proc):
        SERVER_PID.append(proc.pid)
        yield base


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
    return metric(base, name, HEADERS)


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
    # the latency histograms saw requests; their buckets are cumulative
    assert _metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    assert _metric(server, "vllm:e2e_request_latency_seconds_count") >= 1
    text = httpx.get(f"{server}/metrics", headers=HEADERS, timeout=10).text
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:inter_token_latency_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] >= 1


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

    def chunks(parts):  # no Content-Length: chunked transfer, the size known only as it arrives
        yield from parts

    head = b'{"model": "%s", "prompt": "' % MODEL.encode()
    _error(httpx.post(f"{server}/v1/completions", content=chunks([head] + [b"a" * (1 << 20)] * 5
                                                                 + [b'"}']),
                      headers={**HEADERS, "content-type": "application/json"}), 413)
    small = json.dumps(body).encode()
    chunked = httpx.post(f"{server}/v1/completions", content=chunks([small[:9], small[9:]]),
                         headers={**HEADERS, "content-type": "application/json"})
    assert chunked.status_code == 200 and chunked.request.headers.get("content-length") is None
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # open, no key
    assert httpx.get(f"{server}/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS).status_code == 200


def test_loglikelihood_through_completions_matches_the_engine(server) -> None:
    """lm-evaluation-harness's request: context + continuation as token ids, echo, logprobs=1,
    one generated token; the continuation's summed logprob equals the model's own (fp32)."""
    import torch

    from deltaserve import LLM

    llm = LLM(dtype="float32")
    ctx, cont = llm.tokenizer.encode("def add(a, b):\n"), llm.tokenizer.encode("    return a + b\n")
    ids = ctx + cont
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    got = httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS, timeout=60).json()
    lp = got["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    server_sum = sum(lp["token_logprobs"][len(ctx) : len(ids)])
    with torch.inference_mode():
        logits = prompt_logits(llm.model, ids)
    logp = torch.log_softmax(logits.float(), -1)
    own = sum(logp[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
    assert abs(server_sum - own) <= 1e-4 * max(1.0, abs(own))
    greedy = [max(t, key=t.get) for t in lp["top_logprobs"][len(ctx) : len(ids)]]
    assert len(greedy) == len(cont)  # is_greedy: the top alternative at each continuation token
    only = httpx.post(f"{server}/v1/completions", json={**body, "max_tokens": 0},
                      headers=HEADERS, timeout=60).json()["choices"][0]
    # max_tokens 0 scores on a sequence of its own; with generation the prefill scores it
    assert only["logprobs"]["token_logprobs"][0] is None
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(
        lp["token_logprobs"][1: len(ids)], abs=1e-5)
    assert only["text"] == llm.tokenizer.decode(ids)


def test_chat_logprobs_describe_the_generated_tokens(server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "import sys"}],
            "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    got = httpx.post(f"{server}/v1/chat/completions", json=body, headers=HEADERS,
                     timeout=60).json()
    content = got["choices"][0]["logprobs"]["content"]
    assert len(content) == got["usage"]["completion_tokens"]
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item["top_logprobs"]) == 2 and item["logprob"] <= 0
        assert abs(item["logprob"] - item["top_logprobs"][0]["logprob"]) <= 1e-5
    # streamed: the engine's own per-step values, equal to the teacher-forced ones above
    streamed = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True},
                      headers=HEADERS, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed.extend((c.get("logprobs") or {}).get("content") or [])
    assert [i["token"] for i in streamed] == [i["token"] for i in content]
    for a, b in zip(streamed, content, strict=True):
        assert abs(a["logprob"] - b["logprob"]) <= 1e-4
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]


def test_streamed_completion_logprobs_and_echo_match_the_whole_response(server) -> None:
    body = {"model": MODEL, "prompt": "for i in range(", "max_tokens": 5, "temperature": 0,
            "logprobs": 3, "echo": True}
    whole = httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS,
                       timeout=60).json()["choices"][0]
    text, lps = "", {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True},
                      headers=HEADERS, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                for key in lps:
                    lps[key].extend((c["logprobs"] or {}).get(key) or [])
    assert text == whole["text"] and text.startswith(body["prompt"])
    want = whole["logprobs"]
    assert lps["tokens"] == want["tokens"] and lps["text_offset"] == want["text_offset"]
    assert lps["token_logprobs"][0] is None  # the first prompt token has no context
    for a, b in zip(lps["token_logprobs"][1:], want["token_logprobs"][1:], strict=True):
        assert abs(a - b) <= 1e-4
    assert [list(t) for t in lps["top_logprobs"][1:]] == [list(t) for t in want["top_logprobs"][1:]]


def test_a_full_queue_answers_503_and_the_server_recovers(tmp_path) -> None:
    """One slot, a queue of one: of six long requests at once, the ones beyond slot + queue get
    an OpenAI-shaped 503 at admission; the rest complete; afterwards requests succeed again."""
    with running_server("--max-num-seqs", "1", "--max-queue", "1",
                        "--dtype", "float32") as (base, _):
        body = {"model": MODEL, "prompt": "def f():\n", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[client.post(f"{base}/v1/completions", json=body)
                                              for _ in range(6)])

        replies = asyncio.run(burst())
        codes = sorted(r.status_code for r in replies)
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
        busy = next(r for r in replies if r.status_code == 503)
        assert _error(busy, 503)["code"] == "server_overloaded"
        again = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        assert again.status_code == 200


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_bounded_soak_loses_no_request_and_leaks_no_memory(server) -> None:
    """240 requests (streamed and not, 16 at a time, some abandoned mid-stream) in four rounds:
    every kept request completes, nothing stays open, and resident memory after the last round
    is within 64 MB of the first (warm) one."""
    body = {"model": MODEL, "prompt": "for i in range(", "max_tokens": 12, "temperature": 0.7,
            "seed": 1}

    async def one(client, i):
        if i % 2:
            r = await client.post(f"{server}/v1/completions", json=body, headers=HEADERS)
            return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        async with client.stream("POST", f"{server}/v1/completions",
                                 json={**body, "stream": True}, headers=HEADERS) as r:
            if i % 10 == 0:  # abandoned after its first event: the server must clean up
                async for _ in r.aiter_lines():
                    break
                return r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
            return r.status_code == 200 and lines[-1] == "data: [DONE]"

    async def round_(n):
        async with httpx.AsyncClient(timeout=120) as client:
            sem = asyncio.Semaphore(16)

            async def gated(i):
                async with sem:
                    return await one(client, i)

            return await asyncio.gather(*[gated(i) for i in range(n)])

    rss = []
    for _ in range(4):
        assert all(asyncio.run(round_(60)))
        rss.append(_rss_mb(SERVER_PID[-1]))
    deadline = time.monotonic() + 10
    while _metric(server, "deltaserve:requests_open") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server, "deltaserve:requests_open") == 0
    assert rss[-1] - rss[0] <= 64, rss


def test_thinking_output_is_split_into_reasoning_content(tmp_path) -> None:
    """The tiny checkpoint carries Qwen3.5's template (thinking on: the prompt opens a think
    block). Its random weights never close the block, so all text is reasoning, streamed or not;
    with enable_thinking off the same request's text is content."""
    from tests.conftest import write_variant

    model = write_variant(tmp_path / "tiny", 0)
    with running_server("--model", str(model), "--dtype", "float32") as (base, _):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8, "temperature": 0}
        msg = httpx.post(f"{base}/v1/chat/completions", json=body,
                         timeout=60).json()["choices"][0]["message"]
        assert msg["content"] == "" and msg["reasoning_content"]
        frames = httpx.post(f"{base}/v1/chat/completions", json={**body, "stream": True},
                            timeout=60).text.split("\n\n")
        deltas = [json.loads(f[6:])["choices"][0]["delta"] for f in frames
                  if f.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas).rstrip("\n") == \
            msg["reasoning_content"]
        assert not any(d.get("content") for d in deltas)
        off = httpx.post(f"{base}/v1/chat/completions", json={
            **body, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60).json()
        assert off["choices"][0]["message"]["content"] and \
            "reasoning_content" not in off["choices"][0]["message"]


def test_schema_fuzz_finds_no_server_errors(server) -> None:
    """Hypothesis-generated requests from the app's own OpenAPI schema (schemathesis), with the
    model name fixed so bodies reach validation and the engine: no 500 (internal error), whatever
    the body."""
    schemathesis = pytest.importorskip("schemathesis")
    import torch
    from hypothesis import HealthCheck, given, settings

    # deltaserve flushes denormals to zero in this process (an earlier test loaded a model), and
    # hypothesis's float strategies refuse to run then; the server is another process
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json", headers=HEADERS)
    failures, labels = [], []

    def fuzz_one(operation) -> None:
        @given(case=operation.as_strategy())
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None, derandomize=True)  # the same cases in every CI run
        def fuzz(case) -> None:
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the 404: into validation and the engine
            resp = case.call(base_url=server, headers=HEADERS, timeout=60)
            # 501 (a documented unsupported combination) and 503 (busy) are answers, not faults
            if resp.status_code >= 500 and resp.status_code not in (501, 503):
                failures.append((case.path, resp.status_code, resp.text[:200]))

        fuzz()

    torch.set_flush_denormal(False)
    try:
        for result in schema.get_all_operations():
            labels.append(result.ok().label)
            fuzz_one(result.ok())
    finally:
        torch.set_flush_denormal(True)  # as deltaserve.checkpoint.loader leaves this process
    assert any("chat/completions" in label for label in labels)
    assert not failures, failures[:5]


def test_n_choices_sample_each_with_its_own_seed_and_stream_by_index(server) -> None:
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 10, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}
    many = httpx.post(f"{server}/v1/completions", json={**body, "n": 3}, headers=HEADERS,
                      timeout=60).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"]["completion_tokens"] == 30 and many["usage"]["prompt_tokens"] > 0
    for i, c in enumerate(many["choices"]):  # choice i == a lone request seeded seed + i
        one = httpx.post(f"{server}/v1/completions", json={**body, "seed": 3 + i},
                         headers=HEADERS, timeout=60).json()
        assert c["text"] == one["choices"][0]["text"] and c["finish_reason"] == "length"
    texts = {c["text"] for c in many["choices"]}
    assert len(texts) > 1  # temperature 1 over 10 tokens: the seeds really differ
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    parts, reasons, usage = {0: "", 1: ""}, {}, None
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=chat, headers=HEADERS,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                for c in frame["choices"]:
                    parts[c["index"]] += c["delta"].get("content", "")
                    if c["finish_reason"]:
                        reasons[c["index"]] = c["finish_reason"]
                usage = frame.get("usage") or usage
    whole = httpx.post(f"{server}/v1/chat/completions", json={**chat, "stream": False},
                       headers=HEADERS, timeout=60).json()
    assert [parts[0], parts[1]] == [c["message"]["content"] for c in whole["choices"]]
    assert set(reasons) == {0, 1} and usage["completion_tokens"] == \
        whole["usage"]["completion_tokens"]
    too_many = httpx.post(f"{server}/v1/completions", json={**body, "n": 17}, headers=HEADERS)
    assert _error(too_many, 400)["param"] == "n"
