"""GPTQ for the int4 (affine, group 64) format: `deltaserve quantize --format int4 --encoder gptq
--calibration TEXT`. Same file layout as every int4 encoder; only the codes and group pairs differ.

The plain encoders (quant/schemes.py) minimise each weight's own error. GPTQ (Frantar et al., 2022)
minimises the layer's output error over calibration inputs X, E||X (W - Q)^T||^2 = tr(D H D^T) with
H = X^T X / T and D = W - Q. Columns are quantized left to right; each column's error is spread over
the columns not yet quantized in the way H says best cancels it (the optimal brain surgeon update,
through the Cholesky factor U of H^-1: W[:, j+1:] -= e_j U[j, j+1:] / U[j, j]). A group's (scale, bias)
is fitted when the walk reaches the group, on the weights as updated so far (the least-squares search
of quant/schemes.affine_fit, weighted by diag(H)), so the stored layout stays MLX's.

Shapes: W [N, K] (N outputs, K inputs), H [K, K], G the group size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.quant.schemes import (
    AFFINE_ROWS_PER_PASS,
    Scheme,
    affine_codes,
    affine_fit,
    group_weights,
    pack_codes,
)

DAMP = 0.01  # H + DAMP * mean(live diag H) * I: keeps the inverse finite for rank-deficient inputs


def inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """U [K, K] upper triangular with U^T U = (H + damping)^-1, fp64 for the factorisations; the
    damping is DAMP times the mean of the live inputs' diagonal. Inputs that never fire (diag 0)
    get a unit diagonal and nothing off it: their weights take no error from elsewhere. A factor
    that cannot be computed (non-finite entries, not positive definite) is a ValueError."""
    if not torch.isfinite(h).all():
        raise ValueError("input covariance has non-finite entries")
    h = h.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, :] = 0.0
    h[:, dead] = 0.0
    diag = torch.diagonal(h)
    live_mean = diag[~dead].mean() if bool((~dead).any()) else torch.tensor(1.0, dtype=h.dtype)
    diag[dead] = 1.0
    diag[~dead] += DAMP * live_mean
    try:
        inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
        return torch.linalg.cholesky(inv, upper=True)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"the damped input covariance is not positive definite ({exc})") from None


def gptq_quantize(w: torch.Tensor, s: Scheme, h: torch.Tensor,
                  scale_dtype: torch.dtype = torch.float16,
                  factor: torch.Tensor | None = None,
                  progress: Callable[[int], object] | None = None) -> dict:
    """w [N, K] float, h [K, K] the input covariance -> {"weight", "scales", "biases"} as
    quant/schemes.quantize writes them for an affine scheme. factor: inverse_factor(h), when the
    caller has it (projections packed into one module share their input). progress(n): told of
    every n weights encoded."""
    if s.kind != "affine":
        raise ValueError(f"GPTQ here encodes affine (int4) groups, not {s.kind}")
    rows, cols = w.shape
    s.check_cols(cols, "weight")
    if h.shape != (cols, cols):
        raise ValueError(f"input covariance has shape {list(h.shape)}; the weight has {cols} inputs")
    u = (inverse_factor(h) if factor is None else factor).to(w.device, torch.float32)
    imp = group_weights(torch.diagonal(h).float(), cols, s.group_size).to(w.device)
    codes, scales, biases = [], [], []
    for part in w.float().split(AFFINE_ROWS_PER_PASS):
        q, scale, bias = _walk(part.clone(), u, imp, s, scale_dtype)
        codes.append(q)
        scales.append(scale)
        biases.append(bias)
        if progress is not None:
            progress(part.numel())
    q = torch.cat(codes).to(torch.int64)
    return {"weight": pack_codes(q, s.bits), "scales": torch.cat(scales),
            "biases": torch.cat(biases)}


def _walk(w: torch.Tensor, u: torch.Tensor, imp: torch.Tensor, s: Scheme,
          scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes w [R, K] in place, group by group: codes [R, K], scales and biases [R, K / G]."""
    rows, cols = w.shape
    size, levels = s.group_size, (1 << s.bits) - 1
    codes = torch.empty(rows, cols, device=w.device)
    scales = torch.empty(rows, cols // size, dtype=scale_dtype, device=w.device)
    biases = torch.empty(rows, cols // size, dtype=scale_dtype, device=w.device)
    for g in range(cols // size):
        lo, hi = g * size, (g + 1) * size
        scale, bias = affine_fit(w[:, lo:hi].reshape(rows, 1, size), levels, scale_dtype,
                                 imp[:, g : g + 1])
        scales[:, g], biases[:, g] = scale[:, 0], bias[:, 0]
        sf, bf = scale.float(), bias.float()
        err = torch.empty(rows, size, dtype=w.dtype, device=w.device)
        for j in range(lo, hi):
            q = affine_codes(w[:, j].reshape(rows, 1, 1), sf, bf, levels)[:, 0, 0]
            codes[:, j] = q
            e = (w[:, j] - (q * sf[:, 0] + bf[:, 0])) / u[j, j]
            err[:, j - lo] = e
            w[:, j + 1 : hi] -= e[:, None] * u[j, j + 1 : hi][None, :]
        if hi < cols:  # the group's errors reach the later groups in one product
            w[:, hi:] -= err @ u[lo:hi, hi:]
    return codes, scales, biases
