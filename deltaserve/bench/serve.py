"""`deltaserve bench serve`: load against a running OpenAI-compatible server, reported in the layout
of `vllm bench serve` (TTFT, TPOT, ITL, E2EL mean / median / percentiles; request and token
throughput), with the record as JSON.

Prompts are random windows of real token ids (random words tokenized by the server's /tokenize),
cut to exactly --random-input-len tokens and sent as token lists, so every engine sees the same
input length; outputs run exactly --random-output-len tokens (ignore_eos). Arrivals are a Poisson
process at --request-rate (gamma with --burstiness), optionally capped at --max-concurrency.
All latencies are measured at the client, from sending a request to its chunks arriving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deltaserve.bench.request_stats import WORDS, summarize
from deltaserve.progress import bar

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Outcome:
    """One request as the client saw it."""

    input_len: int
    ok: bool = False
    error: str = ""
    output_len: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # between successive content chunks
    e2el_s: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--save-result", action="store_true", help="write the JSON record")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    metrics = [m for m in args.percentile_metrics.split(",") if m]
    if bad := [m for m in metrics if m not in PERCENTILE_METRICS]:
        print(f"bench serve: error: unknown metric(s) {bad}; choose from {PERCENTILE_METRICS}",
              file=sys.stderr)
        return 2
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        print("bench serve: error: --num-prompts and the lengths must be >= 1", file=sys.stderr)
        return 2
    try:
        record = asyncio.run(_run(args))
    except httpx.HTTPError as exc:
        print(f"bench serve: error: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # the server refused the set-up calls
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 1
    percentiles = [float(q) for q in args.metric_percentiles.split(",")]
    summary = summarize(record["outcomes"], record["duration_s"], metrics, percentiles)
    record.update(summary)
    print(_table(record, metrics, percentiles))
    for error in sorted({o.error for o in record["outcomes"] if not o.ok})[:3]:
        print(f"bench serve: a failed request: {error}", file=sys.stderr)
    if args.save_result:
        name = args.result_filename or f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_jsonable(record), indent=1) + "\n", encoding="utf-8")
        print(f"bench serve: wrote {path}")
    return 0 if summary["completed"] else 1


def _headers(args) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _setup(client: httpx.AsyncClient, args) -> tuple[str, list[list[int]], list[int]]:
    """The model id, each prompt's token ids and each request's output length."""
    if args.model is None:
        models = await client.get("/v1/models")
        if models.status_code != 200:
            raise RuntimeError(f"/v1/models answered {models.status_code}: {models.text[:200]}")
        args.model = models.json()["data"][0]["id"]
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        r = args.random_range_ratio
        return max(1, rng.randint(int(mean * (1 - r)), int(mean * (1 + r))))

    input_lens = [length(args.random_input_len) for _ in range(args.num_prompts)]
    output_lens = [length(args.random_output_len) for _ in range(args.num_prompts)]
    words = " ".join(rng.choice(WORDS) for _ in range(max(input_lens) * 2 + 64))
    tok = await client.post("/tokenize", json={"prompt": words})
    if tok.status_code != 200:
        raise RuntimeError(f"/tokenize answered {tok.status_code}: {tok.text[:200]}")
    pool = tok.json()["tokens"]
    prompts = []
    for n in input_lens:
        start = rng.randrange(0, len(pool) - n + 1)
        prompts.append(pool[start:start + n])
    return args.model, prompts, output_lens


async def _run(args) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=_headers(args), limits=limits,
                                 timeout=httpx.Timeout(args.timeout_s, connect=30.0)) as client:
        model, prompts, output_lens = await _setup(client, args)
        texts = await _chat_texts(client, prompts) if "chat" in args.endpoint else None
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed + 1)
        tasks, start = [], time.perf_counter()
        with bar(len(prompts), "bench serve", "req") as shown:
            for i, ids in enumerate(prompts):
                body = _body(args, model, ids, texts[i] if texts else None, output_lens[i])
                tasks.append(asyncio.create_task(_limited(gate, client, args.endpoint, body,
                                                          len(ids), shown)))
                if i + 1 < len(prompts) and args.request_rate != float("inf"):
                    scale = 1.0 / (args.request_rate * args.burstiness)
                    await asyncio.sleep(rng.gammavariate(args.burstiness, scale))
            outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return {"backend": "deltaserve", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "base_url": args.base_url, "endpoint": args.endpoint, "model_id": model,
            "num_prompts": args.num_prompts, "request_rate": args.request_rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len, "seed": args.seed,
            "duration_s": duration, "outcomes": outcomes}


async def _chat_texts(client: httpx.AsyncClient, prompts: list[list[int]]) -> list[str]:
    """Chat messages are text: each prompt's ids decoded once before the clock starts (the chat
    template adds its own tokens; the input counts reported are the server's usage figures)."""
    out = []
    for ids in prompts:
        r = await client.post("/detokenize", json={"tokens": ids})
        if r.status_code != 200:
            raise RuntimeError(f"/detokenize answered {r.status_code}: {r.text[:200]}")
        out.append(r.json()["prompt"])
    return out


