"""Failure isolation behind a real uvicorn server (issue 31): a request whose sampling or logits go
wrong fails alone and the others finish with the tokens they get alone; an exception inside an
engine step is logged, fails what was in flight, and the engine is rebuilt and serves again; a
non-streaming request whose client goes away is aborted; prompts are prepared off the event loop
and bounded before tokenizing; the context check comes before any prompt scoring."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
import torch

from deltaserve.bench.soak import metric
from deltaserve.server.app import build_app
from tests.server.helpers import app_server

NAME = "m"
CODE = "def parse(text):"
PROSE = "The quick brown fox"


@pytest.fixture(scope="module")
def served():
    """(base URL, llm): the default model, fp32, 256 tokens of context, served in this process."""
    from deltaserve import LLM

    llm = LLM(dtype="float32", max_model_len=256)
    with app_server(build_app(llm, NAME)) as base:
        yield base, llm


def _body(prompt: str, **kw) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, **kw}


async def _text(client: httpx.AsyncClient, base: str, body: dict) -> tuple[int, str]:
    """(status, text) of one completion; streamed bodies are joined from their chunks."""
    if not body.get("stream"):
        r = await client.post(f"{base}/v1/completions", json=body)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
    parts, status = [], 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        status = r.status_code
        if status != 200:  # failed before its first token: a plain error response
            return status, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                frame = json.loads(line[6:])
                if "error" in frame:
                    return 500, frame["error"]["message"]
                parts.extend(c["text"] for c in frame["choices"])
    return status, "".join(parts)


def _together(base: str, bodies: list[dict]) -> list[tuple[int, str]]:
    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[_text(client, base, b) for b in bodies])

    return asyncio.run(go())


def _healthy_and_idle(base: str, llm) -> None:
    deadline = time.monotonic() + 20
    while metric(base, "deltaserve:requests_open") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert metric(base, "deltaserve:requests_open") == 0
    usage = llm.engine.cache.usage()
    assert usage["blocks_held_by_requests"] == 0 and usage["slots_used"] == 0, usage


def test_tiny_temperatures_and_nuclei_sample_safely_beside_other_requests(served) -> None:
    """temperature 1e-38 / 1e-300 once made fp32 logits / T overflow: the probabilities went NaN,
    the sampler raised and the engine died for every user. Now the logits are shifted by their
    max before the division (the divisor clamped to fp32's smallest normal): the draw is the
    argmax, as greedy, and the greedy requests beside them keep their solo tokens."""
    base, llm = served
    solo = {p: _together(base, [_body(p)])[0] for p in (CODE, PROSE)}
    restarts = metric(base, "deltaserve:engine_restarts_total")
    got = _together(base, [
        _body(CODE, stream=True), _body(PROSE),
        _body(CODE, temperature=1e-38, seed=1), _body(PROSE, temperature=1e-300, seed=2),
        _body(CODE, temperature=1e-30, top_p=1e-300, seed=3),
        _body(PROSE, temperature=2.0, min_p=1.0, seed=4),
    ])
    assert got[0] == solo[CODE] and got[1] == solo[PROSE]
    assert got[2] == solo[CODE] and got[3] == solo[PROSE]  # T -> 0 is greedy
    assert got[4] == solo[CODE] and got[5] == solo[PROSE]  # only the top token survives
    assert metric(base, "deltaserve:engine_restarts_total") == restarts
    _healthy_and_idle(base, llm)


def test_a_non_finite_row_fails_only_its_request(served, monkeypatch) -> None:
    """Fault injection: the logits row of any chunk ending in the marker token goes NaN. That
    request (sampling: the step keeps its logits) ends with non_finite_logits; the greedy ones
    batched with it, streamed and whole, get their solo tokens."""
    base, llm = served
    solo = {p: _together(base, [_body(p)])[0] for p in (CODE, PROSE)}
    marker, forward = 1234, llm.model.forward_batch

    def poisoned(input_ids, batch, *args, **kw):
        out = forward(input_ids, batch, *args, **kw)
        if out.is_floating_point() and out.shape[0] == len(batch.chunks):
            last = input_ids[torch.tensor(batch.logit_rows())]
            out = out.masked_fill((last == marker)[:, None], float("nan"))
        return out

    monkeypatch.setattr(llm.model, "forward_batch", poisoned)
    bad = {**_body(""), "prompt": [17, 42, marker], "temperature": 0.8, "seed": 5}
    got = _together(base, [_body(CODE, stream=True), bad, _body(PROSE), {**bad, "stream": True},
                           _body(PROSE, stream=True), _body(CODE)])
    assert got[0] == solo[CODE] and got[2] == solo[PROSE]
    assert got[4] == solo[PROSE] and got[5] == solo[CODE]
    assert got[1][0] == 500 and "non_finite_logits" in got[1][1]
    assert got[3][0] == 500 and "non_finite_logits" in got[3][1]
    _healthy_and_idle(base, llm)


def test_an_exception_in_a_step_is_logged_and_the_engine_is_rebuilt(served, caplog) -> None:
    """The step loop raises once with a request in flight: the cause is logged, that request gets
    503 engine_unavailable (no exception text), /health is 503 only while the engine is rebuilt,
    and the rebuilt engine serves the same tokens as before."""
    base, llm = served
    before = _together(base, [_body(CODE)])[0]
    restarts = metric(base, "deltaserve:engine_restarts_total")
    engine, step = llm.engine, llm.engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault /private/path")
        return step()

    engine.step = failing_step
    with caplog.at_level(logging.ERROR, logger="deltaserve.server"):
        r = httpx.post(f"{base}/v1/completions", json=_body(CODE), timeout=60)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "/private" not in err["message"]
    assert any("injected fault" in (rec.exc_text or rec.getMessage()) for rec in caplog.records)
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/health").status_code != 200:
        assert "/private" not in httpx.get(f"{base}/health").text
        assert time.monotonic() < deadline, "the engine was not rebuilt"
        time.sleep(0.05)
    assert llm.engine is not engine  # a fresh engine, not the failed one patched back
    assert _together(base, [_body(CODE)])[0] == before
    assert metric(base, "deltaserve:engine_restarts_total") == restarts + 1
    _healthy_and_idle(base, llm)


def test_a_whole_request_whose_client_leaves_is_aborted(served, monkeypatch, caplog) -> None:
    """A non-streaming request for 230 tokens (steps slowed to 20 ms, so it needs ~5 s): its
    client times out after 1 s; the request is aborted (counter +1, nothing open, no blocks held)
    instead of generating on."""
    base, llm = served
    forward = llm.model.forward_batch

    def slowed(*a, **kw):
        time.sleep(0.02)
        return forward(*a, **kw)

    monkeypatch.setattr(llm.model, "forward_batch", slowed)
    aborted = metric(base, "deltaserve:requests_aborted_total")
    steps = metric(base, "deltaserve:engine_steps_total")
    body = _body(CODE, max_tokens=230)
    body["prompt"] = "x"
    with caplog.at_level(logging.ERROR), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 10
    while metric(base, "deltaserve:requests_aborted_total") == aborted:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    _healthy_and_idle(base, llm)
    assert metric(base, "deltaserve:engine_steps_total") - steps < 229  # it did not finish
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[:2000]


def test_prompts_are_prepared_off_the_event_loop(served, monkeypatch) -> None:
    """A tokenizer call that takes 2 s (a megabyte prompt once did) no longer freezes /health."""
    base, llm = served
    encode, started = llm.tokenizer.encode, threading.Event()

    def slow(text, *a, **kw):
        if text.startswith("SLOW"):
            started.set()
            time.sleep(2)
        return encode(text, *a, **kw)

    monkeypatch.setattr(llm.tokenizer, "encode", slow)
    worker = threading.Thread(target=httpx.post, args=(f"{base}/v1/completions",),
                              kwargs={"json": _body("SLOW " + CODE, max_tokens=2), "timeout": 60})
    worker.start()
    assert started.wait(30)
    t0 = time.monotonic()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 1.0  # answered while the tokenizer still works
    worker.join(60)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_huge_prompt_is_refused_before_tokenizing(served, route, monkeypatch) -> None:
    """3 MB of text against 256 tokens of context: a 400 from the character bound (256 tokens x
    the vocabulary's longest token), the tokenizer never called."""
    base, llm = served
    calls = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    text = "word " * 600_000
    body = ({"model": NAME, "messages": [{"role": "user", "content": text}]}
            if "chat" in route else {"model": NAME, "prompt": text})
    r = httpx.post(f"{base}{route}", json=body, timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text[:300]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert not calls


def test_echo_scoring_waits_for_the_context_check(served, monkeypatch) -> None:
    """echo + logprobs on a prompt longer than the context: 400 before any scoring (20k ids once
    held the engine for 95 s, then got the 400)."""
    from deltaserve.server import logprobs

    base, _ = served
    calls = []
    monkeypatch.setattr(logprobs, "completion_logprobs", lambda *a, **k: calls.append(1))
    for max_tokens in (0, 8):
        r = httpx.post(f"{base}/v1/completions", json={
            "model": NAME, "prompt": [17] * 2000, "echo": True, "logprobs": 1,
            "max_tokens": max_tokens}, timeout=60)
        assert r.status_code == 400 and "maximum context length" in r.text, r.text
    assert not calls


def test_a_mixed_soak_loses_nothing_and_leaks_nothing(served) -> None:
    """144 requests, 16 at a time, of six kinds (deltaserve/bench/soak.py: streamed, whole, both
    abandoned by their clients, bad input, extreme sampling): no 5xx, none lost, every abandoned
    request aborted or finished, and nothing left open, no slot or KV block held after."""
    from deltaserve.bench.soak import soak

    base, llm = served
    before = _together(base, [_body(CODE)])[0]
    figures = asyncio.run(soak(base, NAME, requests=144, concurrency=16))
    assert figures["server_errors"] == 0 and figures["lost"] == 0, figures
    assert figures["statuses"].get("400") == figures["kinds"]["bad_input"], figures
    _healthy_and_idle(base, llm)
    assert _together(base, [_body(CODE)])[0] == before  # greedy output unchanged after


def test_metrics_under_a_churning_engine_never_touch_its_structures(served, monkeypatch) -> None:
    """/metrics once iterated the cache manager's dicts from the event loop while the engine thread
    changed them ("dictionary changed size during iteration"). Now it reads the gauges the engine
    thread publishes: 150 scrapes during 48 requests all answer, and nothing of the cache manager
    runs on another thread."""
    base, llm = served
    cache, engine_thread, strays = llm.engine.cache, [], []
    usage = cache.usage

    def watched():
        if engine_thread and threading.get_ident() != engine_thread[0]:
            strays.append(threading.current_thread().name)
        return usage()

    engine_thread.append(_engine_thread_ident(base, llm))
    monkeypatch.setattr(cache, "usage", watched)
    scrapes, stop = [], threading.Event()

    def scrape():
        while not stop.is_set():
            r = httpx.get(f"{base}/metrics", timeout=30)
            scrapes.append((r.status_code, _gauge(r.text, "vllm:kv_cache_usage_perc")))

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        got = _together(base, [_body(CODE if i % 2 else PROSE, max_tokens=8,
                                     stream=bool(i % 3)) for i in range(48)])
        while len(scrapes) < 150:
            time.sleep(0.01)
    finally:
        stop.set()
        scraper.join(30)
    assert all(status == 200 for status, _ in got)
    assert all(s == 200 and 0 <= kv <= 1 for s, kv in scrapes), scrapes[:5]
    assert not strays


def _gauge(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def _engine_thread_ident(base: str, llm) -> int:
    """The engine thread's ident, asked of the engine thread itself (a request's step runs there)."""
    seen, step = [], llm.engine.step

    def spy():
        seen.append(threading.get_ident())
        return step()

    llm.engine.step = spy
    try:
        _together(base, [_body(CODE, max_tokens=1)])
    finally:
        del llm.engine.step
    return seen[0]
