"""One CPU decode step (a token for each of up to `max_rows` sequences) through all decoder
layers in one native call (ops/csrc/decode_step.c).

The layered path runs ~100 GEMVs per token of the 0.8B model, each a native call, with ~700 small
torch ops and the Python of every module between them: ~15-20 ms per step on 2 cores, a third of
an int8 step, and most of a small model's step. The plan below describes the model once (pointers
to every weight, norm, pool, and the kernel each matrix takes, as the layered path would choose it
for that many rows); each step is then one C call. Its reference is the layered path itself
(models/qwen3_5.forward_batch without the plan); tests/ops/test_decode_step.py compares them per
weight format and row count, bit for bit.
"""

from __future__ import annotations

import ctypes

import torch

from deltaserve.config import FULL
from deltaserve.env import env
from deltaserve.ops.dispatch import REFERENCE, Case, Op
from deltaserve.ops.native import native_lib
from deltaserve.ops.qgemv import a4_is_vnni, blocks_vnni, q1_is_vnni, q8_is_vnni, scales_of
from deltaserve.quant.ggml_blocks import BLOCKS

BF16, Q8, Q8_VNNI, A4, Q1, A4_VNNI, Q1_VNNI, BLOCKS_EXACT, BLOCKS_VNNI, PARTS = range(10)


class DsMat(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("w", ctypes.c_void_p), ("s", ctypes.c_void_p),
                ("b", ctypes.c_void_p), ("n", ctypes.c_long), ("k", ctypes.c_long),
                ("g", ctypes.c_long), ("scale_kind", ctypes.c_int), ("next", ctypes.c_void_p)]


_P = ctypes.c_void_p
_LAYER_PTRS = ["in_norm", "post_norm"]
_LAYER_MATS = ["mix_in", "mix_out", "gate_up", "down"]
_LAYER_TAIL = ["conv_w", "a_log", "dt_bias", "gnorm_w", "conv_pool", "state_pool", "q_norm",
               "k_norm", "k_pool", "v_pool"]


class DsLayer(ctypes.Structure):
    _fields_ = ([("is_full", ctypes.c_int)] + [(n, _P) for n in _LAYER_PTRS]
                + [(n, DsMat) for n in _LAYER_MATS] + [(n, _P) for n in _LAYER_TAIL])


class DsSteps(ctypes.Structure):
    _fields_ = ([("num_steps", ctypes.c_long), ("first_verify", ctypes.c_long)]
                + [(n, _P) for n in ("start", "rows", "slots", "before", "inputs", "kept")])


def _pointers(tensors: list) -> ctypes.Array | None:
    """A C array of the tensors' data pointers (NULL for None); None if all are None."""
    if all(t is None for t in tensors):
        return None
    return (_P * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def gdn_steps(batch, model_layers) -> tuple[DsSteps, list]:
    """The GDN schedule of a step of decode and verify chunks (DsSteps in ops/csrc/decode_step.c):
    the decode rows in one step, then token j of every verify chunk in step j, as
    layers/gated_deltanet.forward_batch and spec/rollback.verify_steps run them; with batch.spec's
    rollback buffers. Returns the struct and what must outlive the call."""
    starts, rows, slots = [0], [], []
    if batch.decode:
        rows += [batch.offsets[i] for i in batch.decode]
        slots += [batch.chunks[i].slot for i in batch.decode]
        starts.append(len(rows))
    first_verify, record, arrays = len(starts) - 1, batch.spec, [None, None, None]
    if record is not None:
        for j, (members, _) in enumerate(record.steps):
            rows += [batch.offsets[i] + j for i in members]
            slots += [batch.chunks[i].slot for i in members]
            starts.append(len(rows))
        arrays = [_pointers(bufs) for bufs in record.native_buffers(model_layers)]
    flat = torch.tensor(starts + rows + slots, dtype=torch.long)
    ptr, size = flat.data_ptr(), flat.element_size()
    steps = DsSteps(len(starts) - 1, first_verify, ptr, ptr + len(starts) * size,
                    ptr + (len(starts) + len(rows)) * size,
                    *[None if a is None else ctypes.addressof(a) for a in arrays])
    return steps, [flat, record, *arrays]


class DsModel(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_long) for n in ("hidden", "inter", "num_layers")]
                + [("eps", ctypes.c_float)]
                + [(n, ctypes.c_long) for n in ("hk", "hv", "dk", "dv", "conv_width", "hq", "hkv",
                                                "head_dim", "rot_dim", "block_len")]
                + [("attn_scale", ctypes.c_float), ("final_norm", _P)])


