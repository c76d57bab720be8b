"""/metrics: Prometheus exposition through prometheus_client under vLLM's metric names (ours where
vLLM has none or means otherwise), each with its # HELP and # TYPE. Read at scrape time from gauges
the engine thread publishes after each step: the event loop never reads the engine's own
structures while that thread changes them."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder

COUNTS = ("preemptions", "prefix_hits", "prefix_misses", "spec_drafts", "spec_draft_tokens",
          "spec_accepted_tokens")

# (name, help, type, what it reads): counters are named without _total (prometheus_client adds it)
_SCALARS = (
    ("vllm:num_requests_running", "Requests in the running batch.", "gauge", "running"),
    ("vllm:num_requests_waiting", "Requests waiting to be admitted.", "gauge", "waiting"),
    ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "gauge",
     "kv_used"),
    ("vllm:prompt_tokens", "Prompt tokens of finished and running requests.", "counter",
     "prompt_tokens"),
    ("vllm:generation_tokens", "Tokens generated.", "counter", "generation_tokens"),
    ("vllm:num_preemptions", "Requests preempted (their state dropped and recomputed).",
     "counter", "preemptions"),
    # lookups, not tokens (vLLM's prefix_cache_* count tokens): a hit restores a state snapshot
    ("deltaserve:prefix_cache_hits", "Prefix-cache lookups that restored a state snapshot.",
     "counter", "prefix_hits"),
    ("deltaserve:prefix_cache_misses", "Prefix-cache lookups that found no snapshot.", "counter",
     "prefix_misses"),
    ("deltaserve:model_loaded", "1 while the model is loaded and serving, else 0.", "gauge",
     "loaded"),
    ("deltaserve:model_loads", "Model loads (the first and each reload after idle unload).",
     "counter", "loads"),
    ("deltaserve:engine_restarts", "Engines rebuilt after their step loop failed.", "counter",
     "restarts"),
    ("deltaserve:requests_open", "Requests the server holds open (streams and waits).", "gauge",
     "open"),
    ("deltaserve:requests_aborted", "Requests ended by the client (disconnect) or the server.",
     "counter", "aborted"),
    ("deltaserve:engine_steps", "Engine steps run.", "counter", "steps"),
    ("vllm:spec_decode_num_drafts", "Speculative verify steps.", "counter", "spec_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Tokens drafted for verification.", "counter",
     "spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", "counter",
     "spec_accepted_tokens"),
    ("deltaserve:spec_decode_acceptance_rate", "Accepted over drafted tokens since start.",
     "gauge", "acceptance"),
)
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Time from admission to the first token.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Time between a request's consecutive tokens.", "itl"),
    ("vllm:request_decode_time_seconds", "Time from a request's first token to its last.",
     "decode"),
    ("vllm:e2e_request_latency_seconds", "Time from admission to the last token.", "e2e"),
)


@dataclass(frozen=True, slots=True)
class Gauges:
    """One step's view of the engine, immutable once published (bridge.EngineDriver.gauges)."""

    running: int = 0
    waiting: int = 0
    kv_used: float = 0.0  # the fraction of KV blocks not free
    counts: tuple[int, ...] = (0,) * len(COUNTS)  # COUNTS' totals for this engine


def gauges_of(engine) -> Gauges:
    """On the engine thread (or before it starts): O(1) reads, cheap enough for every step."""
    prefix, spec = engine.cache.prefix, engine.spec.stats if engine.spec is not None else None
    kv = engine.cache.kv
    counts = (engine.scheduler.num_preemptions_total,
              prefix.hits if prefix is not None else 0, prefix.misses if prefix is not None else 0,
              spec.num_drafts if spec else 0, spec.num_draft_tokens if spec else 0,
              spec.num_accepted_tokens if spec else 0)
    return Gauges(engine.scheduler.num_running, engine.scheduler.num_waiting,
                  1.0 - kv.num_free / max(1, engine.cache.config.num_blocks), counts)


class _HostCollector:
    """prometheus_client's custom-collector form: families built from one snapshot per scrape."""

    def __init__(self, host, name: str) -> None:
        self.host, self.name = host, name

    def collect(self):
        values, counters = _values(self.host), self.host.counters
        for metric, text, kind, key in _SCALARS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                metric, text, labels=["model_name"])
            family.add_metric([self.name], values[key])
            yield family
        for metric, text, key in _HISTOGRAMS:
            hist = getattr(counters, key)
            family = HistogramMetricFamily(metric, text, labels=["model_name"])
            # counts are cumulative already (bridge.Histogram.observe)
            buckets = [(repr(float(b)), c) for b, c in zip(hist.buckets, hist.counts, strict=True)]
            family.add_metric([self.name], [*buckets, ("+Inf", hist.count)], hist.total)
            yield family
        finished = CounterMetricFamily("vllm:request_success", "Requests finished, by reason.",
                                       labels=["model_name", "finished_reason"])
        for reason, count in sorted(counters.finished.items()):
            finished.add_metric([self.name, reason], count)
        yield finished


def _values(host) -> dict[str, float]:
    c, llm, driver = host.counters, host.llm, host.driver
    live = llm is not None and driver is not None
    gauges = driver.gauges if live else Gauges()
    engine = host.engine_totals()
    return {"running": gauges.running, "waiting": gauges.waiting, "kv_used": gauges.kv_used,
            "prompt_tokens": c.prompt_tokens, "generation_tokens": c.generation_tokens,
            "loaded": int(host.state == "ready"), "loads": host.num_loads,
            "restarts": host.num_restarts, "open": driver.num_open if live else 0,
            "aborted": c.aborted, "steps": c.num_steps,
            "acceptance": engine["spec_accepted_tokens"] / max(1, engine["spec_draft_tokens"]),
            **engine}


def registry(host, name: str) -> CollectorRegistry:
    """The app's own registry (not the process-global one: two apps in a process stay apart)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_HostCollector(host, name))
    return reg


def exposition(reg: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """(body, content type): the Prometheus text format, or OpenMetrics when the scraper asks."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(reg), content_type
