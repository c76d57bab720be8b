"""Weights on the Vulkan device in the engine's formats, and the two kernels that read them: the
GEMV (y = x W^T for a step's rows) and the embedding gather (rows of W by token id).

Formats (quant/schemes.py): f32; f16 (two to a u32 word, low half first; --dtype float16);
int8 (codes four to a u32 word, one scale per group); affine
4-bit (eight codes to a word, low bits first, scale and bias per group); q1 (32 signs to a word,
w = s (2b - 1)). Scales and biases are held as f32. A weight past the adapter's largest binding is
held as row parts, its codes, scales and biases cut at the same rows (vulkan/device.py).
Reference: quant.schemes.dequantize, then F.linear / F.embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from deltaserve.errors import ConfigError
from deltaserve.vulkan.device import Recorder, Tensor, VulkanDevice

GRID_X = 32768


@dataclass
class Weight:
    """W [N, K]: kind "f32" | "f16" | "int8" | "affine" (4-bit) | "q1"; codes [N, words] u32
    (f32 / f16: the values), scales / biases [N, K / group] f32 (None where the format has none)."""

    kind: str
    n: int
    k: int
    group: int
    codes: Tensor
    scales: Tensor | None = None
    biases: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.biases) if t is not None)


PER_WORD = {"f32": 1, "int8": 4, "affine": 8, "q1": 32, "f16": 2}


def upload_weight(dev: VulkanDevice, module, name: str, table: torch.Tensor | None = None,
                  half: bool = False) -> Weight:
    """A Linear's or embedding's weight (dense or packed by quant/linear) onto the device; a
    dense one as f16 where `half`."""
    scheme = getattr(module, "scheme", None)
    if getattr(module, "segments", None) or getattr(module, "input_order", None) is not None:
        raise ConfigError(f"--device vulkan: {name} is packed from differently quantized parts "
                          "(a GGUF file); its layout has no Vulkan kernel yet")
    if scheme is None:
        w = (module.weight if table is None else table).detach().float()
        if not half:
            return Weight("f32", w.shape[0], w.shape[1], 1, *dev.upload_rows([w]))
        return _half(dev, w, name)
    if scheme.is_block() or (scheme.kind == "affine" and scheme.bits != 4):
        raise ConfigError(f"--device vulkan: {name} is {scheme.kind} {scheme.bits}-bit; the "
                          "Vulkan kernels read int8, 4-bit affine and q1")
    codes = module.weight.detach().contiguous().view(torch.int32)
    n, k = module.weight.shape[0], module.in_cols
    parts = [codes, module.scales.detach().float()]
    if scheme.has_biases():
        parts.append(module.biases.detach().float())
    if k % PER_WORD[scheme.kind] or scheme.group_size % PER_WORD[scheme.kind]:
        raise ConfigError(f"--device vulkan: {name}'s groups of {scheme.group_size} do not hold "
                          "whole code words")
    return Weight(scheme.kind, n, k, scheme.group_size, *dev.upload_rows(parts, "i32"))


def _half(dev: VulkanDevice, w: torch.Tensor, name: str) -> Weight:
    """W [N, K] as f16 pairs in u32 words (K even); values past f16's range are refused."""
    w16 = w.to(torch.float16)
    if torch.isinf(w16).any() and not torch.isinf(w).any():
        raise ConfigError(f"--dtype float16: {name} holds values past float16's range "
                          f"(max |w| {w.abs().max().item():.3g}); run it with --dtype float32")
    if w.shape[1] % 2:
        raise ConfigError(f"--dtype float16: {name} has an odd row length {w.shape[1]}")
    return Weight("f16", w.shape[0], w.shape[1], 1,
                  *dev.upload_rows([w16.contiguous().view(torch.int32)], "i32"))


_WORD_DOT = """
const KIND: u32 = {KIND}u;  // 0 f32, 1 int8, 2 affine 4-bit, 3 q1, 4 f16
const PER: u32 = {PER}u;  // elements per word
// the dot of word i of row n (elements i*PER ..) with x from xb; f32: the value times x
fn word_dot(n: u32, i: u32, xb: u32) -> f32 {{
  let wi = n * p.words + i;
  if (KIND == 0u) {{ return bitcast<f32>(codes[wi]) * x[xb + i]; }}
  if (KIND == 4u) {{
    let h = unpack2x16float(codes[wi]);
    return h.x * x[xb + 2u * i] + h.y * x[xb + 2u * i + 1u];
  }}
  let word = codes[wi];
  let e0 = i * PER;
  let g = n * (p.k / p.group) + e0 / p.group;
  var acc = 0.0;
  var xs = 0.0;
  for (var j = 0u; j < PER; j++) {{
    let xv = x[xb + e0 + j];
    var q = 0.0;
    if (KIND == 1u) {{ q = f32((i32(word << (24u - 8u * j))) >> 24u); }}
    else if (KIND == 2u) {{ q = f32((word >> (4u * j)) & 15u); xs += xv; }}
    else {{ q = f32((word >> j) & 1u) * 2.0 - 1.0; }}
    acc += q * xv;
  }}
  var out = acc * scales[g];
  if (KIND == 2u) {{ out += biases[g] * xs; }}
  return out;
}}
"""