def _matrix(linear, lib, keep: list) -> DsMat | None:
    """The C description of a Linear for a batch-1 fp32 decode row, with the kernel the layered
    path would pick (ops/qgemv.qgemv, ops/gemv.gemv); None where that path is not native."""
    if linear.reduce is not None or linear.input_order is not None:
        return None
    if linear.segments is not None:
        return _parts(linear, lib, keep)
    scheme = linear.scheme
    if scheme is not None and scheme.is_block():  # GGUF blocks: ops/qgemv.gemm_blocks's choice
        if not linear.weight.is_contiguous():
            return None
        keep.append(linear.weight)
        kind = BLOCKS_VNNI if blocks_vnni(lib, scheme) else BLOCKS_EXACT
        return DsMat(kind, linear.weight.data_ptr(), None, None, linear.weight.shape[0],
                     linear.in_cols, BLOCKS[scheme.kind][0], 0)
    if scheme is None:
        w = linear.weight  # fp32 weights (validation runs) take F.linear there: not native
        if not w.is_contiguous() or w.dtype != torch.bfloat16:
            return None
        keep.append(w)
        return DsMat(BF16, w.data_ptr(), None, None, w.shape[0], w.shape[1], 0)
    n, k, g = linear.weight.shape[0], linear.in_cols, scheme.group_size
    p = {"weight": linear.weight, "scales": linear.scales}
    if scheme.has_biases():
        p["biases"] = linear.biases
    if not all(t.is_contiguous() for t in p.values()):
        return None
    kinds = {("int8", 8): None, ("affine", 4): A4, ("q1", 1): Q1}
    if (scheme.kind, scheme.bits) not in kinds:
        return None
    kind = kinds[(scheme.kind, scheme.bits)]
    if kind is None:
        kind = Q8_VNNI if q8_is_vnni(lib, n, k, g) else Q8
    elif kind == A4 and a4_is_vnni(lib, n, k, g):
        kind = A4_VNNI
    elif kind == Q1 and q1_is_vnni(lib, n, k, g):
        kind = Q1_VNNI
    s, b, scale_kind = scales_of(p, scheme)  # the same arrays the layered path passes
    keep.extend([linear.weight, s, b])
    bias = b.data_ptr() if scheme.has_biases() else None
    return DsMat(kind, linear.weight.data_ptr(), s.data_ptr(), bias, n, k, g, scale_kind)


def _parts(linear, lib, keep: list) -> DsMat | None:
    """A packed Linear whose parts a GGUF quantized apart (quant/linear.quantize_parts_): a chain
    of its parts' matrices, their outputs concatenated, as the layered path concatenates them."""
    mats = [_matrix(part, lib, keep) for part in linear.segments]
    if any(m is None for m in mats):
        return None
    for mat, following in zip(mats, mats[1:], strict=False):
        mat.next = ctypes.addressof(following)
    keep.extend(mats)  # the chain's structs outlive the plan
    return DsMat(PARTS, None, None, None, sum(m.n for m in mats), linear.in_features, 0, 0,
                 ctypes.addressof(mats[0]))


def _rows_limit(linear) -> int:
    """Up to how many decode rows the layered path keeps this Linear on the kernels matmat runs;
    above it that path widens or dequantizes for torch's GEMM, which the plan does not run."""
    from deltaserve.layers.linear import SMALL_GEMM_MAX_ROWS
    from deltaserve.quant.linear import decode_max_rows

    if linear.segments is not None:
        return min(_rows_limit(part) for part in linear.segments)
    if linear.scheme is None:
        return SMALL_GEMM_MAX_ROWS
    return decode_max_rows(linear.scheme, linear.weight.shape[0], linear.in_cols)


