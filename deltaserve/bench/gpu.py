"""`deltaserve bench --device cuda`: the GPU benchmark in one call, one JSON record.

Per format (bf16, int8, int4): decode at batch 1 through the engine (CUDA graphs) with the
bandwidth-roofline percentage beside it (weight bytes one token reads / time per token / the copy
bandwidth measured in the same run), and prefill tiers (2k ... 32k tokens, prefix cache off).
transformers (with fla when installed) is measured in the same run as the peer. GPU temperature and
clocks are read before and after every measurement: it waits for a start temperature and aborts
above a stop temperature; it never changes clocks or power settings.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaserve.errors import DeltaserveError
from deltaserve.progress import bar

SMI_FIELDS = "temperature.gpu,clocks.sm,clocks.mem,power.draw"


@dataclass(frozen=True, slots=True)
class Thermals:
    start_below_c: float = 60.0  # wait (up to wait_s) until the GPU is this cool before measuring
    stop_above_c: float = 85.0  # abort a run that finds the GPU hotter than this
    wait_s: float = 120.0


def gpu_state(run=subprocess.run) -> dict[str, float]:
    """Temperature (C), SM and memory clocks (MHz), power (W) of GPU 0, from nvidia-smi."""
    out = run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
              capture_output=True, text=True, timeout=10)
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    names = ("temp_c", "sm_mhz", "mem_mhz", "power_w")
    return {n: float(v) for n, v in zip(names, values, strict=False) if _is_number(v)}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def settle(thermals: Thermals, read=gpu_state, sleep=time.sleep) -> dict[str, float]:
    """Wait for the start temperature (or give up waiting after wait_s and say so in the state);
    refuse to measure above the stop temperature."""
    waited, state = 0.0, read()
    while state.get("temp_c", 0.0) > thermals.start_below_c and waited < thermals.wait_s:
        sleep(5.0)
        waited += 5.0
        state = read()
    if state.get("temp_c", 0.0) > thermals.stop_above_c:
        raise DeltaserveError(f"GPU at {state['temp_c']:.0f} C, above the stop temperature "
                              f"{thermals.stop_above_c:.0f} C: benchmark aborted")
    return {**state, "waited_s": waited}


def copy_bandwidth_gbs(device: torch.device, num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth (read + write) of a clone, median of 10."""
    big = torch.empty(num_bytes // 2, dtype=torch.int16, device=device)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        big.clone()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * num_bytes / sorted(times[2:])[len(times[2:]) // 2] / 1e9


def synced_ms(fn, calls: int) -> list[float]:
    """Wall milliseconds of each of `calls` fn() calls, the GPU synchronized before and after
    each (what a caller waits for, host work included)."""
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def cuda_median_s(fn, reps: int = 20) -> float:
    """Median seconds of fn() between CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_replay_s(calls) -> float:
    """Seconds per call, the calls replayed from one CUDA graph (no Python launch overhead)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return cuda_median_s(graph.replay) / len(calls)


def decode_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every linear (packed codes, scales, biases) and the
    head; embeddings read one row, norms and 1-D parameters are negligible."""
    total = 0
    tied = model.cfg.tie_word_embeddings
    for name, module in model.named_modules():
        if name.endswith("embed_tokens") and not tied:  # untied: decode reads one row of it
            continue
        if hasattr(module, "weight") and getattr(module.weight, "dim", lambda: 0)() == 2:
            total += sum(t.numel() * t.element_size()
                         for name, t in module.named_parameters(recurse=False))
    return total


def roofline_pct(tok_s: float, bytes_per_token: int, copy_gbs: float) -> float:
    return 100.0 * tok_s * bytes_per_token / (copy_gbs * 1e9)


def format_dirs(model_dir: Path, formats: list[str]) -> dict[str, Path]:
    """The checkpoint per format: bf16 is the given one; int8 / int4 are quantized to a temp dir."""
    from deltaserve.quant.convert import quantize_checkpoint

    out, work = {}, Path(tempfile.mkdtemp(prefix="deltaserve-bench-"))
    for fmt in formats:
        if fmt == "bf16":
            out[fmt] = model_dir
        else:
            quantize_checkpoint(model_dir, fmt, work / fmt)
            out[fmt] = work / fmt
    return out


def kv_dtype_decode(model_dir: Path, kv_dtypes: list[str], decode_tokens: int,
                    device: str) -> dict:
    """Batch-1 decode tok/s per KV cache dtype ("auto" = the activation dtype), bf16 activations."""
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    prompt = list(range(1000, 1016))
    out = {}
    for kv in kv_dtypes:
        llm = LLM(model_dir, dtype="bfloat16", device=device, prefix_cache_bytes=0,
                  max_num_seqs=4, kv_cache_dtype=kv)
        llm.generate([prompt], params)  # captures the graphs
        out[f"decode_kv_{kv}_tok_s"] = llm.generate([prompt], params)[0].metrics["decode_tok_s"]
        del llm
        torch.cuda.empty_cache()
    return out


def ours_on_gpu(model_dir: Path, lens: list[int], decode_tokens: int, device: str) -> dict:
    """Our engine, bf16 activations: prefill tiers (prefix cache off, one chunk up to 8k tokens),
    batch-1 decode (a warm-up run captures the CUDA graphs first) with its per-component
    attribution, and batch-1 decode again with the fused greedy head."""
    from deltaserve.bench.attribution import decode_attribution
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import SamplingParams
    from deltaserve.ops.gdn_prefill import GDN_PREFILL, case_at

    llm = LLM(model_dir, dtype="bfloat16", device=device, prefix_cache_bytes=0, max_num_seqs=4,
              max_num_batched_tokens=8192)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    scan = GDN_PREFILL.choose(case_at(8192, torch.bfloat16, llm.model.device, llm.config))
    out: dict = {"bytes_per_token": decode_bytes_per_token(llm.model), "prefill_scan": scan.name,
                 "weights_gb": sum(t.numel() * t.element_size() for t in
                                   (*llm.model.parameters(), *llm.model.buffers())) / 1e9,
                 "gpu_mem_after_load_gb": torch.cuda.memory_allocated() / 1e9}
    out.update(prefill_tiers(llm, lens, gen))
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    prompt = torch.randint(0, vocab, (16,), generator=gen).tolist()
    llm.generate([prompt], params)  # captures the batch-1 graphs
    out["decode_tok_s"] = llm.generate([prompt], params)[0].metrics["decode_tok_s"]
    out["decode_attribution"] = decode_attribution(llm)
    out["gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9  # peak: caches, prefill scratch
    del llm
    torch.cuda.empty_cache()
    greedy = LLM(model_dir, dtype="bfloat16", device=device, prefix_cache_bytes=0, max_num_seqs=4,
                 greedy_head=True)
    greedy.generate([prompt], params)
    out["decode_greedy_head_tok_s"] = greedy.generate([prompt], params)[0].metrics["decode_tok_s"]
    out["decode_greedy_head_attribution"] = decode_attribution(greedy)
    return out


PREFILL_REPEATS = 5


def prefill_tiers(llm, lens: list[int], gen: torch.Generator) -> dict:
    """tok/s per prompt length (a warm-up call, then the median of PREFILL_REPEATS calls), and the
    attribution of the 8k prefill."""
    from deltaserve.bench.attribution import profile_call
    from deltaserve.engine.sampling import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out: dict = {}
    for n in lens:
        if n >= llm.max_model_len:
            out[f"prefill_{n}_tok_s"] = None  # beyond this checkpoint's context
            continue
        ids = torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist()
        llm.generate([ids], one)  # warm-up: kernels for these shapes
        # the median: one call may still meet rising clocks
        runs_ms = synced_ms(lambda ids=ids: llm.generate([ids], one), PREFILL_REPEATS)
        out[f"prefill_{n}_tok_s"] = n / statistics.median(runs_ms) * 1e3
        out[f"prefill_{n}_runs_tok_s"] = [round(n / t * 1e3) for t in runs_ms]
        if n == 8192:  # where a long prefill's time goes (the profiler's own overhead included)
            out["prefill_8192_attribution"] = profile_call(lambda ids=ids: llm.generate([ids], one))
    return out


def run_gpu_bench(args, model_dir: Path, record: dict) -> dict:
    """Fills record["engines"] per format and the peer; returns the record."""
    import importlib.util

    from deltaserve.bench.worker import _transformers

    device = torch.device(args.device)
    lens = [int(x) for x in args.prefill_lens.split(",") if x]
    thermals = Thermals(args.start_temp, args.stop_temp)
    record["copy_gbs"] = copy_bandwidth_gbs(device)
    record["fla_installed"] = importlib.util.find_spec("fla") is not None
    engines = {}
    dirs = format_dirs(model_dir, args.formats.split(","))
    shown = bar(len(dirs) + (args.peer == "transformers"), "bench", "engine")
    for fmt, path in dirs.items():
        shown.set_postfix_str(fmt)
        before = settle(thermals)
        result = ours_on_gpu(path, lens if fmt == "bf16" else [], args.decode_tokens, args.device)
        result["roofline_pct"] = roofline_pct(result["decode_tok_s"], result["bytes_per_token"],
                                              record["copy_gbs"])
        kv_dtypes = [k for k in getattr(args, "kv_cache_dtypes", "auto").split(",") if k]
        if fmt == args.formats.split(",")[0] and kv_dtypes != ["auto"]:
            result.update(kv_dtype_decode(path, kv_dtypes, args.decode_tokens, args.device))
        engines[f"deltaserve-{fmt}"] = {**result, "gpu_before": before, "gpu_after": gpu_state()}
        torch.cuda.empty_cache()
        shown.update(1)
    if args.peer == "transformers":
        shown.set_postfix_str("transformers")
        before = settle(thermals)
        peer = _transformers(model_dir, "bfloat16", lens, args.decode_tokens, 2, args.device)
        engines["transformers"] = {**peer, "gpu_before": before, "gpu_after": gpu_state()}
        shown.update(1)
    shown.close()
    record["engines"] = engines
    return record