_ELEM = """
const KIND: u32 = {KIND}u;
const PER: u32 = {PER}u;
fn elem(n: u32, e: u32) -> f32 {{
  let wi = n * p.words + e / PER;
  if (KIND == 0u) {{ return bitcast<f32>(codes[wi]); }}
  if (KIND == 4u) {{ return unpack2x16float(codes[wi])[e % 2u]; }}
  let word = codes[wi];
  let j = e % PER;
  let g = n * (p.k / p.group) + e / p.group;
  var q = 0.0;
  if (KIND == 1u) {{ q = f32((i32(word << (24u - 8u * j))) >> 24u); }}
  else if (KIND == 2u) {{ q = f32((word >> (4u * j)) & 15u); }}
  else {{ q = f32((word >> j) & 1u) * 2.0 - 1.0; }}
  var w = q * scales[g];
  if (KIND == 2u) {{ w += biases[g]; }}
  return w;
}}
"""

_BINDINGS = """
struct P {{ rows: u32, k: u32, words: u32, group: u32, y_stride: u32, y_off: u32, x_stride: u32,
            m: u32 }};
@group(0) @binding(0) var<storage, read> codes: array<u32>;
@group(0) @binding(1) var<storage, read> scales: array<f32>;
@group(0) @binding(2) var<storage, read> biases: array<f32>;
@group(0) @binding(3) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> p: P;
"""

GEMV = _BINDINGS + _WORD_DOT + """
const LPR: u32 = {LPR}u;  // lanes per output row; 256 / LPR rows per workgroup
const MR: u32 = {MR}u;  // the activation rows (= p.m; a pipeline per row count): each weight word
                        // read once for all of them
var<workgroup> part: array<f32, 256>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
  let n = (g.x + g.y * 32768u) * (256u / LPR) + t / LPR;
  let lane = t % LPR;
  // constant loop bounds: unrolled, s stays in registers (a runtime bound would index it
  // dynamically, from local memory; a guard per row cost lavapipe 2.5x at one row)
  var s: array<f32, MR>;
  if (n < p.rows) {{
    for (var i = lane; i < p.words; i += LPR) {{
      for (var r = 0u; r < MR; r++) {{ s[r] += word_dot(n, i, r * p.x_stride); }}
    }}
  }}
  for (var r = 0u; r < MR; r++) {{
    part[t] = s[r];
    workgroupBarrier();
    for (var h = LPR / 2u; h > 0u; h >>= 1u) {{
      if (lane < h) {{ part[t] += part[t + h]; }}
      workgroupBarrier();
    }}
    if (lane == 0u && n < p.rows) {{ y[r * p.y_stride + p.y_off + n] = part[t]; }}
    workgroupBarrier();
  }}
}}
"""

def _unrolled_tile() -> tuple[str, str, str]:
    """The GEMM's 4 x 4 outputs a thread as scalar registers, written out (no private arrays
    for a driver to leave in local memory): declarations, the update per k, the stores."""
    decl = "".join(f"  var c{i}{j} = 0.0;\n" for i in range(4) for j in range(4))
    load = "".join(f"      let a{i} = xs[kk * SP + l.y + {16 * i}u];\n"
                   f"      let b{i} = ws[kk * SP + l.x + {16 * i}u];\n" for i in range(4))
    fma = "".join(f"      c{i}{j} += a{i} * b{j};\n" for i in range(4) for j in range(4))
    store = "".join(f"  store(m0 + l.y + {16 * i}u, n0 + l.x + {16 * j}u, c{i}{j});\n"
                    for i in range(4) for j in range(4))
    return decl, load + fma, store


_DECL, _UPDATE, _STORE = _unrolled_tile()

