"""One engine's measurements in a fresh process (so peak memory is its own): ours or transformers."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from deltaserve.progress import CHILD_STEP

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ticks = False  # on when this module runs as the worker process (main), not when imported


def tick(label: str) -> None:
    """A model loaded or a measurement done: a step of the parent's progress bar (bench/cpu.py)."""
    if _ticks:
        print(f"{CHILD_STEP} {label}", file=sys.stderr, flush=True)


def _median_s(fn, repeats: int, label: str = "") -> float:
    fn()  # warm-up: allocator, one-time weight preparation
    tick(f"{label} warm-up")
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        tick(f"{label} {i + 1}/{repeats}")
    return statistics.median(times)


def _ours(model_dir: Path, dtype: str, lens: list[int], decode_tokens: int, repeats: int,
          parallel: dict | None = None) -> dict:
    """parallel: LLM's pipeline_parallel_size / layer_split (tensor parallelism: the launch's)."""
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import SamplingParams

    # repeats must not hit a cache
    llm = LLM(model_dir, dtype=dtype, prefix_cache_bytes=0, **(parallel or {}))
    tick("model loaded")
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = min(llm.config.vocab_size, 248044)  # ordinary tokens (Qwen3.5's specials start there)
    for n in lens:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out[f"prefill_{n}_tok_s"] = n / _median_s(lambda ids=ids: llm.generate([ids], one), repeats,
                                                  f"prefill {n}")
    prompt = torch.randint(0, vocab, (16,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    rates = []
    for i in range(max(1, repeats - 1)):
        rates.append(llm.generate([prompt], params)[0].metrics["decode_tok_s"])
        tick(f"decode {i + 1}/{max(1, repeats - 1)}")
    out["decode_tok_s"] = statistics.median(rates)
    from deltaserve.bench.gpu import decode_bytes_per_token

    out["bytes_per_token"] = decode_bytes_per_token(llm.model)  # weights one decode token reads
    return out


def _ours_batch(model_dir: Path, dtype: str, batches: list[int], decode_tokens: int,
                device: str = "cpu", parallel: dict | None = None) -> dict:
    """Aggregate decode tok/s with B sequences decoding together (16-token random prompts, EOS
    ignored): timed from the step after every sequence has its first token to the last token."""
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import SamplingParams

    llm = LLM(model_dir, dtype=dtype, device=device, prefix_cache_bytes=0,
              max_num_seqs=max(batches), max_num_batched_tokens=max(2048, 16 * max(batches)),
              **(parallel or {}))
    tick("model loaded")
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    out = {}
    engine = llm.engine
    for b in batches:
        rounds = ("timed",) if device == "cpu" else ("warm-up", "timed")
        for rnd in rounds:  # a GPU warm-up round captures this batch's CUDA graphs
            for i in range(b):
                ids = torch.randint(0, llm.config.vocab_size, (16,), generator=gen).tolist()
                engine.add_request(f"{rnd}-b{b}-{i}", ids, params)
            engine.step()  # all prompts in one step (the budget covers them): every first token
            t0, produced = time.perf_counter(), 0
            while engine.has_work:
                produced += len(engine.step())
            dt = time.perf_counter() - t0
            tick(f"batch {b} {rnd}")
        out[f"batch_{b}_decode_tok_s"] = produced / dt
        out[f"batch_{b}_per_seq_tok_s"] = produced / dt / b
    if engine.runner.graphs is not None:  # GPU time of one decode step alone, per graph
        out["graph_replay_ms"] = _replay_ms(engine.runner.graphs.graphs)
    return out


def _replay_ms(graphs: dict) -> dict[str, float]:
    """Per captured (batch, KV width) graph: ms per replay, back to back (no host work between):
    the step's device time, to set against the measured step time (the rest is host work)."""
    out = {}
    for (bsz, width), (graph, _, _) in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        out[f"b{bsz}_w{width}"] = (time.perf_counter() - t0) / 20 * 1e3
    return out


def _transformers_batch(model_dir: Path, dtype: str, batches: list[int], decode_tokens: int,
                        device: str = "cpu") -> dict:
    from deltaserve.validate.reference import load_reference

    model = load_reference(model_dir, DTYPES[dtype]).to(device)
    tick("model loaded")
    gen = torch.Generator().manual_seed(1)
    out = {}
    with torch.inference_mode():
        for b in batches:
            ids = torch.randint(0, model.config.vocab_size, (b, 16), generator=gen).to(device)
            res = model(ids, use_cache=True, logits_to_keep=1)
            past, token = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(decode_tokens - 1):
                res = model(token, past_key_values=past, use_cache=True)
                past, token = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            if device != "cpu":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tick(f"batch {b}")
            out[f"batch_{b}_decode_tok_s"] = b * (decode_tokens - 1) / dt
            out[f"batch_{b}_per_seq_tok_s"] = (decode_tokens - 1) / dt
    return out


def _transformers(
    model_dir: Path, dtype: str, lens: list[int], decode_tokens: int, repeats: int,
    device: str = "cpu",
) -> dict:
    import transformers

    from deltaserve.validate.reference import load_reference

    model = load_reference(model_dir, DTYPES[dtype]).to(device)
    tick("model loaded")
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"version": transformers.__version__}
    with torch.inference_mode():
        for n in lens:
            ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)

            def prefill(ids=ids) -> None:
                model(ids, logits_to_keep=1)
                sync()

            out[f"prefill_{n}_tok_s"] = n / _median_s(prefill, repeats, f"prefill {n}")

        def decode() -> None:
            res = model(torch.randint(0, vocab, (1, 16), generator=gen).to(device), use_cache=True,
                        logits_to_keep=1)
            past, token = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(decode_tokens - 1):  # greedy with its cache, EOS ignored: its best case
                res = model(token, past_key_values=past, use_cache=True)
                past, token = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            sync()

        def prefill16() -> None:
            model(torch.randint(0, vocab, (1, 16)).to(device), logits_to_keep=1)
            sync()

        t_prefill16 = _median_s(prefill16, 1, "prefill 16")
        total = _median_s(decode, max(1, repeats - 1), "decode")
        out["decode_tok_s"] = (decode_tokens - 1) / max(total - t_prefill16, 1e-9)
    return out


