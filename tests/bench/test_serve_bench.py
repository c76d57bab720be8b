"""`deltaserve bench serve` against a real server process: the vLLM-style report, exact token
counts, the JSON record, and failures counted rather than hidden."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deltaserve.bench.request_stats import percentile
from tests.server.helpers import running_server

KEY = "bench-key"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve", "bench", "serve", *args],
                          capture_output=True, text=True, timeout=300)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile([], 99) == 0.0


def test_bench_serve_reports_like_vllm_and_counts_failures(tmp_path) -> None:
    with running_server("--api-key", KEY, "--dtype", "float32") as (base, _):
        run = _bench("--base-url", base, "--api-key", KEY, "--num-prompts", "6",
                     "--random-input-len", "40", "--random-output-len", "9",
                     "--max-concurrency", "3", "--metric-percentiles", "50,99",
                     "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", "r.json")
        assert run.returncode == 0, run.stderr
        for label in ("Serving Benchmark Result", "Successful requests:", "Mean TTFT (ms):",
                      "P99 TPOT (ms):", "Median ITL (ms):", "P50 E2EL (ms):"):
            assert label in run.stdout
        rec = json.loads((tmp_path / "r.json").read_text())
        assert rec["completed"] == 6 and rec["failed"] == 0
        assert rec["input_lens"] == [40] * 6 and rec["output_lens"] == [9] * 6
        assert rec["total_output_tokens"] == 54 and rec["total_input_tokens"] == 240
        assert all(0 < t < rec["duration_s"] for t in rec["ttfts_s"])
        assert all(1 <= len(gaps) <= 8 for gaps in rec["itls_s"])  # chunks after the first
        assert 0 < rec["median_ttft_ms"] <= rec["p99_ttft_ms"]
        assert rec["p99_e2el_ms"] >= rec["median_ttft_ms"]
        over = _bench("--base-url", base, "--api-key", KEY, "--num-prompts", "2",
                      "--random-input-len", "8", "--random-output-len", "9000")
        assert over.returncode == 1  # every request answered 400 (over the context): counted
        assert "Failed requests:                        2" in over.stdout
        assert "maximum context length" in over.stderr
        refused = _bench("--base-url", base, "--num-prompts", "2", "--random-input-len", "8",
                         "--random-output-len", "2", "--model", "stdlib-19m")
    assert refused.returncode == 1  # no key: the set-up call is refused, said plainly
    assert "401" in refused.stderr and "Traceback" not in refused.stderr
    gone = _bench("--base-url", base, "--num-prompts", "1")
    assert gone.returncode == 1 and "cannot reach" in gone.stderr
