"""Every DELTASERVE_* environment knob, typed, read in one place."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _gemv_rows(value: str) -> int:
    from deltaserve.errors import ConfigError

    if value.strip() in ("", "0", "auto"):
        return 0
    if value.strip() not in ("1", "4"):
        raise ConfigError(f"DELTASERVE_CPU_GEMV_ROWS={value!r}: choose 1, 4 or auto")
    return int(value)


@dataclass(frozen=True, slots=True)
class Env:
    cache_dir: Path  # DELTASERVE_CACHE_DIR: default model, built tokenizer files
    reference_ops: bool  # DELTASERVE_REFERENCE_OPS=1: every op runs its plain torch reference
    num_threads: int  # DELTASERVE_NUM_THREADS: torch intra-op threads on CPU (0 = torch default)
    offline: bool  # HF_HUB_OFFLINE=1 (huggingface_hub's own knob): never touch the network
    native: bool  # DELTASERVE_NATIVE=0: never build/load the C CPU kernels (use torch's ops)
    # DELTASERVE_CPU_MARCH: the C kernels' -march (default "native"; e.g. x86-64-v3 = AVX2 + FMA +
    # F16C, no AVX-512: a build for a lesser CPU, or one shared cache folder for several machines)
    cpu_march: str
    huge_pages: bool  # DELTASERVE_HUGE_PAGES=0: no MADV_HUGEPAGE on CPU weights
    cuda_graphs: bool  # DELTASERVE_CUDA_GRAPHS=0: GPU decode steps launch eagerly
    # DELTASERVE_FUSED_DECODE=0: a CPU decode step runs layer by layer in Python, not as one
    # native call (ops/decode_step.py)
    fused_decode: bool
    # DELTASERVE_OVERLAP=0|1: greedy decode steps launch before the previous step's tokens are read
    # back (engine/overlap.py); default (unset): on for CUDA devices, off on CPU
    overlap: bool | None
    gpu_backend: str  # DELTASERVE_GPU_BACKEND=auto|triton|portable (ops/backend.py)
    # DELTASERVE_EXACT_INT8_ACT=1: quantized decode GEMVs keep fp32 activations (CPU: no VNNI / AVX2
    # integer path; CUDA: q1 on the exact GEMV, not ops/triton_q1)
    exact_int8_activations: bool
    # DELTASERVE_CPU_GEMV_ROWS=1|4: weight rows per block of the int8-activation GEMVs (default
    # 0: measured once per CPU, ops/gemv_rows.py)
    cpu_gemv_rows: int
    fla: bool  # DELTASERVE_FLA=0: the GPU prefill scan never uses fla-core's chunk kernel
    # DELTASERVE_AMX=0: fp32 vision GEMMs on CPU stay on torch's fp32 GEMM instead of the AMX
    # bf16x2 split kernel (ops/gemm_amx.py)
    amx: bool
    # DELTASERVE_GEMV_PROLOGUE=0: GPU decode rows run the MLP's add + norm and silu * mul as their
    # own kernels instead of inside the next GEMV (ops/gemv_prologue.py)
    gemv_prologue: bool
    # DELTASERVE_PDL=0: Triton kernels launch without programmatic dependent launch (which they
    # use on sm_90+ GPUs: ops/backend.pdl_enabled)
    pdl: bool
    # DELTASERVE_CONV_QKV=0: a long 16-bit GPU prefill's conv writes q|k|v as one tensor, which
    # fla's l2norm then copies and normalises, instead of contiguous normalised q, k and v
    # (ops/triton_conv1d.causal_conv1d_qkv_cuda)
    conv_qkv: bool
    # DELTASERVE_PREFILL_GRAPH_TOKENS: the longest fresh prefill chunk replayed from a CUDA graph
    # (engine/prefill_graph.LONG_BUCKETS; default 16384, 0 = only the short chunks' graphs)
    prefill_graph_tokens: int
    # DELTASERVE_PREFILL_GRAPH_SNAPSHOTS=1: a long fresh chunk whose pieces cut at its prefix
    # snapshots would not all replay takes one graph keeping every 64th position's state (default
    # off: ~19 MB of buffer per 64 rows on the 0.8B shape; engine/prefill_graph.py)
    prefill_graph_snapshots: bool
    # DELTASERVE_SPLIT_ATTENTION=0: a 16-bit CUDA chunk of >= 2,048 rows behind cached keys runs FA2's
    # bottom-right causal kernel instead of two cuDNN calls merged by log-sum-exp (ops/attention.py)
    split_attention: bool
    progress: bool  # DELTASERVE_PROGRESS=0: no progress bars on stderr (deltaserve/progress.py)
    git_commit: str  # DELTASERVE_GIT_COMMIT: the commit run records name (else git rev-parse)
    # tensor parallelism's compressed all-reduce (distributed/comm.py):
    tp_compress: str  # DELTASERVE_TP_COMPRESS=fp16|bf16: 16-bit transport (default "": exact)
    tp_compress_classes: str  # DELTASERVE_TP_COMPRESS_CLASSES=ffn[,attn,gdn] (default ffn)
    tp_compress_scaling: str  # DELTASERVE_TP_COMPRESS_SCALING=dynamic|none (none: raw cast)

    @classmethod
    def read(cls) -> Env:
        cache = os.environ.get("DELTASERVE_CACHE_DIR") or str(Path.home() / ".cache" / "deltaserve")
        return cls(
            cache_dir=Path(cache),
            reference_ops=_flag("DELTASERVE_REFERENCE_OPS"),
            num_threads=int(os.environ.get("DELTASERVE_NUM_THREADS", "0") or 0),
            offline=_flag("HF_HUB_OFFLINE"),
            native=_flag("DELTASERVE_NATIVE", default=True),
            cpu_march=(os.environ.get("DELTASERVE_CPU_MARCH") or "native").strip(),
            huge_pages=_flag("DELTASERVE_HUGE_PAGES", default=True),
            cuda_graphs=_flag("DELTASERVE_CUDA_GRAPHS", default=True),
            fused_decode=_flag("DELTASERVE_FUSED_DECODE", default=True),
            overlap=(None if os.environ.get("DELTASERVE_OVERLAP", "").strip() == ""
                     else _flag("DELTASERVE_OVERLAP")),
            gpu_backend=(os.environ.get("DELTASERVE_GPU_BACKEND") or "auto").strip().lower(),
            exact_int8_activations=_flag("DELTASERVE_EXACT_INT8_ACT"),
            cpu_gemv_rows=_gemv_rows(os.environ.get("DELTASERVE_CPU_GEMV_ROWS", "")),
            fla=_flag("DELTASERVE_FLA", default=True),
            amx=_flag("DELTASERVE_AMX", default=True),
            gemv_prologue=_flag("DELTASERVE_GEMV_PROLOGUE", default=True),
            pdl=_flag("DELTASERVE_PDL", default=True),
            conv_qkv=_flag("DELTASERVE_CONV_QKV", default=True),
            prefill_graph_snapshots=_flag("DELTASERVE_PREFILL_GRAPH_SNAPSHOTS"),
            split_attention=_flag("DELTASERVE_SPLIT_ATTENTION", default=True),
            prefill_graph_tokens=int(os.environ.get("DELTASERVE_PREFILL_GRAPH_TOKENS", "16384")
                                     or 0),
            progress=_flag("DELTASERVE_PROGRESS", default=True),
            git_commit=os.environ.get("DELTASERVE_GIT_COMMIT", "").strip(),
            tp_compress=os.environ.get("DELTASERVE_TP_COMPRESS", "").strip().lower(),
            tp_compress_classes=os.environ.get("DELTASERVE_TP_COMPRESS_CLASSES", "ffn"),
            tp_compress_scaling=(os.environ.get("DELTASERVE_TP_COMPRESS_SCALING") or "dynamic"
                                 ).strip().lower(),
        )


@functools.cache
def env() -> Env:
    """The environment as read at first use; `env.cache_clear()` re-reads it (each new LLM does).

    Cached because hot paths (every decode GEMV) consult it: re-reading cost ~15 ms per token.
    """
    return Env.read()
