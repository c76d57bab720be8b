"""Where a GPU decode step's time goes: the captured batch-1 graph replayed under torch.profiler,
its kernels binned by component, and the gaps (the replay's wall time minus the kernels' busy time:
launch latency and the DRAM round trip before each kernel's first byte).

Components are recognised by kernel name (ours are named in ops/triton_*; cuBLAS / flash kernels by
their vendor prefixes). The head is everything after the final norm (the last residual-add norm
kernel), so its GEMV is not counted with the layers' GEMVs.
"""

from __future__ import annotations

import torch

COMPONENTS = (  # (component, substrings of kernel names), first match wins
    ("gdn", ("_delta_kernel", "_out_kernel", "chunk_gated_delta", "chunk_fwd", "chunk_local",
             "recompute_w_u", "solve_tril", "fwd_h", "fwd_o", "fwd_intra", "l2norm")),
    ("attention", ("_prep_kernel", "_paged_kernel", "_combine_kernel", "flash", "fmha",
                   "attention", "_rope_kernel")),
    ("norm", ("_add_rms_kernel", "_rms_kernel")),
    ("mlp_act", ("_silu_mul_kernel",)),
    ("gemv", ("gemv", "gemm", "cutlass", "xmma", "_gemv_kernel", "splitk", "sm90", "sm80")),
)
FINAL_NORM = "_add_rms_kernel"


def component_of(name: str) -> str:
    low = name.lower()
    for component, keys in COMPONENTS:
        if any(k.lower() in low for k in keys):
            return component
    return "other"


def attribute(kernels: list[tuple[str, float, float]], wall_us: float) -> dict:
    """kernels: (name, start_us, duration_us) of one step in launch order; wall_us: the step's
    time. Returns microseconds per component, the head, kernel counts and the gaps."""
    kernels = sorted(kernels, key=lambda k: k[1])
    last_norm = max((i for i, k in enumerate(kernels) if FINAL_NORM in k[0]), default=-1)
    out: dict = {"kernels": len(kernels), "wall_us": wall_us}
    busy = 0.0
    for i, (name, _, dur) in enumerate(kernels):
        component = "head" if last_norm >= 0 and i > last_norm else component_of(name)
        out[f"{component}_us"] = out.get(f"{component}_us", 0.0) + dur
        out[f"{component}_kernels"] = out.get(f"{component}_kernels", 0) + 1
        busy += dur
    out["busy_us"] = busy
    out["gaps_us"] = max(0.0, wall_us - busy)
    other: dict[str, float] = {}
    for name, _, dur in kernels:
        if component_of(name) == "other":
            other[name[:80]] = other.get(name[:80], 0.0) + dur
    out["top_other_us"] = dict(sorted(other.items(), key=lambda kv: -kv[1])[:8])
    return out


def _cuda_kernels(prof) -> list[tuple[str, float, float]]:
    return [(e.name, e.time_range.start, e.time_range.elapsed_us())
            for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]


def profile_graph(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> dict:
    """Replays `graph` (wall time per replay from CUDA events), then once under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / repeats
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return attribute(_cuda_kernels(prof), wall_us)


def profile_call(fn) -> dict:
    """One eager call (e.g. a prefill) under the profiler: kernel time per component, and the
    rest of its wall time (host-side Python and launches the GPU waited for) as gaps."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    return attribute(_cuda_kernels(prof), wall_us)


def decode_attribution(llm) -> dict | None:
    """The attribution of the batch-1 decode graph an LLM captured (None without graphs)."""
    graphs = getattr(llm.engine.runner, "graphs", None)
    if graphs is None or not graphs.graphs:
        return None
    key = min(graphs.graphs, key=lambda k: (k[0], -k[1]))  # batch 1, the widest KV bucket
    return profile_graph(graphs.graphs[key][0])
