"""/metrics: Prometheus text under vLLM's metric names (ours where vLLM has none or means
otherwise)."""

from __future__ import annotations


def metrics_text(host, name: str) -> str:
    """Prometheus text under vLLM's metric names (ours where vLLM has none or means otherwise)."""
    c, llm, driver = host.counters, host.llm, host.driver
    label = f'{{model_name="{name}"}}'
    running = waiting = num_open = 0
    kv_used = 0.0
    engine = host.engine_totals()
    if llm is not None:
        sched, usage = llm.engine.scheduler, llm.engine.cache.usage()
        running, waiting, num_open = sched.num_running, sched.num_waiting, driver.num_open
        kv_used = 1.0 - usage["blocks_free"] / max(1, usage["blocks_total"])
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
