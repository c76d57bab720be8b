"""Decode GEMV on packed int8 / 4-bit affine / 1-bit (q1) weights for CUDA GPUs (Triton), fp32
accumulation.

One program computes BLOCK_N output rows and walks K in steps of BLOCK_K columns (BLOCK_K / G
quantization groups per step): per group a dot of codes and x, times the row's group scale, plus
bias times the group's sum of x. int4 words (8 codes, low bits first) are never reshaped: the j-th
nibble of every word meets x at positions 8*i + j, a strided load of x from L1. q1 reads its bytes
as int32 words (32 signs, lowest bit first) the same way: bit j of a word moved to the sign position
and xor-ed into x's bits gives +-x, so a group's sum is sum(b ? -x : x) = sum(x) - 2 sum(b x), and
w . x = s (2 sum(b x) - sum(x)) = -s * that sum: four integer / float ops per weight, no conversion.

The reference is ops/qgemv.qgemv_ref (dequantize, then F.linear). The launch configuration per
shape comes from TUNED, written from scripts/gpu/qgemv_tune.py's H200 run (see that table).
Measured there: int8 codes convert faster by the 2**23 mantissa trick (MAGIC) than by int-to-float;
int4 codes do not (its bound is the integer shift/mask work, not the conversion). MAGIC 2 builds the
same fp32 2**23 + code with one PTX byte permute (prmt) per code: for int8 it replaces an extract
and an add, for int4 a shift and a mask per nibble (two masks and a shift per word remain). In one
sweep of the PDL chains it was 2-4% faster on 4 of 5 int8 shapes (5120 rows keeps MAGIC 1) and 3-13%
on every int4 shape; TUNED_PDL takes it where it won. MAGIC 4 (int4) builds 0.5 + n / 32 instead
(the nibble under 0x3F000000, one shift and mask per word half, one prmt per nibble) and multiplies
it into x as is: no subtraction per nibble, sum(x) / 2 comes off once per group (int8 reads 4 as
2); 4-5% faster than MAGIC 2 on the big int4 shapes, rel err ~1.5e-6 instead of ~5e-7.

PDL mode (qgemv_cuda(..., pdl=...), Hopper): a layer's 2-8 MB matrix streams in ~1 us, less than
one launch plus the first DRAM round trip, so back-to-back GEMVs are launch/latency bound. Launched
with programmatic dependent launch, a GEMV loads its weights (static) before griddepcontrol.wait
and only x (the previous kernel's output) after it, so its weight stream overlaps the
predecessor's tail. Measured by scripts/gpu/qgemv_chain.py.
"""

from __future__ import annotations

import torch

from deltaserve.ops import gemv_prologue, tuning
from deltaserve.ops.backend import pdl_enabled, pdl_launch, pdl_supported, tl, triton
from deltaserve.ops.backend import triton_enabled as available  # noqa: F401 (callers ask here)

