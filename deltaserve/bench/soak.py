"""A reliability soak against a running server: many clients at once, each one of a fixed mix of
kinds (streamed, whole, abandoned mid-stream, abandoned while waiting for a whole answer, bad
input, extreme sampling parameters), every answer checked against what its kind must get.

`lost` counts requests that should have completed and did not (a 5xx, a stream without
`[DONE]`, an empty completion); `server_errors` counts every 5xx whatever the kind. The caller
checks the server afterwards (open requests, slots, memory): tests/server/test_isolation.py in CI,
scripts/server/soak.py for minutes-long runs with a record.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

import httpx

KINDS = ("stream", "whole", "stream_abandoned", "whole_abandoned", "bad_input", "extreme")
_BAD = ({"temperature": -1}, {"top_p": 0}, {"max_tokens": "many"}, {"prompt": [10**9]},
        {"n": 0}, {"stop": [None]}, {"logprobs": 99})


async def _one(client: httpx.AsyncClient, base: str, model: str, kind: str, rng: random.Random,
               max_tokens: int) -> tuple[int, bool]:
    """(HTTP status, whether the answer is what this kind must get)."""
    body = {"model": model, "prompt": rng.choice(["def f(x):", "import os\n", "Hello"]),
            "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(99)}
    url = f"{base}/v1/completions"
    if kind == "bad_input":
        r = await client.post(url, json={**body, **rng.choice(_BAD)})
        return r.status_code, r.status_code == 400
    if kind == "extreme":
        body.update(rng.choice([{"temperature": 1e-38}, {"temperature": 1e-300}, {"top_p": 1e-300},
                                {"min_p": 1.0, "temperature": 2.0}]))
    if kind == "whole_abandoned":
        try:
            r = await client.post(url, json={**body, "max_tokens": 4 * max_tokens},
                                  timeout=httpx.Timeout(60, read=0.05))
        except httpx.ReadTimeout:
            return 0, True  # gone before the answer: the server must clean up
        return r.status_code, r.status_code == 200
    if kind in ("whole", "extreme"):
        r = await client.post(url, json=body)
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        return r.status_code, ok
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if kind == "stream_abandoned":
            async for _ in r.aiter_lines():
                break
            return r.status_code, r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
        return r.status_code, r.status_code == 200 and lines[-1] == "data: [DONE]"


def metric(base: str, name: str, headers: dict[str, str] | None = None) -> float:
    """One sample of a running server's /metrics (the first series of that name); KeyError if none."""
    for line in httpx.get(f"{base}/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} not in /metrics")


async def soak(base: str, model: str, requests: int, concurrency: int = 16, seed: int = 0,
               headers: dict[str, str] | None = None, max_tokens: int = 12) -> dict:
    """Run `requests` requests of the mixed kinds, `concurrency` at a time; the tallies."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(requests)]
    rng.shuffle(kinds)
    statuses, lost = collections.Counter(), collections.Counter()
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:

        async def gated(kind: str, r: random.Random) -> None:
            async with gate:
                try:
                    status, ok = await _one(client, base, model, kind, r, max_tokens)
                except httpx.HTTPError as exc:  # a dropped connection is a loss, not a crash
                    status, ok = type(exc).__name__, False
            statuses[status] += 1
            if not ok:
                lost[kind] += 1

        await asyncio.gather(*[gated(k, random.Random(rng.random())) for k in kinds])
    return {"requests": requests, "concurrency": concurrency, "kinds": dict(collections.Counter(kinds)),
            "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
            "server_errors": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
            "lost": sum(lost.values()), "lost_by_kind": dict(lost),
            "seconds": round(time.perf_counter() - t0, 2)}
