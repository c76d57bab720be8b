"""`deltaserve bench`: prefill and decode tokens/s plus peak memory, ours and transformers in one run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from deltaserve.bench.record import checkpoint_fingerprint, device_info, flags, git_commit
from deltaserve.errors import DeltaserveError

GPU_TIERS = "2048,5120,8192,10240,32768"


def _worker(engine: str, model_dir: Path, args: argparse.Namespace) -> dict:
    batch, shared = getattr(args, "batch", None), getattr(args, "shared_prefix", 0)
    cmd = [
        sys.executable,
        "-m",
        "deltaserve.bench.worker",
        engine,
        str(model_dir),
        "--dtype",
        args.dtype,
        "--lens",
        args.prefill_lens,
        "--decode-tokens",
        str(args.decode_tokens),
        "--repeats",
        str(args.repeats),
        "--batch",
        batch or "",
        "--shared-prefix",
        str(shared or 0),
    ]
    from deltaserve.distributed.cli import ranks_of

    ranks, pp = ranks_of(args), getattr(args, "pp", 1)
    if engine == "ours" and pp > 1:
        cmd += ["--pp", str(pp), "--pp-layers", getattr(args, "pp_layers", None) or ""]
    if engine == "ours" and ranks > 1:  # the worker as tp/pp ranks (its LLM joins their group)
        from deltaserve.distributed.launch import run_ranks

        code, stdout, stderr = run_ranks(cmd, ranks, "cpu", capture=True)
    else:
        code, stdout, stderr = _shown_run(cmd, engine)
    if code != 0:
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        raise DeltaserveError(f"benchmark of {engine} failed: {tail[0]}")
    return json.loads(stdout)


def _shown_run(cmd: list[str], engine: str) -> tuple[int, str, str]:
    """Run a worker, its measurements shown as a progress bar (progress.CHILD_STEP lines on its
    stderr); (exit code, stdout, the rest of stderr)."""
    from deltaserve.progress import CHILD_STEP, bar

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()
    rest = []
    with bar(None, f"bench {engine}", "step") as shown:
        for line in proc.stderr:
            if line.startswith(CHILD_STEP):
                shown.set_postfix_str(line[len(CHILD_STEP):].strip(), refresh=False)
                shown.update(1)
            else:
                rest.append(line)
    reader.join()
    return proc.wait(), "".join(stdout), "".join(rest)


def run_bench(args: argparse.Namespace) -> int:
    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir

    model_dir = default_model_dir() if args.model is None else resolve_model_dir(args.model)
    if args.dtype == "auto":  # the checkpoint's own dtype (float32 for a quantized GGUF)
        from deltaserve.checkpoint.loader import resolve_dtype
        from deltaserve.checkpoint.reader import read_config

        args.dtype = str(resolve_dtype("auto", read_config(model_dir))).removeprefix("torch.")
    if getattr(args, "prefill_lens", None) is None:
        args.prefill_lens = "512,2048" if args.device == "cpu" else GPU_TIERS
    if getattr(args, "tp", 1) != 1 or getattr(args, "pp", 1) != 1:
        from deltaserve.distributed.cli import check_pp_split, check_split, ranks_of

        ranks_of(args)  # refuses --tp with --pp
        if args.device != "cpu":
            raise DeltaserveError("bench --tp/--pp runs on cpu; on GPUs use "
                                  "scripts/gpu/tp_bench.py")
        if getattr(args, "pp", 1) != 1:
            if getattr(args, "shared_prefix", 0):
                raise DeltaserveError("bench --shared-prefix needs the prefix cache, which is off "
                                      "under --pp")
            check_pp_split(model_dir, args.pp, args.pp_layers)
        else:
            check_split(model_dir, args.tp)
    if args.device != "cpu":
        return _gpu(args, model_dir)
    dtype = args.dtype
    print(
        f"bench: {model_dir} {dtype} prefill {args.prefill_lens}, decode {args.decode_tokens} tokens",
        file=sys.stderr,
    )
    if args.peer == "transformers" and importlib.util.find_spec("transformers") is None:
        raise DeltaserveError(
            "the peer needs transformers: pip install 'deltaserve[validate]' (or pass --peer none)"
        )
    engines = {"deltaserve": _worker("ours", model_dir, args)}
    ours, read_gbs = engines["deltaserve"], None
    if "bytes_per_token" in ours:  # the share of the memory roofline decode reaches
        read_gbs = read_bandwidth_gbs()  # after the worker: nothing else runs
        ours["roofline_pct"] = 100.0 * ours["decode_tok_s"] * ours["bytes_per_token"] / (
            read_gbs * 1e9)
    if args.peer == "transformers" and not getattr(args, "shared_prefix", 0):
        engines["transformers"] = _worker("transformers", model_dir, args)
    record = _header("cpu-bench", args, model_dir)
    record["dtype"] = dtype
    record["memory_read_gbs"] = read_gbs
    record["workload"].update(repeats=args.repeats, batch=getattr(args, "batch", None),
                              shared_prefix=getattr(args, "shared_prefix", 0) or None,
                              tensor_parallel=getattr(args, "tp", 1),
                              pipeline_parallel=getattr(args, "pp", 1),
                              pp_layers=getattr(args, "pp_layers", None))
    record["engines"] = engines
    return _emit(record, args)


def read_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """This machine's streaming read rate: an fp32 sum over 1 GiB on torch's threads (median of
    5 after a warm-up), the bound a decode step that reads every weight once can approach."""
    import torch

    x = torch.ones(num_bytes // 4)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return num_bytes / sorted(times)[2] / 1e9


def _header(kind: str, args: argparse.Namespace, model_dir: Path) -> dict:
    """What every bench record carries: commit, checkpoint, device, flags, the common workload."""
    return {"kind": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
            "model_dir": str(model_dir), "checkpoint_fingerprint": checkpoint_fingerprint(model_dir),
            "device": device_info(args.device), "flags": flags(),
            "workload": {"prefill_lens": args.prefill_lens, "decode_tokens": args.decode_tokens,
                         "decode_prompt_len": 16, "eos": "ignored"}}


def _emit(record: dict, args: argparse.Namespace) -> int:
    _print_table(record["engines"])
    text = json.dumps(record, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _gpu(args: argparse.Namespace, model_dir: Path) -> int:
    import torch

    from deltaserve.bench.gpu import run_gpu_bench

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        raise DeltaserveError(f"--device {args.device}: no CUDA GPU here (the benchmark runs on cpu "
                              "or cuda)")
    record = _header("gpu-bench", args, model_dir)
    record["workload"]["formats"] = args.formats
    run_gpu_bench(args, model_dir, record)
    return _emit(record, args)


def _print_table(engines: dict[str, dict]) -> None:
    suffixes = ("tok_s", "_gb", "_s", "up", "_pct")
    keys = [k for k in next(iter(engines.values())) if k.endswith(suffixes)]
    print(f"{'metric':<22}" + "".join(f"{e:>18}" for e in engines), file=sys.stderr)
    for k in keys:
        cells = [engines[e].get(k) for e in engines]
        print(f"{k:<22}" + "".join(f"{c:>18.2f}" if isinstance(c, int | float) else f"{'-':>18}"
                                   for c in cells), file=sys.stderr)
    if "transformers" in engines and "deltaserve" in engines:
        for k in keys:
            ours, peer = engines["deltaserve"].get(k), engines["transformers"].get(k)
            if k.endswith("tok_s") and ours and peer:
                print(f"speed-up {k}: {ours / peer:.2f}x", file=sys.stderr)
