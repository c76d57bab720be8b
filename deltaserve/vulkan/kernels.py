"""WGSL compute kernels of the Vulkan backend (fp32), each the counterpart of a torch reference in
deltaserve.ops (tests/vulkan/test_kernels.py holds them side by side), and their recorders.

Rows: a step's tokens [R]. Sequences: the step's chunks, each (slot, first row, rows); the GDN
kernels walk a chunk's rows in order inside one dispatch (decode: one row), so the recurrent state
never leaves the GPU between tokens. Reductions are workgroup tree reductions (no subgroup
operations: every adapter runs them).
"""

from __future__ import annotations

from deltaserve.vulkan.device import Recorder, Tensor

WG = 256  # threads per workgroup of the row kernels
GRID_X = 32768  # workgroups along x before wrapping into y (adapters allow >= 65535)

_REDUCE = """
var<workgroup> red: array<f32, {wg}>;
fn wg_sum(v: f32, t: u32) -> f32 {{
  red[t] = v;
  workgroupBarrier();
  for (var h = {wg}u / 2u; h > 0u; h >>= 1u) {{
    if (t < h) {{ red[t] += red[t + h]; }}
    workgroupBarrier();
  }}
  let s = red[0];
  workgroupBarrier();
  return s;
}}
fn wg_max(v: f32, t: u32) -> f32 {{
  red[t] = v;
  workgroupBarrier();
  for (var h = {wg}u / 2u; h > 0u; h >>= 1u) {{
    if (t < h) {{ red[t] = max(red[t], red[t + h]); }}
    workgroupBarrier();
  }}
  let s = red[0];
  workgroupBarrier();
  return s;
}}
"""


def reduce_fns(wg: int = WG) -> str:
    return _REDUCE.format(wg=wg)


RMSNORM = """
struct P { dim: u32, eps: f32, offset: f32, add: u32, x_stride: u32, y_stride: u32 };
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> wt: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> res: array<f32>;
@group(0) @binding(4) var<uniform> p: P;
""" + reduce_fns() + """
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let r = g.x + g.y * 32768u;
  var ss = 0.0;
  for (var i = t; i < p.dim; i += 256u) {
    var v = x[r * p.x_stride + i];
    if (p.add == 1u) { v = v + res[r * p.dim + i]; res[r * p.dim + i] = v; }
    ss += v * v;
  }
  let rstd = inverseSqrt(wg_sum(ss, t) / f32(p.dim) + p.eps);
  for (var i = t; i < p.dim; i += 256u) {
    var v = x[r * p.x_stride + i];
    if (p.add == 1u) { v = res[r * p.dim + i]; }
    y[r * p.y_stride + i] = v * rstd * (wt[i] + p.offset);
  }
}
"""


def rms_norm(rec: Recorder, x: Tensor, w: Tensor, y: Tensor, rows: int, dim: int, eps: float,
             offset: float, residual: Tensor | None = None, x_stride: int | None = None,
             y_stride: int | None = None) -> None:
    """y = x * rsqrt(mean(x^2) + eps) * (w + offset) per row of dim (ops.norm.rms_norm_ref).
    residual: residual += x first, and the norm is of that sum (ops.norm.add_rms_norm)."""
    dev = rec.dev
    u = dev.uniform(dim, float(eps), float(offset), int(residual is not None),
                    dim if x_stride is None else x_stride, dim if y_stride is None else y_stride)
    res = residual.buffer if residual is not None else dev.scratch_word
    rec.dispatch(dev.pipeline("rmsnorm", RMSNORM), [x.buffer, w.buffer, y.buffer, res, u],
                 (min(rows, GRID_X), -(-rows // GRID_X), 1))


EMBED = """
struct P { dim: u32, row0: u32, rows: u32 };
@group(0) @binding(0) var<storage, read> table: array<f32>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: P;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let r = g.y;
  let i = g.x * 256u + t;
  let id = ids[r];
  if (i < p.dim && id >= p.row0 && id < p.row0 + p.rows) {
    y[r * p.dim + i] = table[(id - p.row0) * p.dim + i];
  }
}
"""


def embed(rec: Recorder, table: Tensor, ids: Tensor, y: Tensor, rows: int) -> None:
    """y[r] = table[ids[r]] (every part of the table looks for its own ids)."""
    dev = rec.dev
    dim = table.shape[1]
    pipe = dev.pipeline("embed", EMBED)
    for row0, n, buf in table.parts:
        rec.dispatch(pipe, [buf, ids.buffer, y.buffer, dev.uniform(dim, row0, n)],
                     (-(-dim // 256), rows, 1))


SILU_MUL = """
struct P { inter: u32 };
@group(0) @binding(0) var<storage, read> gu: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: P;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let r = g.y;
  let i = g.x * 256u + t;
  if (i < p.inter) {
    let a = gu[r * 2u * p.inter + i];
    y[r * p.inter + i] = a / (1.0 + exp(-a)) * gu[r * 2u * p.inter + p.inter + i];
  }
}
"""


def silu_mul(rec: Recorder, gu: Tensor, y: Tensor, rows: int, inter: int) -> None:
    """y = silu(g) * u of rows [g | u] (ops.activation.silu_mul)."""
    dev = rec.dev
    rec.dispatch(dev.pipeline("silu_mul", SILU_MUL), [gu.buffer, y.buffer, dev.uniform(inter)],
                 (-(-inter // 256), rows, 1))


ARGMAX = """
struct P { cols: u32, out_off: u32 };
@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
@group(0) @binding(2) var<uniform> p: P;
const NONE: u32 = 0xffffffffu;
var<workgroup> bv: array<f32, 256>;
var<workgroup> bi: array<u32, 256>;
var<workgroup> bn: array<u32, 256>;
// (value, index) a beats b: larger, or equal and earlier (b empty: always)
fn beats(av: f32, ai: u32, bv_: f32, bi_: u32) -> bool {
  return ai != NONE && (bi_ == NONE || av > bv_ || (av == bv_ && ai < bi_));
}
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let r = g.x;
  var best = 0.0;
  var idx = NONE;
  var nan = NONE;
  for (var j = t; j < p.cols; j += 256u) {
    let v = x[r * p.cols + j];
    if ((bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u) { nan = min(nan, j); }
    else if (beats(v, j, best, idx)) { best = v; idx = j; }
  }
  bv[t] = best;
  bi[t] = idx;
  bn[t] = nan;
  workgroupBarrier();
  for (var h = 128u; h > 0u; h >>= 1u) {
    if (t < h) {
      if (beats(bv[t + h], bi[t + h], bv[t], bi[t])) { bv[t] = bv[t + h]; bi[t] = bi[t + h]; }
      bn[t] = min(bn[t], bn[t + h]);
    }
    workgroupBarrier();
  }
  if (t == 0u) { out[p.out_off + r] = select(bi[0], bn[0], bn[0] != NONE); }
}
"""


def argmax(rec: Recorder, x: Tensor, out: Tensor, rows: int, cols: int, out_off: int = 0
           ) -> None:
    """out[out_off + r] = argmax of row r of x [rows, cols] as torch.argmax: the first index of
    the maximum, the first NaN's where a row holds one (the greedy head's tokens)."""
    dev = rec.dev
    rec.dispatch(dev.pipeline("argmax", ARGMAX), [x.buffer, out.buffer,
                                                  dev.uniform(cols, out_off)], (rows, 1, 1))
