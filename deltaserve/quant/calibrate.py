"""Input importance for the int4 encoder (`deltaserve quantize --calibration FILE`): the mean square of
each quantized module's input, per input column, over calibration text run through the float model
(llama.cpp's importance matrix). The encoder then weighs a weight's squared error by its column's
importance: E[(dw . x)^2] = sum_k dw_k^2 E[x_k^2] when the columns are uncorrelated, the error the
layer's output sees. The tied embedding's importance is the head's input (the final-normed hidden).

With `--encoder gptq` the same run collects each Linear's full input covariance E[x x^T] instead,
GPTQ's H (quant/gptq.py), which also sees how the columns correlate.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from deltaserve.cache.sequence import Sequence
from deltaserve.errors import ConfigError
from deltaserve.progress import track

MIN_TOKENS = 64  # fewer calibration tokens give importances that mostly reflect noise
CHUNK_TOKENS = 512  # prefill chunk of the calibration run (bounds its activations)


def read_calibration(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read calibration text {path}: {exc}") from None
    if not text.strip():
        raise ConfigError(f"calibration text {path} is empty")
    return text


COVARIANCE_MEMORY_SHARE = 0.8  # of the memory available once the float model is loaded


def check_covariance_memory(widths: list[int]) -> None:
    """GPTQ holds one fp32 [K, K] covariance per Linear for the whole conversion (they grow with
    the square of each input's width): refuse, before the calibration run, where they would not
    fit beside the loaded float model."""
    from deltaserve.cache.memory import available_bytes

    need, have = sum(4 * k * k for k in widths), available_bytes(torch.device("cpu"))
    if need > COVARIANCE_MEMORY_SHARE * have:
        raise ConfigError(
            f"GPTQ's input covariances need {need / 2**30:.1f} GiB ({len(widths)} projections, "
            f"inputs up to {max(widths)} wide); {have / 2**30:.1f} GiB of memory is available. "
            f"Use --encoder search with --calibration (a [K] importance per projection), or a "
            f"machine with more memory")


def input_importance(model_dir: Path, text: str, max_tokens: int = 4096) -> dict[str, torch.Tensor]:
    """The quantizer's module name of each checkpoint projection (`model.layers.0.mlp.down_proj`,
    `model.embed_tokens`; quant/convert.py) -> [K] fp32 mean square of its input over the first
    max_tokens tokens of text (fp32 model on CPU)."""
    return input_statistics(model_dir, text, max_tokens, covariance=False)


def input_statistics(model_dir: Path, text: str, max_tokens: int = 4096,
                     covariance: bool = False) -> dict[str, torch.Tensor]:
    """As input_importance; covariance=True: every Linear's entry is the mean of x x^T [K, K]
    instead (GPTQ's H, quant/gptq.py), while an embedding table (which the tied head reads) keeps
    its [K] mean square: the search encodes it, as a lookup table GPTQ's error spreading would
    hurt. Projections packed into one module share one tensor."""
    from deltaserve.engine.llm import LLM

    llm = LLM(model_dir, dtype="float32", prefix_cache_bytes=0, tensor_parallel_size=1)
    # (tokenizing the whole of a long file would cost more than the run: a token averages a few
    # characters, so 64 per token keeps more than max_tokens)
    ids = llm.tokenizer.encode(text[: max_tokens * 64])[:max_tokens]
    if len(ids) < MIN_TOKENS:
        raise ConfigError(f"the calibration text has {len(ids)} tokens; at least {MIN_TOKENS} "
                          f"are needed")
    model = llm.model
    if covariance:
        _check_covariances(model, len(ids))
    sums: dict[tuple[str, ...], torch.Tensor] = {}
    counts: dict[tuple[str, ...], int] = {}

    def add(names: tuple[str, ...], x: torch.Tensor, full: bool) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        sums[names] = sums.get(names, 0) + (x.T @ x if full else x.square().sum(0))
        counts[names] = counts.get(names, 0) + x.shape[0]

    hooks, head = _hook_inputs(model, add, covariance)
    try:
        seq = Sequence(model, len(ids))
        with torch.inference_mode():
            for start in track(range(0, len(ids), CHUNK_TOKENS), "calibrating", unit="chunk"):
                h = seq.hidden(ids[start : start + CHUNK_TOKENS])
                if head is not None:
                    add(head[0], h, head[1])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for names, total in sums.items():
        mean = total / counts[names]  # one tensor for the projections packed into one module
        out.update(dict.fromkeys(names, mean))
    return out


def _check_covariances(model, num_tokens: int) -> None:
    """Before the run: the covariances must fit (check_covariance_memory); fewer tokens than a
    projection's inputs leave its covariance rank-deficient, which is worth a warning."""
    from deltaserve.layers.linear import Linear

    widths = [m.weight.shape[1] for m in model.modules() if isinstance(m, Linear)]
    check_covariance_memory(widths)
    if num_tokens < max(widths):
        warnings.warn(f"{num_tokens} calibration tokens for inputs up to {max(widths)} wide: the "
                      f"input covariances are rank-deficient (damping keeps them invertible); "
                      f"GPTQ does better with more tokens than inputs", stacklevel=3)


def _hook_inputs(model, add, covariance: bool):
    """Pre-hooks on every Linear that pass its input (after its prologue, as the layer computes it)
    to add(names, x, full); the head's (names, full) for the caller, which feeds it the final
    hidden states. Returns (hooks, head)."""
    from deltaserve.layers.linear import Linear
    from deltaserve.ops.gemv_prologue import apply_ref
    from deltaserve.quant.loading import module_checkpoint_names

    hooks, head = [], None
    for module, names in module_checkpoint_names(model):
        full = covariance and isinstance(module, Linear)
        if module is model.head:
            head = (tuple(names), full)
        elif isinstance(module, Linear):
            def hook(mod, args, kwargs, names=tuple(names), full=full) -> None:
                prologue = args[1] if len(args) > 1 else kwargs.get("prologue")
                add(names, apply_ref(args[0], prologue), full)

            hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return hooks, head
