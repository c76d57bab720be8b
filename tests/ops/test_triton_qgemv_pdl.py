"""The quantized GEMV's PDL mode (programmatic dependent launch, Hopper) against the plain launch
and dequantize-then-F.linear, alone and as a chain in one CUDA graph (run on the H200)."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.ops import triton_qgemv
from deltaserve.ops.qgemv import qgemv_ref
from deltaserve.quant.schemes import FORMATS, quantize
from tests.ops.triton_device import KDEV, rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(KDEV != "cuda" or not triton_qgemv.pdl_supported(),
                       reason="needs Triton with launch_pdl and an sm_90+ CUDA GPU"),
]
MODES = ["wait", "block", "tile", "early", True]
# rows and columns no multiple of any tile: the masks on rows, groups and K-steps all work
SHAPES = [(37, 384), (1000, 1344), (8224, 1024)]


def packed(fmt: str, rows: int, cols: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
    return {k: (v.float() if v.is_floating_point() else v).to(KDEV)
            for k, v in quantize(w, FORMATS[fmt]).items()}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_pdl_mode_matches_the_plain_launch_and_the_reference(fmt, rows, cols, mode) -> None:
    scheme, p = FORMATS[fmt], packed(fmt, rows, cols, seed=rows + cols)
    x = torch.randn(1, cols, device=KDEV)
    out = torch.full((1, rows), float("nan"), device=KDEV)  # every row must be written
    triton_qgemv.qgemv_cuda(x, p, scheme, pdl=mode, out=out)
    plain, ref = triton_qgemv.qgemv_cuda(x, p, scheme), qgemv_ref(x, p, scheme)
    assert rel(out, ref) <= 1e-5
    assert rel(out, plain) <= 1e-5


def chain_steps(fmt: str) -> list[tuple[dict, int, int]]:
    """Mixed shapes; each step's K is at most the previous step's N (it reads that output)."""
    dims = [(1344, 384), (333, 1344), (2112, 320), (700, 2112), (1024, 640)]
    return [(packed(fmt, n, k, seed=i), n, k) for i, (n, k) in enumerate(dims)]


def capture(steps, scheme, bufs, mode):
    def run():
        for i, (p, n, k) in enumerate(steps):
            triton_qgemv.qgemv_cuda(bufs[i, :, :k], p, scheme, pdl=mode, out=bufs[i + 1, :, :n])

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("mode", MODES)
def test_pdl_chain_in_a_cuda_graph(fmt, mode) -> None:
    """Each GEMV reads the previous one's output: with the outputs poisoned before the replay, a
    read of x before the predecessor finished would show as NaN or as a mismatch."""
    scheme, steps = FORMATS[fmt], chain_steps(fmt)
    width = max(max(n, k) for _, n, k in steps)
    bufs = torch.randn(len(steps) + 1, 1, width, device=KDEV)
    graphs = {m: capture(steps, scheme, bufs, m) for m in (False, mode)}
    finals = {}
    for m, graph in graphs.items():
        for rep in range(3):
            for i, (_, n, _) in enumerate(steps):
                bufs[i + 1, :, :n].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for i, (p, n, k) in enumerate(steps):
                got, ref = bufs[i + 1, :, :n], qgemv_ref(bufs[i, :, :k], p, scheme)
                assert rel(got, ref) <= 1e-5, (m, rep, i)
        finals[m] = bufs[-1].clone()
    assert rel(finals[mode], finals[False]) <= 1e-5