def _body(args, model: str, ids: list[int], text: str | None, output_len: int) -> dict:
    body = {"model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if text is not None:
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "prompt": ids}


async def _limited(gate, client, endpoint, body, input_len, shown) -> Outcome:
    async with gate:
        outcome = await _one(client, endpoint, body, input_len)
    shown.update(1)
    return outcome


async def _one(client: httpx.AsyncClient, endpoint: str, body: dict, input_len: int) -> Outcome:
    out, t0 = Outcome(input_len), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error'].get('message')}"
                    return out
                if chunk.get("usage"):  # what the server counted (chat adds template tokens)
                    out.output_len = chunk["usage"]["completion_tokens"]
                    out.input_len = chunk["usage"]["prompt_tokens"]
                if _has_content(chunk):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft_s = now - t0
                    else:
                        out.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2el_s = time.perf_counter() - t0
    out.ok = last is not None
    if not out.ok:
        out.error = "no content arrived"
    return out


def _has_content(chunk: dict) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _table(rec: dict, metrics: list[str], percentiles: list[float]) -> str:
    names = {"ttft": ("Time to First Token", "TTFT"),
             "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
             "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    rows = [("Successful requests:", rec["completed"]), ("Failed requests:", rec["failed"])]
    if rec["max_concurrency"]:
        rows.append(("Maximum request concurrency:", rec["max_concurrency"]))
    rows += [("Benchmark duration (s):", f"{rec['duration_s']:.2f}"),
             ("Total input tokens:", rec["total_input_tokens"]),
             ("Total generated tokens:", rec["total_output_tokens"]),
             ("Request throughput (req/s):", f"{rec['request_throughput']:.2f}"),
             ("Output token throughput (tok/s):", f"{rec['output_throughput']:.2f}"),
             ("Total Token throughput (tok/s):", f"{rec['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for m in metrics:
        title, short = names[m]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(f"{f'Mean {short} (ms):':<40}{rec[f'mean_{m}_ms']:<10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{rec[f'median_{m}_ms']:<10.2f}")
        for q in percentiles:
            label = f"P{q:g} {short} (ms):"
            lines.append(f"{label:<40}{rec[f'p{q:g}_{m}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def _jsonable(record: dict) -> dict:
    outcomes = record.pop("outcomes")
    record["input_lens"] = [o.input_len for o in outcomes]
    record["output_lens"] = [o.output_len for o in outcomes]
    record["ttfts_s"] = [o.ttft_s for o in outcomes]
    record["itls_s"] = [o.itl_s for o in outcomes]
    record["errors"] = [o.error for o in outcomes]
    from deltaserve.bench.record import git_commit

    record["git_commit"] = git_commit()
    return record

