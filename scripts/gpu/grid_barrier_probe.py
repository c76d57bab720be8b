"""What a software grid barrier costs on this GPU, against a kernel boundary: the question behind a
persistent decode kernel (issue 4). Writes one JSON record.

    python3 scripts/gpu/grid_barrier_probe.py --out $OUT/grid-barrier.json

A decode step's quantized GEMVs are 2-8 MB each; measured as a chain of kernels with programmatic
dependent launch they reach 31-58% of copy bandwidth, because every kernel boundary costs ~1-2 us
(qgemv_chain.py). A persistent kernel would replace each boundary by a grid-wide barrier. Here
half a program, one program and two programs per SM (small programs: all resident at once, which
the barrier needs; a grid that could not be resident would hang) run ROUNDS barriers: each program
adds 1 to the round's counter (release) and spins until it reads the program count (Triton compiles
the spin's atomic add of 0 with acquire semantics to an ld.acquire by one thread). Timed as
CUDA-graph replays: us per round = (time - time of 1 round) / (ROUNDS - 1). Beside it, the same
number of empty kernels launched back to back in a graph, plain and with PDL (gdc_wait first).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.bench.gpu import graph_replay_s  # noqa: E402
from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait  # noqa: E402


@triton.jit
def _barriers(C, rounds, programs):
    """rounds grid barriers on counters C[0 .. rounds-1] (zeroed before the launch)."""
    for r in range(rounds):
        tl.atomic_add(C + r, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(C + r, 0, sem="acquire", scope="gpu")
        while seen < programs:
            seen = tl.atomic_add(C + r, 0, sem="acquire", scope="gpu")


@triton.jit
def _empty(Y, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(Y + tl.program_id(0), 1.0)


def barrier_us(programs: int, rounds: int, warps: int) -> float:
    counters = torch.zeros(rounds, dtype=torch.int32, device="cuda")

    def run(n):
        counters.zero_()
        _barriers[(programs,)](counters, n, programs, num_warps=warps)

    one = graph_replay_s([lambda: run(1)])
    many = graph_replay_s([lambda: run(rounds)])
    if int(counters[-1].item()) != programs:
        raise RuntimeError(f"barrier counter {counters[-1].item()} != {programs}")
    return (many - one) / (rounds - 1) * 1e6


def kernels_us(programs: int, count: int, pdl: bool) -> float:
    y = torch.empty(programs, device="cuda")
    extra = {"launch_pdl": True} if pdl else {}
    return graph_replay_s([lambda: _empty[(programs,)](y, PDL=pdl, **extra)] * count) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=96)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rec = {"device": torch.cuda.get_device_name(), "sms": sms, "rounds": args.rounds,
           "triton": triton.__version__, "torch": torch.__version__, "rows": []}
    for programs in (sms // 2, sms, 2 * sms):
        for warps in (1, 4):
            row = {"programs": programs, "warps": warps,
                   "barrier_us": barrier_us(programs, args.rounds, warps),
                   "empty_kernel_us": kernels_us(programs, args.rounds, False),
                   "empty_kernel_pdl_us": kernels_us(programs, args.rounds, True)}
            rec["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