def _linears(layer, full: bool) -> tuple:
    """A decoder layer's four matrices, in DsLayer's order."""
    mixer = layer.self_attn if full else layer.linear_attn
    return (mixer.qkv_proj if full else mixer.in_proj, mixer.o_proj if full else mixer.out_proj,
            layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _f32(t: torch.Tensor, keep: list) -> int:
    t = t.detach().float().contiguous()
    keep.append(t)
    return t.data_ptr()


class DecodePlan:
    """Every pointer a decode step needs, for one model and one pair of state/KV pools; steps of
    1..max_rows sequences."""

    def __init__(self, lib, model: DsModel, layers, keep: list, key: tuple,
                 max_rows: int) -> None:
        self.lib, self.model, self.layers, self.keep, self.key = lib, model, layers, keep, key
        self.max_rows = max_rows
        fn = lib.ds_decode_work_floats
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_long], ctypes.c_long
        self._work_floats = lambda rows: fn(ctypes.byref(model), rows)  # noqa: E731
        self.work = torch.empty(0, dtype=torch.float32)
        run = lib.ds_decode_rows
        run.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_void_p] * 3
                        + [ctypes.c_long] + [ctypes.c_void_p] * 3 + [ctypes.c_int])
        run.restype = None
        self._args = (ctypes.byref(model), self.layers)

    def run(self, x: torch.Tensor, steps: DsSteps, positions: torch.Tensor,
            tables: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B,N] fp32 contiguous (overwritten): input embeddings in, final-normed hidden states
        out. steps: the GDN schedule (gdn_steps); positions [B] and tables [B,NBmax] int64; cos,
        sin [B,R] fp32."""
        rows = x.shape[0]
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a native decode step takes 1..{self.max_rows} rows, not {rows}")
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.model.hidden \
                or positions.dtype != torch.long or tables.dtype != torch.long \
                or cos.shape != (rows, self.model.rot_dim) or sin.shape != cos.shape:
            raise ValueError("native decode step: x [rows, hidden] fp32 contiguous, int64 "
                             "positions and tables, cos/sin [rows, rot_dim]")
        need = self._work_floats(rows)
        if self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        positions, tables, cos, sin = (t.contiguous() for t in (positions, tables, cos, sin))
        self.lib.ds_decode_rows(*self._args, x.data_ptr(), rows, ctypes.byref(steps),
                                positions.data_ptr(), tables.data_ptr(), tables.shape[1],
                                cos.data_ptr(), sin.data_ptr(), self.work.data_ptr(),
                                torch.get_num_threads())
        return x


def pools_key(states, kv) -> tuple:
    """Identifies the pools a plan points into (a new engine or cache makes new pools)."""
    pools = (*states.conv, *states.recurrent, *kv.k, *kv.v)
    return tuple(None if t is None else t.data_ptr() for t in pools) + (kv.block_len,)


DECODE_STEP = Op("decode_step", "a CPU step of decode and verify rows: every layer in one "
                 "native call, or layer by layer (the reference)")


def _native_why_not(c: Case) -> str | None:
    if c.device != "cpu" or c.dtype != torch.float32:
        return "not CPU fp32 activations"
    if not env().fused_decode:
        return "DELTASERVE_FUSED_DECODE=0"
    lib = native_lib()
    return None if lib is not None and hasattr(lib, "ds_decode_rows") else "no native kernels"


DECODE_STEP.strategy("native", 30, _native_why_not)
DECODE_STEP.strategy(REFERENCE, 0)  # the layers: models/qwen3_5.forward_batch without a plan


def build_plan(lm, states, kv) -> DecodePlan | None:
    """The plan for Qwen3_5ForCausalLM `lm` over these pools, or None where some part has no native
    kernel or DECODE_STEP does not choose it (then the layered path runs): needs the C library,
    fp32 activations and pools on CPU."""
    lib = native_lib()
    cfg = lm.cfg
    if not DECODE_STEP.chooses(Case(lm.device.type, lm.act_dtype, (), True), "native"):
        return None
    if any(t is not None and t.dtype != torch.float32 for t in (*states.conv, *kv.k, *kv.v)):
        return None
    keep: list = []
    layers = (DsLayer * cfg.num_hidden_layers)()
    for i, layer in enumerate(lm.model.layers):
        spec = _layer(layer, i, cfg, states, kv, lib, keep)
        if spec is None:
            return None
        layers[i] = spec
    rows = min(_rows_limit(linear) for i, layer in enumerate(lm.model.layers)
               for linear in _linears(layer, cfg.layer_types[i] == FULL))
    n = lambda c: getattr(cfg, c)  # noqa: E731
    model = DsModel(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                    cfg.rms_norm_eps, n("linear_num_key_heads"), n("linear_num_value_heads"),
                    n("linear_key_head_dim"), n("linear_value_head_dim"),
                    n("linear_conv_kernel_dim"), cfg.num_attention_heads,
                    cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim, kv.block_len,
                    cfg.head_dim**-0.5, _f32(lm.model.norm.weight, keep))
    return DecodePlan(lib, model, layers, keep, pools_key(states, kv), rows)


def _layer(layer, i: int, cfg, states, kv, lib, keep: list) -> DsLayer | None:
    full = cfg.layer_types[i] == FULL
    mixer = layer.self_attn if full else layer.linear_attn
    mats = [_matrix(m, lib, keep) for m in _linears(layer, full)]
    if any(m is None for m in mats):
        return None
    spec = DsLayer(int(full), _f32(layer.input_layernorm.weight, keep),
                   _f32(layer.post_attention_layernorm.weight, keep), *mats)
    if full:
        spec.q_norm = _f32(mixer.q_norm.weight, keep)
        spec.k_norm = _f32(mixer.k_norm.weight, keep)
        spec.k_pool, spec.v_pool = kv.k[i].data_ptr(), kv.v[i].data_ptr()
    else:
        spec.conv_w = _f32(mixer.conv1d.weight[:, 0], keep)
        spec.a_log, spec.dt_bias = _f32(mixer.A_log, keep), _f32(mixer.dt_bias, keep)
        spec.gnorm_w = _f32(mixer.norm.weight, keep)
        spec.conv_pool, spec.state_pool = states.conv[i].data_ptr(), states.recurrent[i].data_ptr()
    return spec
