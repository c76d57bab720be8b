"""`deltaserve gate`: does model A still behave like model B on natural prompts?

Per prompt (bench/gate_prompts.json): B's greedy 64 tokens are the reference; A's greedy tokens
give exact agreement and first divergence; both models, teacher-forced on B's continuation, give
the Jensen-Shannon divergence of their next-token distributions at each of the 64 positions. Plus
non-finite logits and collapse markers (longest run of one token / one character, repeated 4-grams)
of A's text relative to B's, and latency. Thresholds (bench/gate_thresholds.json or a file) decide
the exit code: 0 pass, 3 fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from deltaserve.bench.record import checkpoint_fingerprint, device_info, flags, git_commit
from deltaserve.errors import ConfigError
from deltaserve.progress import bar

HERE = Path(__file__).parent
NUM_TOKENS = 64


def load_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc


def thresholds_from(spec: str) -> dict:
    presets = load_json(HERE / "gate_thresholds.json", "gate thresholds")
    return presets[spec] if spec in presets else load_json(Path(spec), "gate thresholds")


def js_divergence(logits_a: torch.Tensor, logits_b: torch.Tensor) -> torch.Tensor:
    """[P, V] logits each -> [P] JS divergence in nats (0 .. ln 2)."""
    pa, pb = logits_a.float().softmax(-1), logits_b.float().softmax(-1)
    m = 0.5 * (pa + pb)

    def kl(p):
        return (p * (p.clamp_min(1e-30).log() - m.clamp_min(1e-30).log())).sum(-1)

    return 0.5 * kl(pa) + 0.5 * kl(pb)


def teacher_forced(llm, prompt_ids: list[int], cont: list[int]) -> torch.Tensor:
    """[64, V] next-token logits at the last prompt position and after each continuation token."""
    from deltaserve.cache.sequence import Sequence

    seq = Sequence(llm.model, len(prompt_ids) + len(cont))
    first = seq.forward(prompt_ids)  # [1, V]
    return torch.cat([first, seq.forward(cont[:-1], all_logits=True)])


def collapse(text: str, ids: list[int]) -> dict:
    def longest_run(seq) -> int:
        best = run = 0
        for i, x in enumerate(seq):
            run = run + 1 if i and x == seq[i - 1] else 1
            best = max(best, run)
        return best

    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    repeat = 1 - len(set(grams)) / len(grams) if grams else 0.0
    return {"token_run": longest_run(ids), "char_run": longest_run(text),
            "repeat_4gram_frac": round(repeat, 4)}


def greedy(llm, prompt_ids: list[int]):
    from deltaserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs[0]
    return out.token_ids, out.text, time.perf_counter() - t0


def gate_prompt(a, b, prompt: dict) -> dict:
    ids = b.tokenizer.encode(prompt["text"])
    if a.tokenizer.encode(prompt["text"]) != ids:
        raise ConfigError("the two models tokenize differently; the gate compares one vocabulary")
    ids_b, text_b, s_b = greedy(b, ids)
    ids_a, text_a, s_a = greedy(a, ids)
    la, lb = teacher_forced(a, ids, ids_b), teacher_forced(b, ids, ids_b)
    nonfinite = int((~torch.isfinite(la)).sum())
    js = js_divergence(la.nan_to_num(), lb)
    diverge = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
    ca, cb = collapse(text_a, ids_a), collapse(text_b, ids_b)
    return {
        "id": prompt["id"], "category": prompt["category"], "prompt_tokens": len(ids),
        "agreement": sum(x == y for x, y in zip(ids_a, ids_b, strict=False)) / NUM_TOKENS,
        "first_divergence": diverge, "js_max": js.max().item(), "js_mean": js.mean().item(),
        "nonfinite": nonfinite, "collapse_a": ca, "collapse_b": cb,
        "latency_s": {"a": round(s_a, 3), "b": round(s_b, 3)}, "text_a": text_a, "text_b": text_b,
    }


def verdict(rows: list[dict], th: dict) -> list[str]:
    mean_agree = sum(r["agreement"] for r in rows) / len(rows)
    js_mean = sum(r["js_mean"] for r in rows) / len(rows)
    js_max = max(r["js_max"] for r in rows)
    checks = [
        (mean_agree >= th["min_mean_agreement"], f"mean agreement {mean_agree:.3f}"),
        (js_mean <= th["max_js_mean"], f"mean JS {js_mean:.2e}"),
        (js_max <= th["max_js_max"], f"max JS {js_max:.2e}"),
        (sum(r["nonfinite"] for r in rows) <= th["max_nonfinite"], "non-finite logits"),
    ]
    for r in rows:
        extra_run = r["collapse_a"]["token_run"] - r["collapse_b"]["token_run"]
        extra_rep = r["collapse_a"]["repeat_4gram_frac"] - r["collapse_b"]["repeat_4gram_frac"]
        checks.append((extra_run <= th["max_extra_token_run"], f"{r['id']}: token run +{extra_run}"))
        checks.append((extra_rep <= th["max_extra_repeat_4gram_frac"] + 1e-9,
                       f"{r['id']}: repeated 4-grams +{extra_rep:.2f}"))
    return [what for ok, what in checks if not ok]  # NaN compares False: it fails


def run_gate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from deltaserve import LLM, EngineArgs
    from deltaserve.checkpoint.default import default_model_dir
    from deltaserve.checkpoint.hub import resolve_model_dir

    th = thresholds_from(args.thresholds)
    prompts = load_json(Path(args.prompts) if args.prompts else HERE / "gate_prompts.json",
                        "gate prompts").get("prompts")
    if not prompts:
        raise ConfigError("the gate prompts file holds no prompts")
    dirs = {k: default_model_dir() if v is None else resolve_model_dir(v)
            for k, v in (("a", args.model), ("b", args.against))}
    engine_args = EngineArgs.from_cli_args(args)
    a = LLM.from_engine_args(replace(engine_args, model=dirs["a"], mmproj=None))
    b_device = getattr(args, "against_device", None) or engine_args.device
    b = LLM.from_engine_args(replace(engine_args, model=dirs["b"], mmproj=None,
                                     dtype=args.against_dtype or args.dtype, device=b_device,
                                     gpu_memory_limit_gb=None if b_device != "vulkan"
                                     else engine_args.gpu_memory_limit_gb))
    rows = []
    with bar(len(prompts), "gate", "prompt") as shown:
        for p in prompts:
            rows.append(gate_prompt(a, b, p))
            r = rows[-1]
            shown.write(f"gate: {r['id']:<20} {r['prompt_tokens']:>5} tok  agree "
                        f"{r['agreement']:.2f}  JS max {r['js_max']:.2e} mean "
                        f"{r['js_mean']:.2e}", file=sys.stderr)
            shown.update(1)
    fails = verdict(rows, th)
    record = {
        "kind": "gate", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": git_commit(),
        "model": str(dirs["a"]), "against": str(dirs["b"]),
        "fingerprints": {k: checkpoint_fingerprint(v) for k, v in dirs.items()},
        "device": device_info(args.device), "against_device": b_device, "dtype": args.dtype,
        "flags": flags(),
        "thresholds": th, "passed": not fails, "failures": fails,
        "summary": {
            "mean_agreement": sum(r["agreement"] for r in rows) / len(rows),
            "js_max": max(r["js_max"] for r in rows),
            "js_mean": sum(r["js_mean"] for r in rows) / len(rows),
            "nonfinite": sum(r["nonfinite"] for r in rows),
        },
        "prompts": rows,
    }
    text = json.dumps(record, indent=2, ensure_ascii=False)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    print("gate: " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)), file=sys.stderr)
    return 0 if not fails else 3