# prefill: tiles of 64 rows x 64 outputs, K in steps of 16 through workgroup memory, each weight
# element dequantized once per tile (not once per row as the GEMV does); 4 x 4 outputs a thread.
# The tiles are held k-major with a padded stride, so a warp's reads of them hit distinct banks.
GEMM = _BINDINGS + _ELEM + """
const TK: u32 = 16u;
const SP: u32 = 68u;  // a k-slice's stride: 64 rows (or outputs) and 4 of padding
var<workgroup> xs: array<f32, 1088>;  // [TK, SP]
var<workgroup> ws: array<f32, 1088>;  // [TK, SP]
fn store(m: u32, n: u32, v: f32) {{
  if (m < p.m && n < p.rows) {{ y[m * p.y_stride + p.y_off + n] = v; }}
}}
@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_id) l: vec3<u32>,
        @builtin(local_invocation_index) t: u32) {{
  let n0 = g.x * 64u;
  let m0 = g.y * 64u;
""" + _DECL + """
  for (var k0 = 0u; k0 < p.k; k0 += TK) {{
    for (var i = 0u; i < 4u; i++) {{
      let idx = t + i * 256u;
      let kk = idx % TK;
      let e = k0 + kk;
      let m = m0 + idx / TK;
      let n = n0 + idx / TK;
      var xv = 0.0;
      if (m < p.m && e < p.k) {{ xv = x[m * p.x_stride + e]; }}
      var wv = 0.0;
      if (n < p.rows && e < p.k) {{ wv = elem(n, e); }}
      xs[kk * SP + idx / TK] = xv;
      ws[kk * SP + idx / TK] = wv;
    }}
    workgroupBarrier();
    for (var kk = 0u; kk < TK; kk++) {{
""" + _UPDATE + """    }}
    workgroupBarrier();
  }}
""" + _STORE + """}}
"""

# ids: x's binding as u32; y_off: the part's first row; the table row of token id is id - y_off
EMBED = _BINDINGS.replace("var<storage, read> x: array<f32>", "var<storage, read> x: array<u32>") \
    + _ELEM + """
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
  let r = g.y;
  let e = g.x * 256u + t;
  let id = x[r];
  if (e < p.k && id >= p.y_off && id < p.y_off + p.rows) {{
    y[r * p.k + e] = elem(id - p.y_off, e);
  }}
}}
"""

_KIND_ID = {"f32": 0, "int8": 1, "affine": 2, "q1": 3, "f16": 4}


def _pipe(dev: VulkanDevice, src: str, name: str, w: Weight, lanes: int = 0, rows: int = 1):
    kind = _KIND_ID[w.kind]
    return dev.pipeline(f"{name}/{w.kind}/{lanes}/{rows}",
                        partial(src.format, KIND=kind, PER=PER_WORD[w.kind], LPR=lanes, MR=rows))


def _parts(w: Weight):
    """(row0, rows, codes, scales, biases) buffers per part (scales / biases bound to a spare
    word where the format has none)."""
    for i, (row0, n, codes) in enumerate(w.codes.parts):
        scales = w.scales.parts[i][2] if w.scales is not None else None
        biases = w.biases.parts[i][2] if w.biases is not None else None
        yield row0, n, codes, scales, biases


GEMM_MIN_ROWS = 8  # from here on a step's rows go through the tiled GEMM


def gemv(rec: Recorder, w: Weight, x: Tensor, y: Tensor, rows: int) -> None:
    """y[r, n] = sum_k W[n, k] x[r, k] for r < rows: the GEMV kernel for a few rows (decode; each
    weight word read once for all of them), the tiled GEMM for GEMM_MIN_ROWS and more."""
    dev = rec.dev
    if rows >= GEMM_MIN_ROWS:
        pipe = _pipe(dev, GEMM, "qgemm", w)
        for row0, n, codes, scales, biases in _parts(w):
            u = dev.uniform(n, w.k, w.k // PER_WORD[w.kind], w.group, w.n, row0, w.k, rows)
            rec.dispatch(pipe, [codes, scales or dev.scratch_word, biases or dev.scratch_word,
                                x.buffer, y.buffer, u], (-(-n // 64), -(-rows // 64), 1))
        return
    lanes = dev.gemv_lanes
    pipe = _pipe(dev, GEMV, "qgemv", w, lanes, rows)
    words = w.k // PER_WORD[w.kind]
    for row0, n, codes, scales, biases in _parts(w):
        u = dev.uniform(n, w.k, words, w.group, w.n, row0, w.k, rows)
        groups = -(-n // (256 // lanes))
        rec.dispatch(pipe, [codes, scales or dev.scratch_word, biases or dev.scratch_word,
                            x.buffer, y.buffer, u], (min(groups, GRID_X), -(-groups // GRID_X),
                                                     1))


def embed(rec: Recorder, w: Weight, ids: Tensor, y: Tensor, rows: int) -> None:
    """y[r] = W[ids[r]] (every part looks for its own ids)."""
    dev = rec.dev
    pipe = _pipe(dev, EMBED, "qembed", w)
    words = w.k // PER_WORD[w.kind]
    for row0, n, codes, scales, biases in _parts(w):
        u = dev.uniform(n, w.k, words, w.group, w.k, row0, 0)
        rec.dispatch(pipe, [codes, scales or dev.scratch_word, biases or dev.scratch_word,
                            ids.buffer, y.buffer, u], (-(-w.k // 256), rows, 1))
