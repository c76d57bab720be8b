"""/metrics as Prometheus reads it: prometheus_client's own parser on a real server's answer,
every family with its help and type under vLLM's names, the key rule and OpenMetrics on request."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.server.app import build_app
from tests.server.helpers import app_server

KEY = "k-metrics"
PROMPT = {"prompt": "def parse(text):", "max_tokens": 6, "temperature": 0}
VLLM_NAMES = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
              "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
              "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
              "vllm:time_to_first_token_seconds": "histogram",
              "vllm:e2e_request_latency_seconds": "histogram"}


def _llm():
    from deltaserve import LLM

    return LLM(dtype="float32", max_model_len=256)


def test_metrics_parse_with_help_and_type_and_keep_the_key_rule() -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with app_server(build_app(_llm(), "m", api_key=KEY)) as base:
        assert httpx.get(f"{base}/metrics").status_code == 401  # the key guards it by default
        done = httpx.post(f"{base}/v1/completions", json=PROMPT, headers=auth, timeout=60).json()
        reply = httpx.get(f"{base}/metrics", headers=auth)
        assert reply.headers["content-type"].startswith("text/plain")
        text = reply.text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name, kind in VLLM_NAMES.items():
            assert families[name].type == kind, name
        for family in families.values():
            assert family.documentation, family.name  # every family has a # HELP line
        lines = text.splitlines()
        helps = {line.split()[2] for line in lines if line.startswith("# HELP ")}
        types = {line.split()[2] for line in lines if line.startswith("# TYPE ")}
        assert helps == types and "vllm:prompt_tokens_total" in types
        tokens = families["vllm:generation_tokens"].samples[0]
        assert tokens.labels == {"model_name": "m"}
        assert tokens.value == done["usage"]["completion_tokens"]
        ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples
                if s.name.endswith("_count")]
        assert ttft[0].value == 1
        finished = families["vllm:request_success"].samples
        assert [(s.labels["finished_reason"], s.value) for s in finished] == [("length", 1.0)]
        om = httpx.get(f"{base}/metrics", headers={**auth, "Accept":
                                                   "application/openmetrics-text; version=1.0.0"})
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")


def test_metrics_without_key_opens_only_metrics() -> None:
    with app_server(build_app(_llm(), "m", api_key=KEY, metrics_without_key=True)) as base:
        assert httpx.get(f"{base}/metrics").status_code == 200
        assert httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=60).status_code == 401
