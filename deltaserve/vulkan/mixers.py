"""WGSL kernels of the two token mixers (fp32): the GDN conv step and delta rule over state slots,
and gated attention over the paged KV pool. Shapes are compiled in (one pipeline per config).

Sequence table `seqs` [NS, 4] u32: (slot, first row, rows, 0): the GDN kernels walk a sequence's
rows in order within one dispatch (a decode is one row, a prefill chunk many), so state and conv
window stay on the GPU. Projection rows [R, P] as the model's fused in-projections lay them out:
GDN [q HK*K | k HK*K | v HV*V | z HV*V | b HV | a HV], attention [HQ x (query D | gate D) | k | v].
References: ops.conv1d.causal_conv1d, ops.gdn_decode.gdn_decode_ref, layers.attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.vulkan.device import Recorder, Tensor
from deltaserve.vulkan.kernels import reduce_fns


@dataclass(frozen=True)
class MixerShape:
    hk: int  # GDN key heads
    hv: int  # GDN value heads
    k: int  # GDN key head dim
    v: int  # GDN value head dim
    width: int  # conv width
    hq: int  # attention query heads
    hkv: int  # attention K/V heads
    d: int  # attention head dim
    rot: int  # rotary dims
    block_len: int  # KV positions per block

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.k + self.hv * self.v

    @property
    def gdn_proj(self) -> int:
        return self.conv_dim + self.hv * self.v + 2 * self.hv

    @property
    def attn_proj(self) -> int:
        return 2 * self.hq * self.d + 2 * self.hkv * self.d


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


CONV = """
struct P {{ proj: u32, j0: u32, j1: u32 }};
@group(0) @binding(0) var<storage, read> proj: array<f32>;
@group(0) @binding(1) var<storage, read> cw: array<f32>;
@group(0) @binding(2) var<storage, read_write> win: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> seqs: array<u32>;
@group(0) @binding(5) var<uniform> p: P;
const C: u32 = {C}u;
const W: u32 = {W}u;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) g: vec3<u32>) {{
  let c = gid.x;
  let sq = g.y;
  if (c >= C) {{ return; }}
  let slot = seqs[sq * 4u];
  let row0 = seqs[sq * 4u + 1u];
  let n = seqs[sq * 4u + 2u];
  let wb = (slot * C + c) * (W - 1u);
  for (var j = p.j0; j < min(n, p.j1); j++) {{
    let r = row0 + j;
    let x = proj[r * p.proj + c];
    var acc = 0.0;
    for (var i = 0u; i < W - 1u; i++) {{ acc += cw[c * W + i] * win[wb + i]; }}
    acc += cw[c * W + W - 1u] * x;
    out[r * C + c] = acc / (1.0 + exp(-acc));
    for (var i = 0u; i + 1u < W - 1u; i++) {{ win[wb + i] = win[wb + i + 1u]; }}
    win[wb + W - 2u] = x;
  }}
}}
"""


def _row_spans(max_rows: int, per_row: int):
    """Row ranges [j0, j1) walked one dispatch each: llvmpipe (lavapipe) ends any loop after
    65,535 iterations counted with its nested non-unrolled loops (a 64-dim GDN head broke after
    431 rows), so a dispatch walks at most LOOP_BUDGET // per_row rows; on other drivers the
    split costs a dispatch per few hundred rows."""
    step = max(1, LOOP_BUDGET // per_row)
    return [(j0, j0 + step) for j0 in range(0, max(max_rows, 1), step)]


LOOP_BUDGET = 60_000


def gdn_conv(rec: Recorder, s: MixerShape, proj: Tensor, conv_w: Tensor, window: Tensor,
             out: Tensor, seqs: Tensor, nseq: int, max_rows: int) -> None:
    """out [R, C] = silu(causal conv of each sequence's rows over its slot's window [S, C, W-1]),
    the window advanced in place. max_rows: the longest sequence's rows in the step."""
    def code() -> str:  # formatted only when the pipeline is first built
        return CONV.format(
            C=s.conv_dim, W=s.width)
    pipe = rec.dev.pipeline(f"gdn_conv/{s.conv_dim}/{s.width}", code)
    for j0, j1 in _row_spans(max_rows, 2 * s.width):
        rec.dispatch(pipe, [proj.buffer, conv_w.buffer, window.buffer, out.buffer, seqs.buffer,
                            rec.dev.uniform(s.gdn_proj, j0, j1)], (-(-s.conv_dim // 64), nseq, 1))


DELTA = """
struct P {{ proj: u32, eps: f32, j0: u32, j1: u32 }};
@group(0) @binding(0) var<storage, read> proj: array<f32>;
@group(0) @binding(1) var<storage, read> conv: array<f32>;
@group(0) @binding(2) var<storage, read> params: array<f32>;
@group(0) @binding(3) var<storage, read_write> state: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> seqs: array<u32>;
@group(0) @binding(6) var<uniform> p: P;
const HK: u32 = {HK}u;
const HV: u32 = {HV}u;
const K: u32 = {K}u;
const V: u32 = {V}u;
const C: u32 = {C}u;
var<workgroup> qn: array<f32, {K}>;
var<workgroup> kn: array<f32, {K}>;
{REDUCE}
@compute @workgroup_size({WG})
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
  let hv = g.x;
  let sq = g.y;
  let kh = hv / (HV / HK);
  let slot = seqs[sq * 4u];
  let row0 = seqs[sq * 4u + 1u];
  let n = seqs[sq * 4u + 2u];
  let sb = (slot * HV + hv) * K * V;
  // params: A_log [HV] | dt_bias [HV] | norm weight [V]
  let a_log = params[hv];
  let dt_bias = params[HV + hv];
  if (p.j0 >= n) {{ return; }}  // (uniform per workgroup) no rows of this sequence here
  // the thread's state column lives in registers for the dispatch: read once, written once
  var st: array<f32, K>;
  let own = t < V;
  if (own) {{ for (var i = 0u; i < K; i++) {{ st[i] = state[sb + i * V + t]; }} }}
  for (var j = p.j0; j < min(n, p.j1); j++) {{
    let r = row0 + j;
    var q = 0.0;
    var k = 0.0;
    if (t < K) {{
      q = conv[r * C + kh * K + t];
      k = conv[r * C + HK * K + kh * K + t];
    }}
    let q_rs = inverseSqrt(wg_sum(q * q, t) + 1e-6);
    let k_rs = inverseSqrt(wg_sum(k * k, t) + 1e-6);
    if (t < K) {{
      qn[t] = q * q_rs * inverseSqrt(f32(K));
      kn[t] = k * k_rs;
    }}
    workgroupBarrier();
    let base = r * p.proj + C + HV * V;
    let xa = proj[base + HV + hv] + dt_bias;
    var sp = xa;
    if (xa <= 20.0) {{ sp = log(1.0 + exp(xa)); }}
    let decay = exp(-exp(a_log) * sp);
    let beta = 1.0 / (1.0 + exp(-proj[base + hv]));
    var o = 0.0;
    if (own) {{
      var kv = 0.0;
      for (var i = 0u; i < K; i++) {{
        st[i] = st[i] * decay;
        kv += kn[i] * st[i];
      }}
      let delta = (conv[r * C + 2u * HK * K + hv * V + t] - kv) * beta;
      for (var i = 0u; i < K; i++) {{
        st[i] = st[i] + kn[i] * delta;
        o += qn[i] * st[i];
      }}
    }}
    let rstd = inverseSqrt(wg_sum(o * o, t) / f32(V) + p.eps);
    if (own) {{
      let z = proj[r * p.proj + C + hv * V + t];
      out[r * HV * V + hv * V + t] = o * rstd * params[2u * HV + t] * (z / (1.0 + exp(-z)));
    }}
    workgroupBarrier();
  }}
  if (own) {{ for (var i = 0u; i < K; i++) {{ state[sb + i * V + t] = st[i]; }} }}
}}
"""


def gdn_delta(rec: Recorder, s: MixerShape, proj: Tensor, conv: Tensor, params: Tensor,
              state: Tensor, out: Tensor, seqs: Tensor, nseq: int, eps: float, max_rows: int
              ) -> None:
    """The delta rule per value head over each sequence's rows (ops.gdn.gdn_step with q/k l2norms
    and the gates of ops.gdn.gdn_gates), then the gated RMSNorm: out [R, HV*V]. params: A_log,
    dt_bias, the norm weight, concatenated; state [S, HV, K, V] updated in place. max_rows: the
    longest sequence's rows in the step."""
    wg = _pow2(max(s.k, s.v, 32))
    def code() -> str:  # formatted only when the pipeline is first built
        return DELTA.format(
            HK=s.hk, HV=s.hv, K=s.k, V=s.v, C=s.conv_dim, WG=wg, REDUCE=reduce_fns(wg))
    pipe = rec.dev.pipeline(f"gdn_delta/{s.hk}/{s.hv}/{s.k}/{s.v}", code)
    per_row = 2 * max(s.k, 1) + 4 * wg.bit_length() + 16  # the K loops and the reductions'
    for j0, j1 in _row_spans(max_rows, per_row):
        rec.dispatch(pipe, [proj.buffer, conv.buffer, params.buffer, state.buffer, out.buffer,
                            seqs.buffer, rec.dev.uniform(s.gdn_proj, float(eps), j0, j1)],
                     (s.hv, nseq, 1))


QK_PREP = """
struct P {{ eps: f32, mb: u32 }};
@group(0) @binding(0) var<storage, read> proj: array<f32>;
@group(0) @binding(1) var<storage, read> norms: array<f32>;
@group(0) @binding(2) var<storage, read> rope: array<f32>;
@group(0) @binding(3) var<storage, read> rows: array<u32>;
@group(0) @binding(4) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(5) var<storage, read_write> kpool: array<f32>;
@group(0) @binding(6) var<storage, read_write> vpool: array<f32>;
@group(0) @binding(7) var<storage, read> tables: array<u32>;
@group(0) @binding(8) var<uniform> p: P;
const HQ: u32 = {HQ}u;
const HKV: u32 = {HKV}u;
const D: u32 = {D}u;
const ROT: u32 = {ROT}u;
const L: u32 = {L}u;
const PW: u32 = {PW}u;
var<workgroup> xs: array<f32, {D}>;
{REDUCE}
@compute @workgroup_size({WG})
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
  let h = g.x;
  let r = g.y;
  let is_q = h < HQ;
  var src = 0u;
  var nw = 0u;
  if (is_q) {{ src = r * PW + h * 2u * D; }} else {{ src = r * PW + 2u * HQ * D + (h - HQ) * D; nw = D; }}
  var ss = 0.0;
  for (var d = t; d < D; d += {WG}u) {{ let x = proj[src + d]; xs[d] = x; ss += x * x; }}
  let rstd = inverseSqrt(wg_sum(ss, t) / f32(D) + p.eps);
  for (var d = t; d < D; d += {WG}u) {{ xs[d] = xs[d] * rstd * (norms[nw + d] + 1.0); }}
  workgroupBarrier();
  // rows: position per row; rope: [R, 2, ROT] cos | sin
  let pos = rows[r];
  for (var d = t; d < D; d += {WG}u) {{
    var y = xs[d];
    if (d < ROT) {{
      var rh = 0.0;
      if (d < ROT / 2u) {{ rh = -xs[d + ROT / 2u]; }} else {{ rh = xs[d - ROT / 2u]; }}
      y = xs[d] * rope[r * 2u * ROT + d] + rh * rope[r * 2u * ROT + ROT + d];
    }}
    if (is_q) {{
      q_out[(r * HQ + h) * D + d] = y;
    }} else {{
      let kh = h - HQ;
      let at = ((tables[r * p.mb + pos / L] * HKV + kh) * L + pos % L) * D + d;
      kpool[at] = y;
      vpool[at] = proj[r * PW + 2u * HQ * D + HKV * D + kh * D + d];
    }}
  }}
}}
"""


def qk_prep(rec: Recorder, s: MixerShape, proj: Tensor, norms: Tensor, rope: Tensor,
            positions: Tensor, q_out: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor,
            rows: int, max_blocks: int, eps: float) -> None:
    """q/k RMSNorms (1 + w; norms = q_norm | k_norm weights), partial rotary (rope [R, 2, ROT]:
    cos then sin), q into q_out [R, HQ, D], k and v into the pools [NB, HKV, L, D] at each row's
    position through its block table (tables [R, max_blocks])."""
    wg = min(256, _pow2(max(s.d, 32)))
    def code() -> str:  # formatted only when the pipeline is first built
        return QK_PREP.format(
            HQ=s.hq, HKV=s.hkv, D=s.d, ROT=s.rot, L=s.block_len, PW=s.attn_proj, WG=wg,
            REDUCE=reduce_fns(wg))
    pipe = rec.dev.pipeline(f"qk_prep/{s.hq}/{s.hkv}/{s.d}/{s.rot}/{s.block_len}", code)
    rec.dispatch(pipe, [proj.buffer, norms.buffer, rope.buffer, positions.buffer, q_out.buffer,
                        k_pool.buffer, v_pool.buffer, tables.buffer,
                        rec.dev.uniform(float(eps), max_blocks)], (s.hq + s.hkv, rows, 1))


ATTEND = """
struct P {{ mb: u32, scale: f32 }};
@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> proj: array<f32>;
@group(0) @binding(2) var<storage, read> kpool: array<f32>;
@group(0) @binding(3) var<storage, read> vpool: array<f32>;
@group(0) @binding(4) var<storage, read> rows: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
@group(0) @binding(7) var<uniform> p: P;
const HQ: u32 = {HQ}u;
const HKV: u32 = {HKV}u;
const D: u32 = {D}u;
const L: u32 = {L}u;
const PW: u32 = {PW}u;
const DPT: u32 = {DPT}u;
var<workgroup> probs: array<f32, 256>;
var<workgroup> dots: array<f32, 256>;
{REDUCE}
fn kv_at(r: u32, kh: u32, pos: u32) -> u32 {{
  return ((tables[r * p.mb + pos / L] * HKV + kh) * L + pos % L) * D;
}}
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) t: u32) {{
  let h = g.x;
  let r = g.y;
  let kh = h / (HQ / HKV);
  let len = rows[r] + 1u;
  let qb = (r * HQ + h) * D;
  var m = -3.0e38;
  var l = 0.0;
  var acc: array<f32, DPT>;
  for (var j0 = 0u; j0 < len; j0 += 256u) {{
    // the tile's scores, 8 lanes a key (32 keys a round), each lane 4 adjacent dims at a time:
    // a key's row is read as whole cache lines (one lane a key read 32 rows at once)
    let nk = min(256u, len - j0);
    for (var k0 = 0u; k0 < nk; k0 += 32u) {{
      let jk = j0 + k0 + t / 8u;
      var part = 0.0;
      if (jk < len) {{
        let kb = kv_at(r, kh, jk);
        for (var c = (t % 8u) * 4u; c < D; c += 32u) {{
          for (var u = 0u; u < 4u; u++) {{
            if (c + u < D) {{ part += q[qb + c + u] * kpool[kb + c + u]; }}
          }}
        }}
      }}
      dots[t] = part;
      workgroupBarrier();
      if (t < 32u) {{
        var dot = 0.0;
        for (var i = 0u; i < 8u; i++) {{ dot += dots[t * 8u + i]; }}
        probs[k0 + t] = dot;
      }}
      workgroupBarrier();
    }}
    let j = j0 + t;
    var s = -3.0e38;
    if (j < len) {{ s = probs[t] * p.scale; }}
    let m_new = max(m, wg_max(s, t));
    let f = exp(m - m_new);
    var e = 0.0;
    if (j < len) {{ e = exp(s - m_new); }}
    probs[t] = e;
    l = l * f + wg_sum(e, t);
    let n = min(256u, len - j0);
    for (var i = 0u; i < DPT; i++) {{
      let d = t + i * 256u;
      if (d < D) {{
        var a = acc[i] * f;
        for (var jj = 0u; jj < n; jj++) {{ a += probs[jj] * vpool[kv_at(r, kh, j0 + jj) + d]; }}
        acc[i] = a;
      }}
    }}
    workgroupBarrier();
    m = m_new;
  }}
  for (var i = 0u; i < DPT; i++) {{
    let d = t + i * 256u;
    if (d < D) {{
      let gate = proj[r * PW + h * 2u * D + D + d];
      out[(r * HQ + h) * D + d] = acc[i] / l / (1.0 + exp(-gate));
    }}
  }}
}}
"""


def attend(rec: Recorder, s: MixerShape, q: Tensor, proj: Tensor, k_pool: Tensor,
           v_pool: Tensor, positions: Tensor, tables: Tensor, out: Tensor, rows: int,
           max_blocks: int) -> None:
    """Causal softmax attention of each row over its sequence's positions 0..pos (GQA), times
    sigmoid(gate): out [R, HQ*D]. Keys in tiles of 256 with a running max and sum (online
    softmax), so no scores array grows with the context."""
    def code() -> str:  # formatted only when the pipeline is first built
        return ATTEND.format(
            HQ=s.hq, HKV=s.hkv, D=s.d, L=s.block_len, PW=s.attn_proj, DPT=-(-s.d // 256),
            REDUCE=reduce_fns(256))
    pipe = rec.dev.pipeline(f"attend/{s.hq}/{s.hkv}/{s.d}/{s.block_len}", code)
    rec.dispatch(pipe, [q.buffer, proj.buffer, k_pool.buffer, v_pool.buffer, positions.buffer,
                        tables.buffer, out.buffer, rec.dev.uniform(max_blocks, float(s.d ** -0.5))],
                 (s.hq, rows, 1))
