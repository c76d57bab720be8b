"""Quantized checkpoints on a CUDA GPU (Triton decode GEMV, dequantized prefill) vs the CPU engine."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cache.sequence import prompt_logits
from deltaserve.checkpoint.default import default_model_dir
from deltaserve.ops import triton_qgemv
from deltaserve.ops.native import isa_paths
from deltaserve.quant.convert import quantize_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_qgemv.available(), reason="needs CUDA and Triton"),
]
PROMPT = "import os\n\n\ndef list_python_files(path):\n"


@pytest.mark.parametrize("fmt", ["int8", "int4", "q1", "q1-int8-act"])
def test_quantized_model_on_cuda_matches_the_cpu_engine(tmp_path, monkeypatch, fmt) -> None:
    """Exact kernels on both sides (the CPU's int8 GEMVs otherwise round activations to int8 per
    group, ~0.6% rel-L2); q1-int8-act: both sides' q1 decode GEMVs on x rounded per 32 (the CPU's
    VNNI / AVX2 kernel and ops/triton_q1), the same math in another summation order."""
    if fmt == "q1-int8-act":
        fmt = "q1"
        if not {"vnni-int8", "avx2-q1"} & set(isa_paths()):
            pytest.skip("this CPU's kernels keep fp32 activations for q1")
    else:
        monkeypatch.setenv("DELTASERVE_EXACT_INT8_ACT", "1")
    quantize_checkpoint(default_model_dir(), fmt, tmp_path / fmt)
    engines = {d: LLM(tmp_path / fmt, dtype="float32", device=d) for d in ("cpu", "cuda")}
    ids = engines["cpu"].tokenizer.encode(PROMPT)
    logits = {d: prompt_logits(e.model, torch.tensor([ids], device=d))[None].cpu()
              for d, e in engines.items()}
    assert ((logits["cuda"] - logits["cpu"]).norm() / logits["cpu"].norm()).item() <= 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {d: e.generate(PROMPT, params)[0].outputs[0].token_ids for d, e in engines.items()}
    assert tokens["cuda"] == tokens["cpu"]
