"""The Vulkan device through wgpu: the adapter and its limits, buffers within a memory budget,
compute pipelines built once per shader, and a recorder that puts a whole step's dispatches into
one command buffer (one submission per step).

A tensor larger than the adapter's largest storage binding (the 248k-row embedding at f32 is 1 GB;
lavapipe binds 128 MiB) is held as row parts, each its own buffer (`Tensor.parts`): the kernels
that read such weights run once per part.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.errors import ConfigError

try:  # the optional Vulkan backend: pip install deltaserve[vulkan]
    import wgpu
except ImportError:  # pragma: no cover - the tests skip with this reason
    wgpu = None


@functools.cache
def adapter_or_reason() -> tuple[object | None, str]:
    """(the wgpu adapter, "") or (None, why there is none): no wgpu, or no Vulkan/Metal/DX12 GPU
    (software adapters such as lavapipe count: CI's tests run on it)."""
    if wgpu is None:
        return None, "the wgpu package is not installed (pip install 'deltaserve[vulkan]')"
    # triton's library first: loaded after a Mesa driver (lavapipe carries its own LLVM), its
    # import crashed the process with a segmentation fault
    import deltaserve.ops.backend  # noqa: F401
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:  # noqa: BLE001 - wgpu raises its own types per platform
        return None, f"no WebGPU adapter: {e}"
    if adapter is None:
        return None, "no WebGPU adapter (install a Vulkan driver, e.g. mesa-vulkan-drivers)"
    return adapter, ""


def available() -> bool:
    return adapter_or_reason()[0] is not None


@dataclass
class Tensor:
    """A device array: f32 / u32 / i32 elements, row-major `shape`; `parts` the row ranges and
    buffers it is held in (one part unless it exceeds a binding)."""

    shape: tuple[int, ...]
    dtype: str  # "f32" | "u32" | "i32"
    parts: list[tuple[int, int, object]] = field(default_factory=list)  # (row0, rows, buffer)

    @property
    def buffer(self):
        if len(self.parts) != 1:
            raise ValueError(f"a tensor of {len(self.parts)} parts has no single buffer")
        return self.parts[0][2]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4


_NP = {"f32": np.float32, "u32": np.uint32, "i32": np.int32}
_TORCH = {torch.float32: "f32", torch.int32: "i32"}


class VulkanDevice:
    """One wgpu device. memory_limit (bytes, or None for the adapter's own): every buffer is
    counted against it, so a 4 GiB card can be simulated on a larger one."""

    def __init__(self, memory_limit: int | None = None) -> None:
        adapter, why = adapter_or_reason()
        if adapter is None:
            raise ConfigError(f"--device vulkan: {why}")
        self.adapter = adapter
        lim = adapter.limits
        self.max_binding = int(lim["max-storage-buffer-binding-size"])
        self.max_buffer = int(lim["max-buffer-size"])
        self.max_groups = int(lim["max-compute-workgroups-per-dimension"])
        self.features = set(adapter.features)
        # GEMV lanes per output row (vulkan/weights.py): a warp's worth on GPUs; few on CPU
        # adapters (lavapipe runs a workgroup as a loop: fewer, fuller workgroups run fast)
        self.gemv_lanes = 4 if adapter.info["adapter_type"] == "CPU" else 32
        # llvmpipe (lavapipe) ends a loop after 65,535 iterations, nested ones counted in
        self.loop_limited = "llvmpipe" in str(adapter.info["device"]).lower()
        wanted = [f for f in ("timestamp-query",) if f in self.features]
        self.device = adapter.request_device_sync(required_features=wanted, required_limits={
            "max-storage-buffer-binding-size": self.max_binding,
            "max-buffer-size": self.max_buffer,
            "max-storage-buffers-per-shader-stage":
                int(lim["max-storage-buffers-per-shader-stage"])})
        self.memory_limit = memory_limit
        self.allocated = 0
        self._pipelines: dict[str, object] = {}
        self._names: dict[int, str] = {}  # id(pipeline) -> its name, for the profile's labels
        self.profiler: Profiler | None = None
        self.generation = 0  # counts freed buffers: a recorded step plan is valid within one
        # decode steps bind the same buffers with the same scalars step after step: their bind
        # groups and uniform buffers are made once (creating them cost ~0.2 ms a dispatch)
        self._uniforms: OrderedDict[tuple, object] = OrderedDict()
        self._groups: OrderedDict[tuple, object] = OrderedDict()
        self.scratch_word = self._buffer(16)  # bound where a kernel's optional buffer is unused

    @property
    def name(self) -> str:
        info = self.adapter.info
        return f"{info['device']} ({info['backend_type']}, {info['adapter_type']})"

    # -- memory -----------------------------------------------------------------------------
    def _buffer(self, nbytes: int, data=None):
        nbytes = max(4, (nbytes + 3) // 4 * 4)
        if self.memory_limit is not None and self.allocated + nbytes > self.memory_limit:
            raise ConfigError(
                f"the Vulkan memory plan needs {(self.allocated + nbytes) / 2**30:.2f} GiB, over "
                f"--gpu-memory-limit {self.memory_limit / 2**30:.2f} GiB")
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        if data is None:
            buf = self.device.create_buffer(size=nbytes, usage=usage)
        else:
            buf = self.device.create_buffer_with_data(data=data, usage=usage)
        self.allocated += nbytes  # given back when the buffer object goes (wgpu frees it then)
        weakref.finalize(buf, self._release, nbytes)
        return buf

    def _release(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def _row_parts(self, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        rows, row_bytes = shape[0], math.prod(shape[1:]) * 4
        per = max(1, min(self.max_binding, self.max_buffer) // max(row_bytes, 1))
        return [(r, min(per, rows - r)) for r in range(0, rows, per)] or [(0, 0)]

    def empty(self, shape, dtype: str = "f32") -> Tensor:
        shape = tuple(int(s) for s in shape)
        row_bytes = math.prod(shape[1:]) * 4 if len(shape) > 1 else 4
        parts = self._row_parts(shape) if len(shape) > 1 else [(0, shape[0])]
        return Tensor(shape, dtype, [(r, n, self._buffer(n * row_bytes)) for r, n in parts])

    def upload(self, t: torch.Tensor | np.ndarray, dtype: str | None = None) -> Tensor:
        """A host array onto the device (torch fp32 / int32, or numpy), split by rows if needed."""
        if isinstance(t, torch.Tensor):
            dtype = dtype or _TORCH.get(t.dtype, "f32")
            t = t.detach().to("cpu", torch.float32 if dtype == "f32" else torch.int32).numpy()
        arr = np.ascontiguousarray(t, dtype=_NP[dtype or "f32"])
        shape = arr.shape if arr.ndim else (1,)
        if arr.ndim <= 1:
            return Tensor(shape, dtype or "f32", [(0, shape[0], self._buffer(arr.nbytes, arr))])
        return Tensor(shape, dtype or "f32",
                      [(r, n, self._buffer(arr[r:r + n].nbytes, arr[r:r + n]))
                       for r, n in self._row_parts(shape)])

    def upload_rows(self, tensors: list[torch.Tensor], dtype: str = "f32") -> list[Tensor]:
        """2-D host arrays of equal row counts, each cut into the same row parts (a packed
        weight's codes with its scales): the parts fit the binding of the widest. Floating
        tensors are stored as f32, the others as `dtype` words."""
        row_bytes = max(math.prod(t.shape[1:]) * 4 for t in tensors)
        per = max(1, min(self.max_binding, self.max_buffer) // row_bytes)
        rows = tensors[0].shape[0]
        out = []
        for t in tensors:
            kind = "f32" if t.is_floating_point() else dtype
            arr = t.detach().cpu().float().numpy() if kind == "f32" else \
                np.ascontiguousarray(t.detach().cpu().numpy()).view(_NP[kind])
            out.append(Tensor(tuple(arr.shape), kind,
                              [(r, min(per, rows - r), self._buffer(arr[r:r + per].nbytes,
                                                                   arr[r:r + per]))
                               for r in range(0, rows, per)]))
        return out

    def write(self, t: Tensor, arr: np.ndarray, offset_bytes: int = 0) -> None:
        """Host data into a one-part tensor (a step's inputs, a restored state slot)."""
        self.device.queue.write_buffer(t.buffer, offset_bytes, np.ascontiguousarray(arr))

    def download(self, t: Tensor) -> torch.Tensor:
        out = [np.frombuffer(self.device.queue.read_buffer(b, 0, n * self._row_bytes(t)),
                             _NP[t.dtype]) for _, n, b in t.parts]
        arr = np.concatenate(out) if len(out) > 1 else out[0]
        return torch.from_numpy(arr.copy()).reshape(t.shape)

    def read_range(self, t: Tensor, start: int, count: int) -> np.ndarray:
        """Elements [start, start + count) of a one-part tensor."""
        data = self.device.queue.read_buffer(t.buffer, start * 4, count * 4)
        return np.frombuffer(data, _NP[t.dtype]).copy()

    @staticmethod
    def _row_bytes(t: Tensor) -> int:
        return math.prod(t.shape[1:]) * 4 if len(t.shape) > 1 else 4

    def free(self, t: Tensor) -> None:
        gone = {id(b) for *_, b in t.parts}
        for key in [k for k in self._groups if any(id(e[0]) in gone for e in k[1])]:
            del self._groups[key]  # bind groups holding the buffer let it go
        for *_, b in t.parts:
            b.destroy()  # its memory now; the accounting when the object goes
        t.parts = []
        self.generation += 1

    # -- pipelines and submission -----------------------------------------------------------
    def pipeline(self, name: str, code):
        """The compute pipeline of a WGSL shader (entry point `main`), built once per name; code:
        the source, or a function giving it (so a step does not format sources it has built)."""
        if name not in self._pipelines:
            module = self.device.create_shader_module(code=code() if callable(code) else code)
            pipe = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": "main"})
            self._pipelines[name] = pipe
            self._names[id(pipe)] = name
        return self._pipelines[name]

    def uniform(self, *values: int | float) -> object:
        """A small uniform buffer of u32 / f32 scalars (ints as u32, floats as f32), padded to
        16 B; one per distinct set of values (never written after)."""
        key = tuple((type(v) is float, v) for v in values)
        buf = _lru_get(self._uniforms, key)
        if buf is None:
            words = np.zeros(max(4, (len(values) + 3) // 4 * 4), np.uint32)
            for i, v in enumerate(values):
                words[i] = np.float32(v).view(np.uint32) if isinstance(v, float) \
                    else np.uint32(v)
            buf = self.device.create_buffer_with_data(data=words,
                                                      usage=wgpu.BufferUsage.UNIFORM)
            _lru_put(self._uniforms, key, buf)
        return buf

    def bind_group(self, pipeline, buffers: list) -> object:
        """The bind group of `buffers` ((buffer, offset, size) or whole buffers) at 0..n-1."""
        bound = tuple(b if isinstance(b, tuple) else (b, 0, b.size) for b in buffers)
        key = (pipeline, bound)
        group = _lru_get(self._groups, key)
        if group is None:
            entries = [{"binding": i, "resource": {"buffer": buf, "offset": off, "size": size}}
                       for i, (buf, off, size) in enumerate(bound)]
            group = self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0),
                                                  entries=entries)
            _lru_put(self._groups, key, group)
        return group

    def recorder(self) -> Recorder:
        return Recorder(self)

    def profile(self, on: bool = True) -> dict[str, dict[str, float]] | None:
        """Starts timing every dispatch on the GPU (on), or stops and returns the totals per
        label (`section:kernel`, e.g. "gdn:qgemv"): {"ms", "dispatches"}, plus "steps" (the
        submissions timed) under "_". Needs the adapter's timestamp queries."""
        if on:
            if "timestamp-query" not in self.features:
                raise ConfigError(f"{self.name} has no timestamp queries to profile with")
            self.profiler = Profiler(self)
            return None
        prof, self.profiler = self.profiler, None
        return prof.report() if prof is not None else {}


class Profiler:
    """GPU time per dispatch from timestamp queries: in a profiled step every dispatch is its own
    compute pass with begin / end timestamps (the passes' boundaries add a little time of their
    own). Timestamps are read as nanoseconds, WebGPU's unit."""

    CAPACITY = 4096  # queries per step; dispatches past CAPACITY / 2 run untimed, counted

    def __init__(self, dev: VulkanDevice) -> None:
        self.dev = dev
        self.queries = dev.device.create_query_set(type="timestamp", count=self.CAPACITY)
        self.resolved = dev.device.create_buffer(
            size=self.CAPACITY * 8,
            usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        self.ns: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.encode_s = self.wait_s = 0.0  # host time recording the steps, and waiting on them

    def writes(self, index: int) -> dict:
        return {"query_set": self.queries, "beginning_of_pass_write_index": 2 * index,
                "end_of_pass_write_index": 2 * index + 1}

    def collect(self, labels: list[str]) -> None:
        """The submitted step's timestamps read back and added to its labels' totals."""
        n = min(len(labels), self.CAPACITY // 2)
        if n:
            stamps = np.frombuffer(self.dev.device.queue.read_buffer(self.resolved, 0, 16 * n),
                                   np.uint64).astype(np.int64).reshape(n, 2)
            for label, (t0, t1) in zip(labels[:n], stamps, strict=True):
                self.ns[label] += max(0, int(t1 - t0))
                self.count[label] += 1
        if len(labels) > n:
            self.count["untimed"] += len(labels) - n
        self.steps += 1

    def report(self) -> dict[str, dict[str, float]]:
        out = {k: {"ms": self.ns[k] / 1e6, "dispatches": self.count[k]}
               for k in sorted(self.count, key=lambda k: -self.ns.get(k, 0))}
        out["_"] = {"steps": self.steps, "ms": sum(self.ns.values()) / 1e6,
                    "dispatches": sum(self.count.values()), "encode_ms": 1e3 * self.encode_s,
                    "wait_ms": 1e3 * self.wait_s}
        return out


class Recorder:
    """Dispatches recorded into one compute pass; submit() sends them as one command buffer.
    `section` names the part of the model being recorded (the profile's labels)."""

    def __init__(self, dev: VulkanDevice) -> None:
        self.dev = dev
        self.encoder = dev.device.create_command_encoder()
        self.prof = dev.profiler
        self.labels: list[str] = []
        self.cpass = None if self.prof is not None else self.encoder.begin_compute_pass()
        self.dispatches = 0
        self.section = ""
        self.t0 = time.perf_counter()
        self.ops: list[tuple] | None = None  # set to a list: the dispatches are kept for replay

    def dispatch(self, pipeline, buffers: list, groups: tuple[int, int, int]) -> None:
        """buffers: a list of (buffer, offset_bytes, size_bytes) or whole buffers, bound 0..n-1."""
        group = self.dev.bind_group(pipeline, buffers)
        gx, gy, gz = groups
        if max(gx, gy, gz) > self.dev.max_groups:
            raise ValueError(f"dispatch of {groups} workgroups exceeds the adapter's "
                             f"{self.dev.max_groups} per dimension")
        cpass = self.cpass
        if self.prof is not None:
            i = len(self.labels)
            self.labels.append(f"{self.section}:{self.dev._names.get(id(pipeline), '?')}"
                               .split("/")[0])
            cpass = self.encoder.begin_compute_pass(
                timestamp_writes=self.prof.writes(i) if i < self.prof.CAPACITY // 2 else None)
        cpass.set_pipeline(pipeline)
        cpass.set_bind_group(0, group)
        cpass.dispatch_workgroups(gx, gy, gz)
        if self.prof is not None:
            cpass.end()
        if self.ops is not None:
            self.ops.append((pipeline, group, gx, gy, gz))
        self.dispatches += 1

    def replay(self, ops: list[tuple]) -> None:
        """Dispatches kept by an earlier recording (`ops`), encoded again as they were: a decode
        step's ~200 dispatches cost ~3 us each this way against ~25 us through the kernels'
        Python (their uniforms, bind groups and scratch looked up again). Not while profiling."""
        if self.prof is not None:
            raise ValueError("a profiled step is recorded, not replayed")
        cpass = self.cpass
        for pipeline, group, gx, gy, gz in ops:
            cpass.set_pipeline(pipeline)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(gx, gy, gz)
        self.dispatches += len(ops)

    def submit(self) -> None:
        if self.prof is None:
            self.cpass.end()
        else:
            n = min(len(self.labels), self.prof.CAPACITY // 2)
            if n:
                self.encoder.resolve_query_set(self.prof.queries, 0, 2 * n, self.prof.resolved, 0)
        self.dev.device.queue.submit([self.encoder.finish()])
        if self.prof is not None:
            t = time.perf_counter()
            self.prof.encode_s += t - self.t0
            self.prof.collect(self.labels)  # reads the timestamps back: waits for the step
            self.prof.wait_s += time.perf_counter() - t


CACHE_ENTRIES = 4096  # uniform buffers and bind groups kept (least recently used go first)


def _lru_get(cache: OrderedDict, key):
    value = cache.get(key)
    if value is not None:
        cache.move_to_end(key)
    return value


def _lru_put(cache: OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > CACHE_ENTRIES:
        cache.popitem(last=False)
