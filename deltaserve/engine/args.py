"""EngineArgs: every engine option once, for `LLM`, the command line and `serve` (vLLM's shape:
`EngineArgs.add_cli_args(parser)` adds the flags, `EngineArgs.from_cli_args(namespace)` reads them).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaserve.cache.options import PREFIX_SNAPSHOTS
from deltaserve.errors import ConfigError, RequestError
from deltaserve.multimodal.limits import ImageLimits
from deltaserve.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype and --kv-cache-dtype
# the other spellings vLLM and llama.cpp users type, each to one of DTYPES
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "f16": "float16", "bf16": "bfloat16",
                 "float": "float32", "fp32": "float32", "f32": "float32"}
GENERATION_CONFIGS = ("auto", "vllm")  # --generation-config, or a folder
GPU_BACKENDS = ("auto", "triton", "portable")  # --gpu-backend (DELTASERVE_GPU_BACKEND, env.py)
# the flag groups a command can take: "model" (which checkpoint, where, how long a context), "tp",
# "pp", "speculative", "batching" (slots, step budget, queue, caches) and "images" (limits)
CLI_GROUPS = ("model", "tp", "pp", "speculative", "batching", "images")
MIB, MPX = 2**20, 1e6  # --max-image-mb and --max-image-mpx units


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineArgs:
    """How to load a model and size its engine.

    max_num_batched_tokens None: 8192 on CUDA (a shorter chunk behind cached keys is bound by host
    time there: 2,048-token chunks ran at ~60k tok/s on the H200, 8,192-token ones at ~150k) unless
    its scratch would cut the KV cache that 2048 leaves, then 2048 (under TP or PP always 8192:
    every rank must agree); 2048 on CPU (engine/llm.DEFAULT_BATCHED_TOKENS). A decode row waits
    for the step's prefill chunk: longer chunks mean longer pauses between tokens.
    Pipeline parallelism is not combined with tensor parallelism; the prefix cache is off under it
    (each stage would cache its own bytes, and every rank's scheduler must see the same hits).
    """

    model: str | Path | None = None  # checkpoint folder or hub id; None = the embedded default
    revision: str | None = None  # hub revision (branch, tag or commit) of a hub id
    mmproj: str | None = None  # MiniCPM-V's vision GGUF (None: one beside a .gguf; "none": off)
    dtype: str = "auto"  # weight dtype, one of DTYPES; auto = the checkpoint's
    device: str = "cpu"  # torch device: cpu, cuda, cuda:1, ...; or vulkan (vulkan/, wgpu)
    # --device vulkan: the bytes the engine may allocate on the GPU (a 4 GiB card simulated on a
    # larger one); None = the adapter's own limits
    gpu_memory_limit_gb: float | None = None
    max_model_len: int | None = None  # context limit in tokens; None = the model's own
    max_num_seqs: int = 64  # sequences in flight together (a recurrent-state slot each)
    max_num_batched_tokens: int | None = None  # per-step token budget = longest prefill chunk
    max_waiting: int = 256  # requests queued for a slot before more are refused (serve: 503)
    prefix_cache_bytes: int = 1 << 30  # prefix-snapshot cache budget; 0 = no prefix cache
    prefix_snapshots: str = "sparse"  # sparse: a prompt's end and branch points; grid: every 64
    kv_cache_bytes: int = 4 << 30  # KV pool cap (also cut to the device's free memory)
    kv_cache_dtype: str = "auto"  # K/V pool dtype, one of DTYPES; auto = the activation dtype
    greedy_head: bool = False  # argmax-only head: logits never exist, sampling is refused
    # CUDA: the share of the GPU's memory this engine may hold (weights, scratch and a KV cache
    # grown to fill it, vLLM's meaning); None = kv_cache_bytes caps the KV cache
    gpu_memory_utilization: float | None = None
    # sampling defaults: "auto" = the checkpoint's generation_config.json, "vllm" = none (the
    # request's values or SamplingParams' own), or a folder holding a generation_config.json
    generation_config: str = "auto"
    tensor_parallel_size: int | None = None  # ranks per layer; None = the launch's world size
    pipeline_parallel_size: int = 1  # ranks each holding a contiguous range of layers
    layer_split: tuple[int, ...] | None = None  # layers per pipeline rank, e.g. (10, 14); None = even
    image_limits: ImageLimits = ImageLimits()  # per-request image bounds (vision models)
    # draft-and-verify decoding (vLLM's dict, a method name or a SpeculativeConfig); None = off
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        # the looser forms LLM has always accepted, each stored as its one type
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_value(self.speculative_config))
        if self.image_limits is None:
            object.__setattr__(self, "image_limits", ImageLimits())
        if self.layer_split is not None:
            object.__setattr__(self, "layer_split", tuple(int(n) for n in self.layer_split))
        if self.prefix_snapshots not in PREFIX_SNAPSHOTS:
            raise RequestError(f"prefix_snapshots must be one of {', '.join(PREFIX_SNAPSHOTS)}, "
                               f"got {self.prefix_snapshots!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise RequestError(f"kv_cache_dtype must be one of {', '.join(DTYPES)}, got "
                               f"{self.kv_cache_dtype!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.gpu_memory_utilization is not None and not str(self.device).startswith("cuda"):
            raise ConfigError(f"gpu_memory_utilization applies to CUDA devices, not "
                              f"{self.device!r}: CPU pools take memory only as they are used")
        gen = self.generation_config
        if gen not in GENERATION_CONFIGS and not (Path(gen) / "generation_config.json").is_file():
            raise ConfigError(f"generation_config {gen!r}: give auto (the checkpoint's), vllm "
                              "(none) or a folder holding a generation_config.json")
        spec = self.speculative_config
        if self.device == "vulkan":
            _check_vulkan(self)
        elif self.gpu_memory_limit_gb is not None:
            raise ConfigError("--gpu-memory-limit applies to --device vulkan (CUDA: "
                              "--gpu-memory-utilization)")
        if self.pipeline_parallel_size != 1 and spec is not None and spec.method == "mtp":
            raise ConfigError("speculative method 'mtp' is not supported with pipeline "
                              "parallelism (its drafter reads the last stage's hidden states)")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, groups: Iterable[str] = CLI_GROUPS,
                     dtype_default: str = "auto") -> argparse.ArgumentParser:
        """The flags of `groups` (CLI_GROUPS), vLLM's spellings where vLLM has the option, in one
        "engine options" section; defaults are the fields'. --gpu-backend and --tp-compress set
        their DELTASERVE_* knob (env.py) instead of a field."""
        groups = tuple(groups)
        unknown = sorted(set(groups) - set(CLI_GROUPS))
        if unknown:
            raise ValueError(f"unknown EngineArgs flag groups: {', '.join(unknown)}")
        section = parser.add_argument_group("engine options")
        for name in CLI_GROUPS:  # one order in every command's help
            if name in groups:
                _FLAGS[name](section, dtype_default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags; a group the command does not take keeps its defaults.
        Bad values (a speculative config, image limits, cache choices) fail here, before any
        model loads."""
        from deltaserve.distributed.pipeline import parse_split
        from deltaserve.spec.config import from_cli

        kwargs: dict[str, Any] = {}
        for name in ("model", "mmproj", "dtype", "device", "gpu_memory_limit_gb",
                     "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "prefix_snapshots", "kv_cache_dtype",
                     "gpu_memory_utilization", "generation_config"):
            if hasattr(args, name):
                kwargs[name] = getattr(args, name)
        if getattr(args, "enable_prefix_caching", None) is False:
            kwargs["prefix_cache_bytes"] = 0
        if hasattr(args, "max_queue"):
            kwargs["max_waiting"] = args.max_queue
        if hasattr(args, "tp"):  # --tp 1 (the default) leaves the size to the launch, as LLM's None
            kwargs["tensor_parallel_size"] = None if args.tp == 1 else args.tp
        if hasattr(args, "pp"):
            kwargs["pipeline_parallel_size"] = args.pp
            kwargs["layer_split"] = parse_split(args.pp_layers)
        if hasattr(args, "speculative"):
            kwargs["speculative_config"] = from_cli(args.speculative, args.num_speculative_tokens,
                                                    args.speculative_config)
        if hasattr(args, "max_images"):
            kwargs["image_limits"] = _image_limits(args)
        return cls(**kwargs)


def _image_limits(args: argparse.Namespace) -> ImageLimits:
    values = (args.max_images, args.max_visual_tokens, args.max_image_mb, args.max_image_mpx)
    if min(values) <= 0:
        raise ConfigError("--max-images, --max-visual-tokens, --max-image-mb and --max-image-mpx "
                          "must be positive")
    return ImageLimits(max_images=args.max_images,
                       max_image_bytes=int(args.max_image_mb * MIB),
                       max_image_pixels=int(args.max_image_mpx * MPX),
                       max_visual_tokens=args.max_visual_tokens)


_DEFAULTS = EngineArgs()


def dtype_arg(value: str) -> str:
    """--dtype's value as one of DTYPES (vLLM's half / bf16 / float spellings too)."""
    name = DTYPE_ALIASES.get(value.strip().lower(), value.strip().lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a dtype here: choose {', '.join(DTYPES)} (or half, fp16, bf16, "
            "float, fp32)")
    return name


def kv_dtype_arg(value: str) -> str:
    if value.strip().lower().startswith("fp8"):
        raise argparse.ArgumentTypeError(
            f"{value!r}: fp8 KV caches are not supported; K/V are kept in float32, bfloat16 or "
            "float16 (auto: the activation dtype)")
    return dtype_arg(value)


def _model_flags(p: argparse._ArgumentGroup, dtype_default: str) -> None:
    p.add_argument("--model", "-m", default=_DEFAULTS.model,
                   help="checkpoint folder, .gguf file or hub id (default: the embedded default "
                   "model)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="MiniCPM-V-4.6's vision GGUF for a .gguf model (default: the one "
                   "mmproj*.gguf beside the model file, if any), as llama-server")
    p.add_argument("--no-mmproj", dest="mmproj", action="store_const", const="none",
                   help="text only: no vision file, even one beside the model")
    p.add_argument("--dtype", type=dtype_arg, default=dtype_default, metavar="DTYPE",
                   help=f"weight dtype: {', '.join(DTYPES)} or half / bf16 / float (default "
                   f"{dtype_default}; auto: the checkpoint's)")
    p.add_argument("--device", default=_DEFAULTS.device,
                   help=f"torch device (default {_DEFAULTS.device}), or vulkan: GPUs without "
                   "CUDA through wgpu (pip install 'deltaserve[vulkan]')")
    p.add_argument("--gpu-memory-limit", dest="gpu_memory_limit_gb", type=float, default=None,
                   metavar="GB", help="--device vulkan: GiB the engine may allocate on the GPU")
    p.add_argument("--max-model-len", "-c", "--ctx-size", dest="max_model_len", type=int,
                   default=_DEFAULTS.max_model_len, metavar="N",
                   help="context limit in tokens (default: the model's; -c / --ctx-size as "
                   "llama.cpp)")
    p.add_argument("--threads", "-t", type=int, default=None, metavar="N",
                   help="CPU threads (default: torch's; same as DELTASERVE_NUM_THREADS)")
    p.add_argument("--generation-config", default=_DEFAULTS.generation_config,
                   metavar="auto|vllm|FOLDER",
                   help="sampling defaults: the checkpoint's generation_config.json (auto), "
                   "none (vllm), or the one in FOLDER")
    p.add_argument("--gpu-backend", choices=GPU_BACKENDS, default=None,
                   help="CUDA kernels: triton (sm_80+) or portable torch/cuBLAS (default: auto; "
                   "same as DELTASERVE_GPU_BACKEND)")


def _tp_flags(p: argparse._ArgumentGroup, dtype_default: str) -> None:
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="tensor parallelism over N processes (started here, or by torchrun); "
                   "gloo on cpu, NCCL on cuda (one GPU each)")
    p.add_argument("--tp-compress", choices=["fp16", "bf16"], default=None,
                   help="16-bit transport of the FFN reductions, dynamically scaled (same as "
                   "DELTASERVE_TP_COMPRESS)")


def _pp_flags(p: argparse._ArgumentGroup, dtype_default: str) -> None:
    p.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int,
                   default=_DEFAULTS.pipeline_parallel_size, metavar="N",
                   help="pipeline parallelism: N processes, each a contiguous range of layers "
                   "(started like --tp; not combined with it)")
    p.add_argument("--pp-layers", default=None, metavar="N1,N2,...",
                   help="layers per pipeline rank, e.g. 10,14 (default: an even split)")


