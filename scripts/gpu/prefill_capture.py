"""H200, issue 6: how fast is a long prefill chunk without its host work? An experiment, not a path.

    python3 scripts/gpu/prefill_capture.py --model /tmp/q08 --lens 2048,8192 --out capture.json

The 8k prefill is host-bound (profiled: 32 ms of kernels in 68 ms of wall time, ~680 launches,
most of the gaps in fla's stage wrappers and small torch ops). This records the model's
forward_batch for one fresh prompt of each length as the engine calls it (bf16, prefix cache off,
one chunk), then times that same call eagerly and replayed from a CUDA graph, and checks that the
replay gives the eager logits. If the capture fails (a host sync, a CPU-side decision inside
fla), the error is the result. The answer says whether whole-chunk graphs (bucketed lengths, padding
rows with neutral gates, as the short-prefill graphs do) could reach issue 6's 250k tok/s at 8k.
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.bench.gpu import synced_ms  # noqa: E402
from deltaserve.env import env  # noqa: E402


def _recorded_call(llm: LLM, ids: list[int]) -> tuple:
    """(ids_t, batch, kwargs) of the forward_batch call that prefills `ids`."""
    model, seen = llm.model, []
    real = model.forward_batch

    def spy(ids_t, batch, **kw):
        if len(ids_t) == len(ids) and not seen:
            seen.append((ids_t, batch, kw))
        return real(ids_t, batch, **kw)

    model.forward_batch = spy
    try:
        llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    finally:
        model.forward_batch = real
    if not seen:
        raise RuntimeError(f"no single {len(ids)}-token forward_batch call was seen")
    return seen[0]


def measure(llm: LLM, n: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist()
    ids_t, batch, kw = _recorded_call(llm, ids)
    forward = llm.model.forward_batch
    eager_out = forward(ids_t, batch, **kw).clone()
    eager_ms = synced_ms(lambda: forward(ids_t, batch, **kw), repeats)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    generate_ms = synced_ms(lambda: llm.generate([ids], one), repeats)  # the engine around it
    row = {"tokens": n, "eager_ms": eager_ms, "eager_tok_s": n / statistics.median(eager_ms) * 1e3,
           "generate_ms": generate_ms, "generate_median_ms": statistics.median(generate_ms)}
    try:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward(ids_t, batch, **kw)  # warm-up off the default stream, as capture wants
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = forward(ids_t, batch, **kw)
    except Exception as exc:  # the experiment's answer: what stops a capture
        row["capture_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return row
    graph.replay()
    torch.cuda.synchronize()
    diff = (captured.float() - eager_out.float()).norm() / eager_out.float().norm()
    replay_ms = synced_ms(graph.replay, repeats)
    row.update({"replay_ms": replay_ms, "replay_tok_s": n / statistics.median(replay_ms) * 1e3,
                "replay_vs_eager_rel": diff.item(), "replay_equal": torch.equal(captured, eager_out)})
    del graph
    return row


def why(llm: LLM, n: int) -> dict:
    """Where a generate() of n tokens waits: the first synchronizing op inside forward_batch (sync
    debug mode "error", its stack), and cProfile's top functions of one generate call."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist()
    ids_t, batch, kw = _recorded_call(llm, ids)
    torch.cuda.synchronize()
    out: dict = {"tokens": n}
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.model.forward_batch(ids_t, batch, **kw)
        out["first_sync"] = None
    except RuntimeError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        out["first_sync"] = {"error": str(exc)[:200], "stack": [
            f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-8:]]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([ids], one)
    prof.disable()
    out["generate_ms"] = (time.perf_counter() - t0) * 1e3
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    out["profile"] = text.getvalue().splitlines()[-40:]
    return out


def kernels(llm: LLM, n: int) -> dict:
    """The eager forward of one fresh n-token chunk under torch.profiler: every kernel name with
    its count and total microseconds, busiest first (what a whole-chunk graph would still pay)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist()
    ids_t, batch, kw = _recorded_call(llm, ids)
    llm.model.forward_batch(ids_t, batch, **kw)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.model.forward_batch(ids_t, batch, **kw)
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table.setdefault(e.name[:150], [0, 0.0])
            row[0] += 1
            row[1] += e.time_range.elapsed_us()
    ranked = sorted(table.items(), key=lambda kv: -kv[1][1])
    return {"tokens": n, "busy_us": sum(v[1] for _, v in ranked),
            "kernels": [[name, int(c), round(us, 1)] for name, (c, us) in ranked[:45]]}


def prefix_on(model: str, lens: list[int], repeats: int, snapshots: str,
              chunk: int | None) -> list[dict]:
    """generate() of fresh prompts (new random ids each call: no prefix hits) with the prefix
    cache on, as users run it (`snapshots`: LLM(prefix_snapshots=); `chunk`:
    max_num_batched_tokens, None = LLM's default): median ms per length."""
    llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=4, max_num_batched_tokens=chunk,
              prefix_snapshots=snapshots)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for n in lens:
        gen = torch.Generator().manual_seed(n)
        prompts = [torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist()
                   for _ in range(repeats + 1)]
        llm.generate([prompts[0]], one)  # warm-up (captures a graph where one is taken)
        fresh = iter(prompts[1:])  # a new prompt per call
        runs = synced_ms(lambda fresh=fresh: llm.generate([next(fresh)], one), repeats)
        rows.append({"tokens": n, "prefix_cache": True, "snapshots": snapshots,
                     "max_num_batched_tokens": llm.engine.scheduler.config.max_num_batched_tokens,
                     "generate_ms": runs,
                     "tok_s": n / statistics.median(runs) * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--why", action="store_true", help="the first sync and a cProfile, not timings")
    ap.add_argument("--kernels", action="store_true", help="the eager forward's kernel table")
    ap.add_argument("--prefix-on", action="store_true",
                    help="generate() of fresh prompts with the prefix cache on, nothing else")
    ap.add_argument("--snapshots", default="sparse", choices=("sparse", "grid"),
                    help="with --prefix-on: LLM(prefix_snapshots=)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="with --prefix-on: LLM(max_num_batched_tokens=), default LLM's")
    args = ap.parse_args()
    if args.prefix_on:
        rows = prefix_on(args.model, [int(v) for v in args.lens.split(",")], args.repeats,
                         args.snapshots, args.chunk)
        for row in rows:
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}))
        Path(args.out).write_text(json.dumps({"kind": "h200-prefill-prefix-on", "rows": rows,
                                              "git_commit": env().git_commit}, indent=1))
        return
    llm = LLM(args.model, dtype="bfloat16", device="cuda", prefix_cache_bytes=0, max_num_seqs=4,
              max_num_batched_tokens=8192)
    rows = []
    for n in (int(v) for v in args.lens.split(",")):
        row = why(llm, n) if args.why else kernels(llm, n) if args.kernels else \
            measure(llm, n, args.repeats)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}), flush=True)
        for name, count, us in row.get("kernels", []):
            print(f"{us:9.1f} us {count:4d}x  {name[:120]}")
        for line in row.get("profile", []):
            print(line[:160])
    record = {"kind": "h200-prefill-capture", "git_commit": env().git_commit,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
