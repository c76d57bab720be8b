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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, one-time weight preparation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ours(model_dir: Path, dtype: str, lens: list[int], decode_tokens: int, repeats: int) -> dict:
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.sampling import SamplingParams

    llm = LLM(model_dir, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for n in lens:
        ids = torch.randint(0, 248044, (n,), generator=gen).tolist()
        out[f"prefill_{n}_tok_s"] = n / _median_s(
            lambda ids=ids: llm._prefill(ids, llm.model.new_state(1)), repeats
        )
    prompt = torch.randint(0, 248044, (16,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    rates = [
        llm.generate([prompt], params)[0].metrics["decode_tok_s"]
        for _ in range(max(1, repeats - 1))
    ]
    out["decode_tok_s"] = statistics.median(rates)
    return out


def _transformers(
    model_dir: Path, dtype: str, lens: list[int], decode_tokens: int, repeats: int
) -> dict:
    import transformers

    from deltaserve.validate.reference import load_reference

    model = load_reference(model_dir, DTYPES[dtype])
    gen = torch.Generator().manual_seed(0)
    out: dict = {"version": transformers.__version__}
    with torch.inference_mode():
        for n in lens:
            ids = torch.randint(0, 248044, (1, n), generator=gen)
            out[f"prefill_{n}_tok_s"] = n / _median_s(
                lambda ids=ids: model(ids, logits_to_keep=1), repeats
            )

        def decode() -> None:
            res = model(
                torch.randint(0, 248044, (1, 16), generator=gen), use_cache=True, logits_to_keep=1
            )
            past, token = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(decode_tokens - 1):  # greedy with its cache, EOS ignored: its best case
                res = model(token, past_key_values=past, use_cache=True)
                past, token = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)

        t_prefill16 = _median_s(
            lambda: model(torch.randint(0, 248044, (1, 16)), logits_to_keep=1), 1
        )
        total = _median_s(decode, max(1, repeats - 1))
        out["decode_tok_s"] = (decode_tokens - 1) / max(total - t_prefill16, 1e-9)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["ours", "transformers"])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lens", default="512,2048")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    lens = [int(x) for x in a.lens.split(",") if x]
    fn = _ours if a.engine == "ours" else _transformers
    result = fn(Path(a.model_dir), a.dtype, lens, a.decode_tokens, a.repeats)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