def _speculative_flags(p: argparse._ArgumentGroup, dtype_default: str) -> None:
    p.add_argument("--speculative", choices=["ngram", "mtp"], default=None,
                   help="speculative decoding for greedy requests: n-gram prompt lookup or the "
                   "checkpoint's MTP block (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts verified per step (default "
                   f"{SpeculativeConfig().num_speculative_tokens})")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative_config as JSON, e.g. '{\"method\": \"ngram\", "
                   "\"prompt_lookup_max\": 4}' (--speculative and --num-speculative-tokens win)")


def _batching_flags(p: argparse._ArgumentGroup, dtype_default: str) -> None:
    d = _DEFAULTS
    p.add_argument("--max-num-seqs", "-np", "--parallel", dest="max_num_seqs", type=int,
                   default=d.max_num_seqs, metavar="N",
                   help=f"sequences in flight together, one state slot each (default "
                   f"{d.max_num_seqs}; -np / --parallel as llama.cpp)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   metavar="N", help="per-step token budget, the longest prefill chunk (default: "
                   "8192 on CUDA unless its scratch would shorten the KV cache, else 2048)")
    p.add_argument("--max-queue", type=int, default=d.max_waiting, metavar="N",
                   help=f"requests waiting for a slot before new ones get 503 (default "
                   f"{d.max_waiting})")
    p.add_argument("--prefix-snapshots", default=d.prefix_snapshots, choices=PREFIX_SNAPSHOTS,
                   help="where prompts keep prefix-cache snapshots: their end and where they "
                   "branch from an earlier prompt (sparse, default), or every 64 tokens (grid)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, type=kv_dtype_arg,
                   metavar="DTYPE",
                   help=f"dtype of the attention layers' K/V pool: {', '.join(DTYPES)} (default "
                   "auto: the activation dtype; fp8 is refused)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="the exact prefix-state cache (default: on; "
                   "--no-enable-prefix-caching turns it off)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="CUDA: the share of the GPU's memory the engine may hold, the KV cache "
                   "grown to fill it (default: the KV cache capped at "
                   f"{d.kv_cache_bytes >> 30} GiB)")


def _image_flags(p: argparse._ArgumentGroup, dtype_default: str) -> None:
    lim = _DEFAULTS.image_limits
    p.add_argument("--max-images", type=int, default=lim.max_images,
                   help=f"images per request (vision models; more gets a 400; default "
                   f"{lim.max_images})")
    p.add_argument("--max-visual-tokens", type=int, default=lim.max_visual_tokens,
                   help="visual tokens per request (640 for one 9-slice image in 16x mode; "
                   f"default {lim.max_visual_tokens})")
    p.add_argument("--max-image-mb", type=float, default=lim.max_image_bytes / MIB,
                   help=f"encoded bytes per image, in MiB (default {lim.max_image_bytes / MIB:g})")
    p.add_argument("--max-image-mpx", type=float, default=lim.max_image_pixels / MPX,
                   help="decoded pixels per image, in megapixels, checked before decoding "
                   f"(default {lim.max_image_pixels / MPX:g})")


_FLAGS = {"model": _model_flags, "tp": _tp_flags, "pp": _pp_flags,
          "speculative": _speculative_flags, "batching": _batching_flags, "images": _image_flags}


def _check_vulkan(args: EngineArgs) -> None:
    """What the Vulkan backend does not run yet, refused before anything loads."""
    if args.dtype == "bfloat16":
        raise ConfigError("--device vulkan holds 16-bit weights as float16 (WGSL has no bf16; "
                          "bf16 checkpoints convert): pass --dtype float16")
    if args.dtype not in ("auto", "float32", "float16"):
        raise ConfigError(f"--device vulkan runs --dtype auto / float32 (fp32 weights) or "
                          f"float16, not {args.dtype}")
    if args.kv_cache_dtype not in ("auto", "float32"):
        raise ConfigError("--device vulkan keeps K/V in fp32 (--kv-cache-dtype auto)")
    for name, value in (("speculative decoding", args.speculative_config),
                        ("--tp", args.tensor_parallel_size not in (None, 1) or None),
                        ("--pp", args.pipeline_parallel_size != 1 or None)):
        if value is not None:
            raise ConfigError(f"--device vulkan does not run {name} yet")
    if args.gpu_memory_limit_gb is not None and args.gpu_memory_limit_gb <= 0:
        raise ConfigError(f"--gpu-memory-limit must be positive, got {args.gpu_memory_limit_gb}")
