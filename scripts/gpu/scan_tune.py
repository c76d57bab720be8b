"""H200: the prefill scan per chunk length, three ways, host time included (what sets SCAN_MAX_TOKENS
in ops/gdn.py).

    python3 scripts/gpu/scan_tune.py --out scan_tune.json

For each chunk length T (0.8B GDN shape: 16 key and 16 value heads of 128, bf16), 18 calls back to
back (one per GDN layer of a prefill step), then a sync: ms per call. Paths: the one-launch
recurrent Triton scan (ops/triton_gdn_scan), fla's stages driven once per chunk (ops/fla_scan), and
fla's public call per segment (the path before). With and without snapshot stops every 64 tokens.
Each path is checked against the fp32 recurrence on the same inputs first.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deltaserve.ops.fla_scan import fla_prefill  # noqa: E402
from deltaserve.ops.gdn import fla_public_prefill, gdn_chunked  # noqa: E402
from deltaserve.ops.gdn_prefill import SCAN_MAX_TOKENS  # noqa: E402
from deltaserve.ops.triton_gdn_scan import gdn_scan_cuda  # noqa: E402

LAYERS = 18
PATHS = {"triton_scan": gdn_scan_cuda, "fla_stages": fla_prefill, "fla_public": fla_public_prefill}


def _inputs(seq_len: int, heads: int = 16, dim: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(seq_len)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k, v = (rnd(1, seq_len, heads, dim).bfloat16() for _ in range(3))
    g = -torch.rand(1, seq_len, heads, device="cuda", generator=gen) * 0.5
    beta = torch.rand(1, seq_len, heads, device="cuda", generator=gen)
    return q, k, v, g, beta, rnd(1, heads, dim, dim) * 0.1


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _time(fn, args, stops, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            fn(*args, stops, lambda n, s: None)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / LAYERS)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="scan_tune.json")
    ap.add_argument("--lens", default="8,16,32,40,64,89,128,192,256,512,1024,4096")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows = []
    for seq_len in (int(x) for x in args.lens.split(",")):
        inputs = _inputs(seq_len)
        q, k, v, g, beta, state = inputs
        ref_o, ref_s = gdn_chunked(q.float(), k.float(), v.float(), g, beta, state.clone(),
                                   qk_l2norm=True)
        for stops in ((), tuple(range(64, seq_len + 1, 64))):
            if stops == () and rows and rows[-1]["seq_len"] == seq_len and not rows[-1]["stops"]:
                continue
            for name, fn in PATHS.items():
                o, s = fn(*inputs, stops, lambda n, st: None)
                row = {"seq_len": seq_len, "stops": len(stops), "path": name,
                       "rel_o": _rel(o, ref_o), "rel_state": _rel(s, ref_s),
                       "ms_per_call": _time(fn, inputs, stops)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    record = {"commit": commit, "device": torch.cuda.get_device_name(), "layers": LAYERS,
              "scan_max_tokens_in_code": SCAN_MAX_TOKENS, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
