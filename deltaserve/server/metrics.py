"""/metrics: Prometheus text under vLLM's metric names (ours where vLLM has none or means
otherwise), from gauges the engine thread publishes after each step: the event loop never reads
the engine's own structures while that thread changes them."""

from __future__ import annotations

from dataclasses import dataclass

COUNTS = ("preemptions", "prefix_hits", "prefix_misses", "spec_drafts", "spec_draft_tokens",
          "spec_accepted_tokens")


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


def metrics_text(host, name: str) -> str:
    """Prometheus text under vLLM's metric names (ours where vLLM has none or means otherwise)."""
    c, llm, driver = host.counters, host.llm, host.driver
    label = f'{{model_name="{name}"}}'
    gauges = driver.gauges if llm is not None and driver is not None else Gauges()
    running, waiting, kv_used = gauges.running, gauges.waiting, gauges.kv_used
    num_open = driver.num_open if llm is not None and driver is not None else 0
    engine = host.engine_totals()
    lines = [
        f"vllm:num_requests_running{label} {running}",
        f"vllm:num_requests_waiting{label} {waiting}",
        f"vllm:kv_cache_usage_perc{label} {kv_used:.6f}",
        f"vllm:prompt_tokens_total{label} {c.prompt_tokens}",
        f"vllm:generation_tokens_total{label} {c.generation_tokens}",
        f"vllm:num_preemptions_total{label} {engine['preemptions']}",
        # lookups, not tokens (vLLM's prefix_cache_* count tokens): a hit restores a snapshot
        f"deltaserve:prefix_cache_hits_total{label} {engine['prefix_hits']}",
        f"deltaserve:prefix_cache_misses_total{label} {engine['prefix_misses']}",
        f"deltaserve:model_loaded{label} {int(host.state == 'ready')}",
        f"deltaserve:model_loads_total{label} {host.num_loads}",
        f"deltaserve:engine_restarts_total{label} {host.num_restarts}",
        f"deltaserve:requests_open{label} {num_open}",
        f"deltaserve:requests_aborted_total{label} {c.aborted}",
        f"deltaserve:engine_steps_total{label} {c.num_steps}",
        # speculative decoding (spec/): verify steps, drafted and accepted tokens (vLLM's names)
        f"vllm:spec_decode_num_drafts_total{label} {engine['spec_drafts']}",
        f"vllm:spec_decode_num_draft_tokens_total{label} {engine['spec_draft_tokens']}",
        f"vllm:spec_decode_num_accepted_tokens_total{label} {engine['spec_accepted_tokens']}",
        f"deltaserve:spec_decode_acceptance_rate{label} "
        f"{engine['spec_accepted_tokens'] / max(1, engine['spec_draft_tokens']):.6f}",
    ]
    labels = f'model_name="{name}"'
    for metric, hist in (("vllm:time_to_first_token_seconds", c.ttft),
                         ("vllm:inter_token_latency_seconds", c.itl),
                         ("vllm:request_decode_time_seconds", c.decode),
                         ("vllm:e2e_request_latency_seconds", c.e2e)):
        lines.extend(hist.lines(metric, labels))
    for reason, count in sorted(c.finished.items()):
        lines.append(f'vllm:request_success_total{{model_name="{name}",finished_reason='
                     f'"{reason}"}} {count}')
    return "\n".join(lines) + "\n"
