"""Time to first token of a single-image question through `deltaserve serve` (issue 8).

Starts the server on a MiniCPM-V-4.6 checkpoint (random weights of the real shape), sends
streamed chat requests with one image as a data: URL (a different image each time, so neither
the prefix cache nor anything else can reuse work), and times the first content chunk as the
client sees it: upload, decode, slicing, tower, prefill, first token, SSE. Writes JSON.

    python3 scripts/gpu/vision_ttft.py --model /tmp/mcv --device cuda --out vision_ttft.json
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
from PIL import Image

# One keep-alive client, as the openai SDK keeps one: a fresh httpx call per request would time
# httpx building an SSL context (50-100 ms here), not the server.
CLIENT = httpx.Client()


def _data_url(height_px: int, width_px: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height_px, 0:width_px]
    img = np.stack([(xx + seed) % 256, (yy * 2) % 256, (xx ^ yy) % 256], -1) + rng.integers(
        0, 32, (height_px, width_px, 3))
    buf = io.BytesIO()
    Image.fromarray((img % 256).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _ttft_s(base: str, url: str, max_tokens: int = 8) -> tuple[float, float, int]:
    """(seconds to the first content chunk, to the end, prompt tokens) of one streamed request."""
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"}]}]}
    t0 = time.perf_counter()
    first, prompt_tokens = None, 0
    with CLIENT.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0, prompt_tokens


def _server_ttft_sum_s(base: str) -> float:
    """The server's own TTFT histogram sum (engine admission to first token, /metrics)."""
    for line in CLIENT.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


@functools.cache
def _nvml_handle():
    """NVML's handle of GPU 0 (no CUDA context in this client), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 (no NVML: a CPU run)
        return None


def _sm_clock_mhz() -> float:
    """The GPU's SM clock now, or nan."""
    handle = _nvml_handle()
    if handle is None:
        return float("nan")
    import pynvml

    return float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))


def _timed_runs(base: str, h: int, w: int, count: int) -> list[tuple]:
    """(client TTFT, client e2e, prompt tokens, server admission-to-first-token, SM clock MHz
    just before the request) per request."""
    runs = []
    for seed in range(count):
        url = _data_url(h, w, seed)
        before, clock = _server_ttft_sum_s(base), _sm_clock_mhz()
        first, e2e, prompt = _ttft_s(base, url)
        runs.append((first, e2e, prompt, _server_ttft_sum_s(base) - before, clock))
    return runs


def _breakdown(args) -> dict:
    """The same request's stages in-process (no HTTP): decode + slice, render + tokenize, tower,
    prefill + first token through the engine; medians of 10 after 3 warm-ups."""
    import torch

    from deltaserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    stages: dict[str, list[float]] = {}

    def timed(name, fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        stages.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        return out

    for seed in range(13):
        url = _data_url(448, 448, 500 + seed)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is this?"}]}]
        processed = timed("decode_and_slice", lambda u=url: llm.images.process([u]))
        text = timed("render_template", lambda m=messages: llm.tokenizer.apply_chat_template(
            m, enable_thinking=False))
        ids = timed("tokenize", lambda t=text, p=processed: llm.images.expand(t, p))
        inputs = timed("tower_and_keys", lambda i=ids, p=processed: llm.images.inputs(i, p))

        def first_token(i=ids, x=inputs, s=seed):
            llm.engine.add_request(f"b{s}", i, one, x)
            while llm.engine.has_work:
                llm.engine.step()

        timed("prefill_first_token", first_token)
    return {name: statistics.median(v[3:]) for name, v in stages.items()}


def _one_token_s(base: str, url: str) -> float:
    """Seconds for a whole non-streamed 1-token answer: prefill + first token as the client sees
    it (a streamed first chunk can come later when the first tokens decode to no text)."""
    body = {"model": "m", "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"}]}]}
    t0 = time.perf_counter()
    r = CLIENT.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
    return time.perf_counter() - t0


def _wait_ready(base: str, server, log, log_path: str) -> None:
    """Until /health answers 200 (the model loaded), or the server died / 300 s passed."""
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            log.flush()
            raise RuntimeError("the server did not come up:\n" + open(log_path).read()[-3000:])
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--out", default=None)
    p.add_argument("--breakdown", action="store_true", help="also time each stage in-process")
    args = p.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    log_path = os.path.join(os.path.dirname(os.path.abspath(args.out or ".")), "serve.log")
    log = open(log_path, "w")
    server = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--model", args.model,
                               "--device", args.device, "--dtype", args.dtype, "--port",
                               str(args.port), "--served-model-name", "m"], env=os.environ,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(base, server, log, log_path)
        results = {}
        for name, (h, w) in {"448x448": (448, 448), "5-slice 672x896": (672, 896)}.items():
            for seed in range(3):  # warm-up: kernels compiled, allocator sized
                _ttft_s(base, _data_url(h, w, 1000 + seed))
            runs = _timed_runs(base, h, w, args.requests)
            ttft = [r[0] * 1e3 for r in runs]
            server_ms = [r[3] * 1e3 for r in runs]
            results[name] = {"ttft_ms_median": statistics.median(ttft), "ttft_ms_min": min(ttft),
                             "ttft_ms_all": ttft, "e2e_ms_median": statistics.median(
                                 r[1] * 1e3 for r in runs), "prompt_tokens": runs[0][2],
                             # admission to first token inside the server; the rest of the
                             # client's TTFT is HTTP, image decode + slicing and the tower
                             "server_admit_to_first_token_ms_all": server_ms,
                             "server_admit_to_first_token_ms_median": statistics.median(server_ms),
                             "sm_clock_mhz_before": [r[4] for r in runs]}
            one = [_one_token_s(base, _data_url(h, w, 2000 + seed)) * 1e3
                   for seed in range(args.requests)]
            results[name]["one_token_response_ms_median"] = statistics.median(one)
            results[name]["one_token_response_ms_all"] = one
            print(name, f"1-token response median {statistics.median(one):.1f} ms", flush=True)
            print(name, f"TTFT median {results[name]['ttft_ms_median']:.1f} ms, "
                  f"min {min(ttft):.1f} ms, prompt {runs[0][2]} tokens; in the server, admission "
                  f"to first token {statistics.median(server_ms):.1f} ms", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.breakdown:
        results["breakdown_448_ms"] = _breakdown(args)
        print("breakdown 448x448 (ms, median):", results["breakdown_448_ms"], flush=True)
    from deltaserve.bench.record import device_info, git_commit

    record = {"kind": "vision-ttft-server", "git_commit": git_commit(),
              "device": device_info(args.device), "dtype": args.dtype, "model": args.model,
              "max_tokens": 8, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
