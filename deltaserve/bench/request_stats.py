"""Per-request client measurements to the figures `vllm bench serve` reports: counts, throughputs,
and mean / median / std / percentiles in ms of TTFT, TPOT, ITL and E2EL (same definitions: TPOT is
(E2EL - TTFT) / (output tokens - 1) over requests with more than one token; ITL pools every gap
between content chunks of every request)."""

from __future__ import annotations

import statistics

# words for random prompts: common, short, mostly one token each in a BPE vocabulary
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when "
         "what will more if no out so said can who up into about them than some time could "
         "these two may then do first any my now such like our over only new other also very "
         "after most made year work back well way even because good each those people state "
         "water house world school system number part place small city day week light hand "
         "river paper table music market engine signal model value field order point line").split()


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _describe(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def summarize(outcomes, duration_s: float, metrics: list[str],
              percentiles: list[float]) -> dict[str, float]:
    done = [o for o in outcomes if o.ok]
    total_in = sum(o.input_len for o in done)
    total_out = sum(o.output_len for o in done)
    series = {
        "ttft": [o.ttft_s for o in done],
        "tpot": [(o.e2el_s - o.ttft_s) / (o.output_len - 1) for o in done if o.output_len > 1],
        "itl": [gap for o in done for gap in o.itl_s],
        "e2el": [o.e2el_s for o in done],
    }
    out = {"completed": len(done), "failed": len(outcomes) - len(done),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": len(done) / duration_s,
           "output_throughput": total_out / duration_s,
           "total_token_throughput": (total_in + total_out) / duration_s}
    for name in metrics:
        out.update(_describe(name, series[name], percentiles))
    return out
