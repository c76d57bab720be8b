"""H200: where the time to first token of a prefix-cache hit goes (torch profiler, one hit).

    python3 scripts/gpu/ttft_profile.py
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.checkpoint.presets import preset  # noqa: E402
from deltaserve.checkpoint.writer import write_checkpoint  # noqa: E402


def main() -> None:
    work = Path(tempfile.mkdtemp()) / "q08"
    write_checkpoint(preset("qwen3.5-0.8b"), work, seed=0)
    llm = LLM(work, dtype="bfloat16", device="cuda")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 240000, (4096,), generator=g).tolist()
    llm.generate([system + [1, 2, 3]], one)
    for _ in range(2):
        q = torch.randint(0, 240000, (40,), generator=g).tolist()
        t0 = time.perf_counter()
        llm.generate([system + q], one)
        print("hit ttft s", time.perf_counter() - t0, flush=True)
    q = torch.randint(0, 240000, (40,), generator=g).tolist()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([system + q], one)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
