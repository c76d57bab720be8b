"""`--speculative` on `deltaserve generate` and `serve`, and the spec_decode lines of /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from deltaserve.cli import main
from tests.server.helpers import running_server
from tests.spec.test_spec_engine import REPEAT


def _generate(capsys, *extra: str) -> dict:
    code = main(["generate", "--dtype", "bfloat16", "--temperature", "0", "--max-tokens", "24",
                 "--ignore-eos", "--json", "--prompt", REPEAT, *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out), out.err


def test_generate_speculative_ngram_same_tokens(capsys) -> None:
    plain, _ = _generate(capsys)
    spec, err = _generate(capsys, "--speculative", "ngram", "--num-speculative-tokens", "3")
    assert spec["token_ids"] == plain["token_ids"]
    stats = spec["speculative"]
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert "speculative" not in plain
    assert "Speculative (ngram, k=3)" in err


def test_bad_speculative_config_is_one_line(capsys) -> None:
    code = main(["generate", "--prompt", "x", "--speculative-config", '{"method": "eagle"}'])
    assert code == 1
    assert "speculative method must be one of ngram, mtp" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_metrics_count_drafts() -> None:
    with running_server("--speculative", "ngram", "--dtype", "bfloat16",
                        "--max-model-len", "512") as (base, _):
        body = {"model": "stdlib-19m", "prompt": REPEAT, "max_tokens": 24, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        metrics = {}
        for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
            if "spec_decode" in line and not line.startswith("#"):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                metrics[name] = value
    drafted = metrics["vllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < accepted <= drafted
    assert metrics["deltaserve:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted,
                                                                             abs=1e-5)