if triton is not None:
    from deltaserve.ops.backend import gdc_launch_dependents, gdc_wait
    from deltaserve.ops.gemv_prologue import rstd_of, x_at

    @triton.jit
    def _nibbles_magic(q):
        """int4 words -> 8 fp32 tensors 2**23 + nibble j (j = 0..7, lowest bits first): two masks
        and a shift per word, then one byte permute per nibble (PTX prmt) puts it under 0x4B."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; and.b32 lo, $8, 0x0F0F0F0F; shr.u32 hi, $8, 4; "
            "and.b32 hi, hi, 0x0F0F0F0F; "
            "prmt.b32 $0, lo, 0x4B000000, 0x7540; prmt.b32 $1, hi, 0x4B000000, 0x7540; "
            "prmt.b32 $2, lo, 0x4B000000, 0x7541; prmt.b32 $3, hi, 0x4B000000, 0x7541; "
            "prmt.b32 $4, lo, 0x4B000000, 0x7542; prmt.b32 $5, hi, 0x4B000000, 0x7542; "
            "prmt.b32 $6, lo, 0x4B000000, 0x7543; prmt.b32 $7, hi, 0x4B000000, 0x7543; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [q], dtype=(tl.float32,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _nibbles_half(q):
        """int4 words -> 8 fp32 tensors 0.5 + nibble j / 32 (lowest bits first): each nibble
        moved to bits 3-6 of its byte (a shift and a mask per word and half), then one byte
        permute per nibble puts that byte under 0x3F: 0x3F000000 | n << 19. No subtraction per
        nibble: the caller takes sum(x) / 2 off each group's dot once (MAGIC 4)."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; shl.b32 lo, $8, 3; and.b32 lo, lo, 0x78787878; "
            "shr.b32 hi, $8, 1; and.b32 hi, hi, 0x78787878; "
            "prmt.b32 $0, lo, 0x3F000000, 0x7044; prmt.b32 $1, hi, 0x3F000000, 0x7044; "
            "prmt.b32 $2, lo, 0x3F000000, 0x7144; prmt.b32 $3, hi, 0x3F000000, 0x7144; "
            "prmt.b32 $4, lo, 0x3F000000, 0x7244; prmt.b32 $5, hi, 0x3F000000, 0x7244; "
            "prmt.b32 $6, lo, 0x3F000000, 0x7344; prmt.b32 $7, hi, 0x3F000000, 0x7344; }",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [q], dtype=(tl.float32,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _bytes_magic(q):
        """int8 codes (four to a register) -> fp32 2**23 + 128 + q: the sign bit flipped once per
        four codes, then one byte permute per code (PTX prmt) puts it under 0x4B."""
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; xor.b32 t, $4, 0x80808080; "
            "prmt.b32 $0, t, 0x4B000000, 0x7540; prmt.b32 $1, t, 0x4B000000, 0x7541; "
            "prmt.b32 $2, t, 0x4B000000, 0x7542; prmt.b32 $3, t, 0x4B000000, 0x7543; }",
            "=r,=r,=r,=r,r", [q], dtype=tl.float32, is_pure=True, pack=4)

    @triton.jit
    def _to_float(q, BITS: tl.constexpr, MAGIC: tl.constexpr):
        """Codes to fp32. MAGIC: put the code into the mantissa of 2**23 and subtract, two full-rate
        ops instead of an int-to-float conversion (a quarter-rate unit on recent GPUs); MAGIC 2
        (int8) builds 2**23 + 128 + q with one byte permute instead of an extract and an add."""
        if MAGIC >= 2 and BITS == 8:  # int8 reads MAGIC 4 (an int4 form) as 2
            out = _bytes_magic(q) - 8388736.0
        elif MAGIC:
            if BITS == 8:  # int8 q: 0x4B000080 + q is 2**23 + 128 + q as fp32 bits, exactly
                out = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
            else:  # q in [0, 15]
                out = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            out = q.to(tl.float32)
        return out

    @triton.jit
    def _weights(W, S, B, rows, row_ok, k0, K, num_groups, G: tl.constexpr, BITS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr):
        """One K-step's static operands: codes, scales, biases. No kernel writes them, so under PDL
        they may be loaded before gdc_wait (only x comes from the previous kernel)."""
        NG: tl.constexpr = BLOCK_K // G
        gidx = k0 // G + tl.arange(0, NG)
        g_ok = row_ok[:, None] & (gidx < num_groups)[None, :]
        g_off = rows[:, None] * num_groups + gidx[None, :]
        if BITS == 8:
            cols = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(W + rows[:, None] * K + cols[None, :],
                        mask=row_ok[:, None] & (cols < K)[None, :], other=0)
        else:  # 32-bit words of 32 // BITS codes
            PER: tl.constexpr = 32 // BITS
            wcols = k0 // PER + tl.arange(0, BLOCK_K // PER)
            q = tl.load(W + rows[:, None] * (K // PER) + wcols[None, :],
                        mask=row_ok[:, None] & (wcols * PER < K)[None, :], other=0)
        s = tl.load(S + g_off, mask=g_ok, other=0.0)
        if HAS_BIAS:
            b = tl.load(B + g_off, mask=g_ok, other=0.0)
        else:
            b = s  # unused
        return q, s, b

    @triton.jit
    def _step(acc, q, s, b, X, R, NW, rstd, offset, k0, K, G: tl.constexpr, BITS: tl.constexpr,
              HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              MAGIC: tl.constexpr, XMODE: tl.constexpr):
        """acc [BLOCK_N, BLOCK_K / G] += one K-step: per group a dot of codes and x, times the
        group scale, plus bias times the group's sum of x. Reads x (through the prologue, XMODE:
        ops/gemv_prologue), so it runs after gdc_wait."""
        NG: tl.constexpr = BLOCK_K // G
        if BITS == 8:
            cols = k0 + tl.arange(0, BLOCK_K)
            x = x_at(X, R, NW, cols, cols < K, K, rstd, offset, XMODE)
            part = tl.sum(tl.reshape(_to_float(q, 8, MAGIC) * x[None, :], (BLOCK_N, NG, G)), axis=2)
        elif BITS == 1:  # sum(b ? -x : x) per group (module docstring); its negation times s
            # x read once, contiguously, as [words, 32] fp32 bits; each word's 32 bits spread
            # over the last axis (a strided x load per bit ran 3x slower than int4 in decode)
            cols = k0 + tl.arange(0, BLOCK_K)
            x = x_at(X, R, NW, cols, cols < K, K, rstd, offset, XMODE)
            xbits = tl.reshape(x.to(tl.int32, bitcast=True), (BLOCK_K // 32, 32))
            shifts = tl.arange(0, 32)
            signs = (q[:, :, None] >> shifts[None, None, :]) << 31
            words = tl.sum((signs ^ xbits[None, :, :]).to(tl.float32, bitcast=True), axis=2)
            part = -tl.sum(tl.reshape(words, (BLOCK_N, NG, G // 32)), axis=2)
        else:
            wcols = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            w_ok = wcols * 8 < K
            prod = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
            if MAGIC == 2:  # all 8 nibbles of each word at once (_nibbles_magic)
                nib = _nibbles_magic(q)
            elif MAGIC == 4:  # 0.5 + n / 32 (_nibbles_half)
                nib = _nibbles_half(q)
            for j in tl.static_range(8):
                xj = x_at(X, R, NW, wcols * 8 + j, w_ok, K, rstd, offset, XMODE)
                if MAGIC == 2:
                    prod += (nib[j] - 8388608.0) * xj[None, :]
                elif MAGIC == 4:
                    prod += nib[j] * xj[None, :]
                else:
                    prod += _to_float((q >> (4 * j)) & 0xF, 4, MAGIC) * xj[None, :]
            part = tl.sum(tl.reshape(prod, (BLOCK_N, NG, G // 8)), axis=2)
        if HAS_BIAS or (BITS == 4 and MAGIC == 4):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = x_at(X, R, NW, cols, cols < K, K, rstd, offset, XMODE)
            x_sum = tl.sum(tl.reshape(x, (NG, G)), axis=1)[None, :]
        if BITS == 4 and MAGIC == 4:  # sum((0.5 + n/32) x) - sum(x) / 2 = sum(n x) / 32, per group
            acc += (part - 0.5 * x_sum) * (s * 32.0)
        else:
            acc += part * s
        if HAS_BIAS:
            acc += b * x_sum
        return acc

    @triton.jit
    def _gemv_kernel(W, S, B, X, Y, YI, N, K, R, NW, TOTAL, eps, offset, G: tl.constexpr,
                     BITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, ARGMAX: tl.constexpr,
                     PDL: tl.constexpr, XMODE: tl.constexpr, NORM_BLOCK: tl.constexpr,
                     ONE_STEP: tl.constexpr = False):
        """PDL (programmatic dependent launch, launched with launch_pdl): 0 off; 1 gdc_wait first
        (the launch overlaps the predecessor's tail); 2 the first K-step's weights are loaded
        before the wait, so this kernel's DRAM round trip overlaps the predecessor; 3 as 2, and
        the dependents are released before this kernel's own wait (a deeper pipeline). 1 and 2
        release the next kernel right after the wait: at most two GEMVs overlap.
        ONE_STEP (BLOCK_K >= K, PDL >= 2): the step before the wait is all of K, and the K loop
        is not compiled. Even when it never runs, it held registers: the int4 [16, 1024] tile
        took 96 per thread with it and 72 without."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        num_groups = K // G
        acc = tl.zeros([BLOCK_N, BLOCK_K // G], dtype=tl.float32)
        k_start = 0
        if PDL == 3:
            gdc_launch_dependents()
        if PDL >= 2:
            q0, s0, b0 = _weights(W, S, B, rows, row_ok, 0, K, num_groups, G, BITS, HAS_BIAS,
                                  BLOCK_K)
        if PDL != 0:
            gdc_wait()  # the predecessor is complete and its writes (our x) are visible
            if PDL != 3:
                gdc_launch_dependents()
        rstd = rstd_of(X, R, K, eps, TOTAL, pid, XMODE, NORM_BLOCK)
        if PDL >= 2:
            acc = _step(acc, q0, s0, b0, X, R, NW, rstd, offset, 0, K, G, BITS, HAS_BIAS, BLOCK_N,
                        BLOCK_K, MAGIC, XMODE)
            k_start = BLOCK_K
        if not ONE_STEP or PDL < 2:
            for k0 in range(k_start, K, BLOCK_K):
                q, s, b = _weights(W, S, B, rows, row_ok, k0, K, num_groups, G, BITS, HAS_BIAS,
                                   BLOCK_K)
                acc = _step(acc, q, s, b, X, R, NW, rstd, offset, k0, K, G, BITS, HAS_BIAS,
                            BLOCK_N, BLOCK_K, MAGIC, XMODE)
        y = tl.sum(acc, axis=1)
        if ARGMAX:  # the greedy head: this block's maximum and its row, not the logits
            y = tl.where(row_ok, y, float("-inf"))
            tl.store(Y + pid, tl.max(y, 0))
            tl.store(YI + pid, pid * BLOCK_N + tl.argmax(y, 0, tie_break_left=True))
        else:
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


# (bits, K, N window [lo, hi)) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, magic): the best
# L2-cold config per Qwen3.5-0.8B decode shape on one H200 (every int8 / int4 entry beat bf16
# cuBLAS on its shape; int4 rows take MAGIC 4 nibble conversions; q1 is bound by sign work, so
# launch shapes move it little). TUNED_ARGMAX: the greedy head's GEMV where it differs (int4
# 32 x 512 tiles). Shapes outside every window take DEFAULT, the best config on the 6144x1024
# shape. Data with provenance per row: ops/tuning/h200-triton-qgemv{,-argmax}.json
# (`python scripts/gpu/qgemv_tune.py`).
Config = tuple[int, int, int, int, int]
TUNED: dict[tuple[int, int, int, int], Config] = tuning.table("h200-triton-qgemv")
TUNED_ARGMAX: dict[tuple[int, int, int, int], Config] = tuning.table("h200-triton-qgemv-argmax")
DEFAULT: dict[int, Config] = {8: (8, 512, 4, 1, 1), 4: (8, 1024, 4, 1, 0), 1: (8, 1024, 4, 1, 0)}


def supports(scheme) -> bool:
    """The packed layouts this kernel reads: int8, 4-bit affine, and q1 in power-of-two groups
    of whole int32 words."""
    if scheme.kind == "q1":
        g = scheme.group_size
        return g % 32 == 0 and g & (g - 1) == 0
    return (scheme.kind, scheme.bits) in (("int8", 8), ("affine", 4))


# pdl=True / "tile": the best launch shape and code conversion per Qwen3.5-0.8B shape in a chain
# of GEMVs of that shape in one CUDA graph (L2-cold), BLOCK_K widened to all of K: wider programs
# than TUNED leave room on the SMs for the next GEMV's programs to prefetch. Data with provenance:
# ops/tuning/h200-triton-qgemv-pdl.json (`python scripts/gpu/qgemv_chain.py --sweep`).
TUNED_PDL: dict[tuple[int, int, int, int], Config] = tuning.table("h200-triton-qgemv-pdl")


def config_for(bits: int, n: int, k: int, table: dict | None = None) -> Config:
    """The launch config for a shape: `table` (TUNED_PDL, TUNED_ARGMAX) first when given, then TUNED."""
    for t in (table or {}, TUNED):
        for (b, kk, lo, hi), cfg in t.items():
            if b == bits and kk == k and lo <= n < hi:
                return cfg
    return DEFAULT[bits]


# pdl keyword -> the kernel's PDL constexpr. True is "tile": the mode that overlaps the most.
PDL_MODES = {"wait": 1, "block": 2, "tile": 2, "early": 3}
_TILE_BYTES_PER_THREAD = 128  # a whole [BLOCK_N, K] tile held in registers: at most 32 per thread


def whole_k_config(config: Config, bits: int, k: int) -> Config:
    """config with BLOCK_K covering all of K (next power of two) when that tile's codes stay
    within _TILE_BYTES_PER_THREAD: PDL then loads every weight of the program before its wait."""
    block_n, block_k, warps, stages, magic = config
    if bits == 1:  # q1's registers go to the [rows, words, 32] sign tile, not to its codes
        return config
    whole = triton.next_power_of_2(k)
    if block_n * whole * bits // 8 > _TILE_BYTES_PER_THREAD * 32 * warps:
        return config
    return block_n, max(block_k, whole), warps, stages, magic


def qgemv_cuda(x: torch.Tensor, p: dict, scheme, config: Config | None = None,
               pdl: bool | str | None = None, out: torch.Tensor | None = None,
               prologue: gemv_prologue.Prologue | None = None) -> torch.Tensor:
    """x [1, K] on CUDA (fp32 or 16-bit; the math is fp32), packed int8, 4-bit affine or q1 weights
    -> [1, N] in x's dtype (no cast kernels around the GEMV), into `out` when given. prologue
    (ops/gemv_prologue): the GEMV reads rms_norm(residual + x) or silu(gate) * up of x instead.

    pdl (Hopper, for GEMVs that follow each other in a stream or CUDA graph): False; True or
    "tile" (whole-K tile loaded before the wait where it fits, else as "block"); "block" (the
    first K-step before the wait); "wait" (wait first); "early" ("tile", and the next kernel is
    released before this one's wait). Ignored where pdl_supported() is False. Without a config,
    True / "tile" take TUNED_PDL's launch shapes. None: "tile" where the engine's decode kernels
    launch with PDL (ops/backend.pdl_enabled), else False."""
    if pdl is None:  # an explicit config runs as given (tests, sweeps); the engine passes none
        pdl = "tile" if pdl_enabled() and config is None else False
    w = _words(p, scheme)
    n, k = w.shape[0], gemv_prologue.gemv_cols(x, prologue)
    if p["scales"].shape[-1] * scheme.group_size != k:
        raise ValueError(f"qgemv_cuda: x gives {k} inputs, the packed weight has "
                         f"{p['scales'].shape[-1] * scheme.group_size}")
    gemv_prologue.check(x, prologue, k)
    table = TUNED_PDL if pdl in (True, "tile") else None
    config = config or config_for(scheme.bits, n, k, table)
    y = out if out is not None else torch.empty(1, n, dtype=x.dtype, device=x.device)
    _launch(x, p, scheme, w, y, y, config, False, pdl, prologue)
    return y


def qgemv_argmax_cuda(x: torch.Tensor, p: dict, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV with the greedy head's epilogue: x [1, K] -> per block of BLOCK_N rows the largest
    logit and its row (first on ties), ([1, blocks] fp32, [1, blocks] int32)."""
    w = _words(p, scheme)
    config = config_for(scheme.bits, w.shape[0], x.shape[-1], TUNED_ARGMAX)
    blocks = triton.cdiv(w.shape[0], config[0])
    vals = torch.empty(1, blocks, dtype=torch.float32, device=x.device)
    idx = torch.empty(1, blocks, dtype=torch.int32, device=x.device)
    _launch(x, p, scheme, w, vals, idx, config, True, "block" if pdl_enabled() else False)
    return vals, idx


def _words(p: dict, scheme) -> torch.Tensor:
    """The packed weight as the kernel loads it: int8 codes, or int32 words (int4: uint32 words;
    q1: uint8 bytes, four to a word, lowest byte first, so bit j of word i is element 32 i + j)."""
    w = p["weight"]
    if not w.is_contiguous():  # (a copy here would be read before a PDL wait: loaded ones are)
        raise ValueError("qgemv_cuda: packed weights must be contiguous")
    return w if scheme.kind == "int8" else w.view(torch.int32)


def _launch(x, p: dict, scheme, w: torch.Tensor, y: torch.Tensor, yi: torch.Tensor,
            config: Config, argmax: bool, pdl: bool | str = False,
            prologue: gemv_prologue.Prologue | None = None):
    """Launches the kernel; returns Triton's compiled-kernel handle (its .asm for inspection)."""
    mode = PDL_MODES["tile" if pdl is True else pdl] if pdl and pdl_supported() else 0
    n, k = w.shape[0], gemv_prologue.gemv_cols(x, prologue)
    x = x.contiguous()
    if pdl in (True, "tile", "early") and mode:
        config = whole_k_config(config, scheme.bits, k)
    block_n, block_k, warps, stages, magic = config
    block_k = max(block_k, scheme.group_size)
    biases = p.get("biases", p["scales"])
    return _gemv_kernel[(triton.cdiv(n, block_n),)](
        w, p["scales"], biases, x, y, yi, n, k, **gemv_prologue.kernel_args(x, prologue),
        G=scheme.group_size,
        BITS=scheme.bits, HAS_BIAS=scheme.has_biases(), BLOCK_N=block_n, BLOCK_K=block_k,
        MAGIC=magic, ARGMAX=argmax, PDL=mode, ONE_STEP=mode >= 2 and block_k >= k,
        num_warps=warps, num_stages=stages, **pdl_launch(bool(mode)))
