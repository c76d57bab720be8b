"""Minutes-long reliability soak of `deltaserve serve` (issue 31): rounds of deltaserve/bench/soak.py's
mixed clients against a real server process, the server's RSS after each round, then the server
checked (open requests 0, no restart, greedy output unchanged). Writes a JSON record.

python scripts/server/soak.py --minutes 5 [--concurrency 16] [--round 240] [--out soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

from deltaserve.bench.record import device_info, git_commit
from deltaserve.bench.soak import metric, soak

MODEL = "stdlib-19m"
GREEDY = {"model": MODEL, "prompt": "import os\n", "max_tokens": 16, "temperature": 0}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _start(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve", "serve", "--port", str(port),
                             "--dtype", args.dtype, "--max-model-len", "512"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--round", type=int, default=240, help="requests per round")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args()
    proc, base = _start(args)
    try:
        greedy = httpx.post(f"{base}/v1/completions", json=GREEDY, timeout=60).json()
        rounds, rss, end = [], [_rss_mb(proc.pid)], time.monotonic() + 60 * args.minutes
        while time.monotonic() < end:
            rounds.append(asyncio.run(soak(base, MODEL, args.round, args.concurrency,
                                           seed=len(rounds))))
            rss.append(_rss_mb(proc.pid))
            print(f"round {len(rounds)}: {rounds[-1]['seconds']} s, lost {rounds[-1]['lost']}, "
                  f"5xx {rounds[-1]['server_errors']}, rss {rss[-1]:.0f} MB", flush=True)
        time.sleep(1)
        after = httpx.post(f"{base}/v1/completions", json=GREEDY, timeout=60).json()
        record = {
            "kind": "soak", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "git_commit": git_commit(), "device": device_info("cpu"), "dtype": args.dtype,
            "flags": {"threads": os.environ.get("DELTASERVE_NUM_THREADS", "")},
            "rounds": len(rounds), "requests": sum(r["requests"] for r in rounds),
            "concurrency": args.concurrency,
            "server_errors": sum(r["server_errors"] for r in rounds),
            "lost": sum(r["lost"] for r in rounds),
            "open_after": metric(base, "deltaserve:requests_open"),
            "restarts": metric(base, "deltaserve:engine_restarts_total"),
            "aborted": metric(base, "deltaserve:requests_aborted_total"),
            "greedy_unchanged": after["choices"][0]["text"] == greedy["choices"][0]["text"],
            # the first round warms the allocator; drift is measured from its end
            "rss_mb": [round(x, 1) for x in rss], "rss_drift_mb": round(rss[-1] - rss[1], 1),
            "round_seconds": [r["seconds"] for r in rounds],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: v for k, v in record.items() if k not in ("rss_mb", "round_seconds",
                                                                  "device")}))


if __name__ == "__main__":
    main()
