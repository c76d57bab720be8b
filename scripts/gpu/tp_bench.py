"""2x H200: tensor parallelism TP=2 against TP=1 on the 2B shape (bf16) and the 27B shape (int4),
speed and quality in one JSON; with --pp, pipeline parallelism PP=2 (layer split) beside them.

    DELTASERVE_GIT_COMMIT=<sha> python3 scripts/gpu/tp_bench.py --out $OUT/tp_bench.json --pp
    python3 scripts/gpu/tp_bench.py --out /tmp/t.json --models tiny --device cpu --pp  # smoke

PP=2 (--pp-layers for an uneven split, default even): each rank runs its layers while the other
waits (no micro-batches) and decodes eagerly (no CUDA graphs under PP), so it is expected to trail
TP=1 by the hand-offs (hidden states [T, N] one way, the step's logits broadcast back).

Per model and TP size (each a fresh launch: 1 process, or 2 NCCL ranks, one GPU each): decode
tok/s at batch 1 and 32 (16-token random prompts, EOS ignored, CUDA graphs), prefill tok/s at 2k
and 8k (median of 3 after a warm-up), greedy tokens of 3 prompts (TP=2 vs TP=1: agreement and first
divergence; bf16 reductions round differently, so a late divergence is possible), and at TP=2 the
gate of fp16-compressed FFN reductions against exact ones (2 gate prompts) with its counters.
The 27B int4 checkpoint is written directly in our quantized format (random 4-bit codes, scales
for a weight std of 0.02): ~15 GB in about a minute, where make-checkpoint + quantize would write
55 GB of bf16 first and read it back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.record import device_info, flags, git_commit  # noqa: E402
from deltaserve.cache.sequence import prompt_logits
from deltaserve.distributed.launch import spawn  # noqa: E402

GREEDY_PROMPTS, GREEDY_TOKENS = 3, 32


def write_int4(name: str, out: Path, seed: int = 0) -> Path:
    """A text-only synthetic checkpoint of preset `name` with every 2-D weight as affine 4-bit
    group-64 codes (fp16 scales/biases, our `quantize` layout); the rest as make-checkpoint."""
    from safetensors.torch import save_file

    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.synthetic import preset_specs
    from deltaserve.checkpoint.writer import init_tensor, write_tokenizer
    from deltaserve.quant.convert import SCALE_DTYPE, _block
    from deltaserve.quant.schemes import INT4

    p = preset(name)
    text = dict(p.config["text_config"])
    text["architectures"] = ["Qwen3_5ForCausalLM"]
    text["quantization"] = _block("int4", INT4)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    scale = 0.02 * 12**0.5 / 15  # uniform codes 0..15 around 7.5: std 0.02
    shard, num, weight_map = {}, 0, {}

    def flush():
        nonlocal shard, num
        if shard:
            file = f"model-{num:05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, num = {}, num + 1

    for spec in preset_specs(p):
        if not spec.name.startswith(("model.language_model.", "lm_head.")):
            continue  # vision tower and MTP: the text engine never reads them
        if len(spec.shape) == 2 and spec.name.endswith(".weight"):
            rows, cols = spec.shape
            base = spec.name.removesuffix(".weight")
            words = torch.randint(-(2**31), 2**31, (rows, cols // 8), generator=gen,
                                  dtype=torch.int64).to(torch.int32).view(torch.uint32)
            s = torch.full((rows, cols // INT4.group_size), scale, dtype=SCALE_DTYPE)
            shard.update({f"{base}.weight": words, f"{base}.scales": s,
                          f"{base}.biases": (-7.5 * s.float()).to(SCALE_DTYPE)})
        else:
            shard[spec.name] = init_tensor(spec, gen, 0.02)
        if sum(t.numel() * t.element_size() for t in shard.values()) > 4 << 30:
            flush()
    flush()
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(text, indent=1))
    (out / "generation_config.json").write_text(json.dumps(p.generation_config))
    write_tokenizer(out, False)
    return out


def _decode(llm, batch: int, tokens: int, gen: torch.Generator) -> float:
    """Aggregate decode tok/s of `batch` sequences (a warm-up round captures the graphs)."""
    from deltaserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine = llm.engine
    for rnd in ("warm-up", "timed"):
        for i in range(batch):
            ids = torch.randint(0, llm.config.vocab_size, (16,), generator=gen).tolist()
            engine.add_request(f"{rnd}-{batch}-{i}", ids, params)
        engine.step()  # every prompt in one step: each sequence has its first token
        t0, produced = time.perf_counter(), 0
        while engine.has_work:
            produced += len(engine.step())
        dt = time.perf_counter() - t0
    return produced / dt


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _prefill(llm, n: int, gen: torch.Generator) -> float:
    from deltaserve import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(4):  # the first is the warm-up
        ids = torch.randint(0, llm.config.vocab_size, (n,), generator=gen).tolist()
        _sync()
        t0 = time.perf_counter()
        llm.generate([ids], one)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times[1:])


def _parallel(tp: int, pp: int, opts: dict) -> dict:
    """LLM's arguments for TP=tp or (tp == 1) PP=pp with the options' layer split."""
    if pp == 1:
        return {"tensor_parallel_size": tp}
    return {"tensor_parallel_size": 1, "pipeline_parallel_size": pp,
            "layer_split": opts.get("pp_layers")}


def measure(rank: int, model_dir: str, tp: int, opts: dict, path: str, pp: int = 1) -> None:
    """One launch (every rank runs it; rank 0 writes the numbers)."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.distributed.comm import Compression
    from deltaserve.distributed.gate import compression_gate

    t0 = time.perf_counter()
    device = opts.get("device", "cuda")
    llm = LLM(model_dir, dtype="bfloat16", device=device, prefix_cache_bytes=0,
              max_num_seqs=max(opts["batches"]), max_num_batched_tokens=max(opts["prefill"]),
              **_parallel(tp, pp, opts))
    rec: dict = {"tp": tp, "pp": pp, "load_s": round(time.perf_counter() - t0, 1)}
    if llm.model.pp is not None:
        plan = llm.model.pp.plan
        rec["layer_split"] = list(plan.layer_split)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.config.vocab_size, (32,), generator=gen).tolist()
               for _ in range(GREEDY_PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    rec["greedy"] = [o.outputs[0].token_ids for o in
                     llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    for b in opts["batches"]:
        rec[f"batch_{b}_decode_tok_s"] = round(_decode(llm, b, opts["decode_tokens"], gen), 1)
    for n in opts["prefill"]:
        rec[f"prefill_{n}_tok_s"] = round(_prefill(llm, n, gen), 1)
    if device != "cpu":
        rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if llm.model.pp is not None:
        rec["pp_sent_gib_rank0"] = round(llm.model.pp.sent_bytes / 2**30, 3)
    if tp > 1:
        rec["counters_exact"] = llm.model.tp.comm.report()
        if opts["gate_prompts"]:
            rec["compressed_gate"] = compression_gate(llm, Compression("fp16"),
                                                      max_prompts=opts["gate_prompts"])
    if rank == 0:
        Path(path).write_text(json.dumps(rec))


def parity(rank: int, model_dir: str, tp: int, path: str, pp: int = 1,
           opts: dict | None = None) -> None:
    """FP32 (TF32 off) logits of every position of a 64-token prompt and 32 greedy tokens: the
    bf16 comparison says little on random weights, whose near-flat logits let rounding flip the
    argmax; FP32 shows whether TP=2 computes the same function."""
    from deltaserve import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    opts = opts or {}
    llm = LLM(model_dir, dtype="float32", device=opts.get("device", "cuda"), prefix_cache_bytes=0,
              max_num_seqs=4, **_parallel(tp, pp, opts))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, llm.config.vocab_size, (1, 64), generator=gen)
    logits = prompt_logits(llm.model, ids.to(llm.model.device))[None]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    greedy = llm.generate([{"prompt_token_ids": ids[0].tolist()}], params)[0].outputs[0].token_ids
    if rank == 0:
        torch.save({"logits": logits.float().cpu(), "greedy": greedy}, path)


def profile_prefill(rank: int, model_dir: str, tp: int, n: int, path: str) -> None:
    """Where a bf16 prefill of n tokens spends its time at this TP size (rank 0's view)."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.bench.attribution import profile_call

    llm = LLM(model_dir, dtype="bfloat16", device="cuda", tensor_parallel_size=tp,
              prefix_cache_bytes=0, max_num_seqs=4, max_num_batched_tokens=n)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = torch.randint(0, llm.config.vocab_size, (n,)).tolist()
    llm.generate([ids], one)
    rec = profile_call(lambda: llm.generate([ids], one))
    if rank == 0:
        Path(path).write_text(json.dumps(rec))


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), None)
              for p, q in zip(a, b, strict=True)]
    return {"identical": a == b, "first_divergence": firsts,
            "agreement": sum(x == y for p, q in zip(a, b, strict=True)
                             for x, y in zip(p, q, strict=True)) / sum(map(len, a))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="2b,27b",
                    help="2b (bf16) and/or 27b (int4); default (the trained stdlib-19m: a gate "
                    "that measures the transport, not flat logits); tiny / 0.8b for a CPU smoke run")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--gate-prompts", type=int, default=2, help="0: no compressed gate")
    ap.add_argument("--work", default=None, help="checkpoint folder (default: a temp dir)")
    ap.add_argument("--parity", action="store_true", help="2b: FP32 TP=2 vs TP=1 logits too")
    ap.add_argument("--profile", action="store_true", help="attribute a 2k prefill per TP size")
    ap.add_argument("--skip-speed", action="store_true", help="only parity / profile")
    ap.add_argument("--pp", action="store_true", help="also PP=2 (layer split) beside TP=1/2")
    ap.add_argument("--pp-layers", default=None, help="PP=2 layers per rank, e.g. 10,14")
    ap.add_argument("--layouts", default="tp1,tp2",
                    help="which of tp1,tp2 to run (--pp adds pp2); e.g. tp2 for the gate alone")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (gloo)")
    args = ap.parse_args()
    from deltaserve.distributed.pipeline import parse_split

    work = Path(args.work or tempfile.mkdtemp(prefix="tp_bench-"))
    opts = {"batches": [int(b) for b in args.batches.split(",")], "decode_tokens":
            args.decode_tokens, "prefill": [int(n) for n in args.prefill.split(",")],
            "gate_prompts": args.gate_prompts, "pp_layers": parse_split(args.pp_layers),
            "device": args.device}
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    record = {"kind": "tp-bench", "git_commit": git_commit(), "flags": flags(),
              "device": device_info(args.device), "gpus": gpus, "workload": opts, "models": {}}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        model_dir = _checkpoint(name, work)
        runs = {"checkpoint_s": round(time.perf_counter() - t0, 1)}
        if not args.skip_speed:
            _speed(name, model_dir, work, opts, runs, args.pp, args.layouts.split(","))
        if args.parity and name in ("2b", "tiny", "0.8b"):
            runs["fp32_parity"] = _fp32_parity(model_dir, work, opts, args.pp)
            print(name, "fp32", runs["fp32_parity"], flush=True)
        if args.profile:
            for tp in (1, 2):
                path = work / f"{name}-profile-tp{tp}.json"
                spawn(profile_prefill, tp, str(model_dir), tp, 2048, str(path), device="cuda")
                runs[f"prefill_2048_attribution_tp{tp}"] = json.loads(path.read_text())
        record["models"][name] = runs
        Path(args.out).write_text(json.dumps(record, indent=1))


def _speed(name: str, model_dir: Path, work: Path, opts: dict, runs: dict, pp: bool,
           wanted: list[str]) -> None:
    """TP=1, TP=2 (and PP=2) each in a fresh launch; greedy agreement with TP=1."""
    layouts = [layout for layout in [("tp1", 1, 1), ("tp2", 2, 1)] if layout[0] in wanted]
    layouts += [("pp2", 1, 2)] if pp else []
    for label, tp, stages in layouts:
        path = work / f"{name}-{label}.json"
        t0 = time.perf_counter()
        spawn(measure, tp * stages, str(model_dir), tp, opts, str(path), stages,
              device=opts["device"])
        runs[label] = {**json.loads(path.read_text()), "wall_s": round(time.perf_counter() - t0, 1)}
        print(name, label, {k: v for k, v in runs[label].items()
                            if k.endswith(("tok_s", "_s", "gib"))}, flush=True)
    for label, _, _ in (layouts[1:] if "tp1" in runs else []):
        runs[f"greedy_{label}_vs_tp1"] = _agreement(runs[label]["greedy"], runs["tp1"]["greedy"])
        print(name, label, runs[f"greedy_{label}_vs_tp1"], flush=True)


def _fp32_parity(model_dir: Path, work: Path, opts: dict, pp: bool) -> dict:
    """TP=2 (and PP=2) against TP=1: FP32 logits rel-L2 and greedy agreement."""
    out = {}
    for label, tp, stages in [("tp1", 1, 1), ("tp2", 2, 1)] + ([("pp2", 1, 2)] if pp else []):
        path = work / f"parity-{label}.pt"
        spawn(parity, tp * stages, str(model_dir), tp, str(path), stages, opts,
              device=opts["device"])
        out[label] = torch.load(path)
    rec = {}
    for label in [k for k in out if k != "tp1"]:
        a, b = out[label]["logits"].double(), out["tp1"]["logits"].double()
        rec[label] = {"logits_rel_l2": float((a - b).norm() / b.norm()),
                      **_agreement([out[label]["greedy"]], [out["tp1"]["greedy"]])}
    return rec if pp else rec["tp2"]  # without PP: the record's earlier shape


def _checkpoint(name: str, work: Path) -> Path:
    from deltaserve.checkpoint.presets import preset
    from deltaserve.checkpoint.writer import write_checkpoint

    out = work / name
    if (out / "config.json").exists():
        return out
    if name == "2b":
        write_checkpoint(preset("qwen3.5-2b"), out, seed=0)
        return out
    if name == "27b":
        return write_int4("qwen3.5-27b", out)
    if name in ("tiny", "0.8b"):  # CPU smoke runs of this script
        write_checkpoint(preset("tiny" if name == "tiny" else "qwen3.5-0.8b"), out, seed=0)
        return out
    if name == "default":  # the trained default model: the fixture the compressed gate needs
        from deltaserve.checkpoint.default import default_model_dir

        return default_model_dir()
    raise SystemExit(f"unknown model {name} (2b, 27b, default, tiny, 0.8b)")


if __name__ == "__main__":
    main()