def shared_prefix_ttft(model_dir: Path, dtype: str, prefix_len: int, device: str = "cpu",
                       repeats: int = 5) -> dict:
    """Time to first token of requests whose first `prefix_len` tokens (a shared system prompt)
    another request already ran, with the prefix cache on (hit) and off (miss): the same
    `repeats` prompts (one system prompt, different 40-token questions) both ways; medians."""
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out: dict = {"prefix_len": prefix_len, "repeats": repeats}
    for name, budget in (("miss", 0), ("hit", 4 << 30)):
        gen = torch.Generator().manual_seed(2)  # the same prompts for both runs
        llm = LLM(model_dir, dtype=dtype, device=device, prefix_cache_bytes=budget)
        tick("model loaded")
        vocab = llm.config.vocab_size
        warm = torch.randint(0, vocab, (prefix_len + 40,), generator=torch.Generator().manual_seed(9))
        llm.generate([warm.tolist()], one)  # first-use costs (allocator, kernels) out of the timing
        system = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
        llm.generate([system + [11, 12, 13]], one)  # the first user of the system prompt
        times = []
        for _ in range(repeats):
            question = torch.randint(0, vocab, (40,), generator=gen).tolist()
            t0 = time.perf_counter()
            llm.generate([system + question], one)
            times.append(time.perf_counter() - t0)
            tick(f"{name} {len(times)}/{repeats}")
        out[f"ttft_{name}_s"] = statistics.median(times)
        out[f"ttft_{name}_all_s"] = times
        del llm
    out["speedup"] = out["ttft_miss_s"] / out["ttft_hit_s"]
    return out


def main() -> None:
    global _ticks
    _ticks = True
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["ours", "transformers"])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lens", default="512,2048")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", default="", help="batch sizes: aggregate decode instead")
    p.add_argument("--shared-prefix", type=int, default=0, help="TTFT with a cached system prompt")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (the launch's ranks)")
    p.add_argument("--pp-layers", default="", help="layers per stage, e.g. 10,14")
    a = p.parse_args()
    lens = [int(x) for x in a.lens.split(",") if x]
    parallel = None
    if a.pp > 1:
        from deltaserve.distributed.pipeline import parse_split

        parallel = {"pipeline_parallel_size": a.pp, "layer_split": parse_split(a.pp_layers)}
    if a.shared_prefix:
        result = shared_prefix_ttft(Path(a.model_dir), a.dtype, a.shared_prefix)
    elif a.batch:
        batches = [int(x) for x in a.batch.split(",") if x]
        if a.engine == "ours":
            result = _ours_batch(Path(a.model_dir), a.dtype, batches, a.decode_tokens,
                                 parallel=parallel)
        else:
            result = _transformers_batch(Path(a.model_dir), a.dtype, batches, a.decode_tokens)
    elif a.engine == "ours":
        result = _ours(Path(a.model_dir), a.dtype, lens, a.decode_tokens, a.repeats, parallel)
    else:
        result = _transformers(Path(a.model_dir), a.dtype, lens, a.decode_tokens, a.repeats)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
