"""Which implementation of each op runs, decided in one place.

Each op (an `Op`) holds its implementations, each with a priority and a verifier that says why it
cannot run for a `Case` (device, dtype, the op's shape class, the step's kind), or None when it
can. The choice is made once per (op, case, environment) and cached; DELTASERVE_REFERENCE_OPS is
read here only (every op then runs its `reference`), the other knobs in the verifiers. Layers
call one function per op; `deltaserve ops` prints every op's choice for a model.

The step's context comes with the batch: the model enters `stepping(batch.native_rows,
batch.scratch)` for its forward, so an op deep in a projection knows whether its rows share a step
with a prefill chunk and which arena its temporaries reuse (a context variable, not a module
global: two threads running forwards never see each other's).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from deltaserve.env import env

REFERENCE = "reference"


class Case(NamedTuple):
    """What an implementation's verifier may read: never a tensor, so the choice can be cached
    (a tuple: built and hashed on every op call, in C)."""

    device: str  # torch device type: cpu, cuda
    dtype: torch.dtype  # the op's leading input dtype
    shape: tuple = ()  # the op's shape class (only what its verifiers read)
    native_rows: bool = False  # a step without prefill chunks (see `stepping`)


Verifier = Callable[[Case], "str | None"]


@dataclass(frozen=True, slots=True)
class Impl:
    name: str
    priority: int
    fn: Callable
    why_not: Verifier


class Op:
    """One op's implementations; call it with a Case and the op's arguments."""

    def __init__(self, name: str, doc: str, fields: tuple[str, ...] = ()) -> None:
        """fields: what each element of a Case's shape means (for `deltaserve ops`)."""
        self.name, self.doc, self.fields = name, doc, fields
        self.impls: list[Impl] = []
        self._chosen: dict[Case, Impl] = {}  # for the knobs of _env
        self._env = None
        OPS[name] = self

    def register(self, name: str, priority: int, why_not: Verifier | None = None):
        """Decorator: fn implements the op where why_not(case) is None (always, if omitted)."""
        def add(fn: Callable) -> Callable:
            if any(i.name == name for i in self.impls):
                raise ValueError(f"op {self.name} already has an implementation {name!r}")
            self.impls.append(Impl(name, priority, fn, why_not or (lambda case: None)))
            self.impls.sort(key=lambda i: -i.priority)
            self._chosen.clear()
            return fn
        return add

    def strategy(self, name: str, priority: int, why_not: Verifier | None = None) -> None:
        """An implementation its caller runs itself (an op that is a choice between ways to run
        a step, such as decode_step's one native call or the layers): choose(case).name says."""
        self.register(name, priority, why_not)(None)

    def choose(self, case: Case) -> Impl:
        knobs = env()  # one object until the knobs are re-read: then every choice is made again
        if knobs is not self._env:
            self._chosen.clear()
            self._env = knobs
        impl = self._chosen.get(case)
        if impl is None:
            impl = self._chosen[case] = self._pick(case)
        return impl

    def __call__(self, case: Case, *args, **kwargs):
        return self.choose(case).fn(*args, **kwargs)

    def chooses(self, case: Case, name: str) -> bool:
        return self.choose(case).name == name

    def _pick(self, case: Case) -> Impl:
        if env().reference_ops:
            return self._reference()
        for impl in self.impls:
            if impl.why_not(case) is None:
                return impl
        raise RuntimeError(f"op {self.name}: no implementation runs {case}")

    def _reference(self) -> Impl:
        return self.named(REFERENCE)

    def named(self, name: str) -> Impl:
        """One implementation by name (tests compare each against the reference)."""
        for impl in self.impls:
            if impl.name == name:
                return impl
        raise KeyError(f"op {self.name} has no implementation {name!r}")

    def explain(self, case: Case) -> list[tuple[str, str | None]]:
        """(implementation, why it cannot run or None) in priority order, for `deltaserve ops`."""
        if env().reference_ops:
            return [(i.name, None if i.name == REFERENCE else "DELTASERVE_REFERENCE_OPS=1")
                    for i in self.impls]
        return [(i.name, i.why_not(case)) for i in self.impls]


OPS: dict[str, Op] = {}


@dataclass(frozen=True, slots=True)
class StepContext:
    native_rows: bool = False  # every row a decode or verify row: per-row kernels at any count
    scratch: object = None  # cache/scratch.Scratch of the step (None: temporaries allocate)


_step: contextvars.ContextVar[StepContext] = contextvars.ContextVar(
    "step", default=StepContext())  # noqa: B039 (frozen: never mutated)


@contextlib.contextmanager
def stepping(native_rows: bool, scratch=None):
    """Within: the ops run for one step (the model enters it from its StepBatch): native_rows,
    per-row kernels at any row count so a row's bits never depend on how many share its step;
    scratch, the arena its temporaries reuse."""
    token = _step.set(StepContext(native_rows, scratch))
    try:
        yield
    finally:
        _step.reset(token)


def native_rows() -> bool:
    """Whether the ops run within a step of decode and verify rows only."""
    return _step.get().native_rows


def step_scratch():
    """The current step's scratch arena, or None."""
    return _step.get().scratch


def case(x: torch.Tensor, shape: tuple = ()) -> Case:
    """The Case of an op whose leading input is x, in the current step."""
    return Case(x.device.type, x.dtype, shape, _step.get().native_rows)


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 1


def forget() -> None:
    """Drop every cached choice (a test that fakes a backend; the knobs re-read by env())."""
    for op in OPS.values():
        op._chosen.clear()


def report() -> list[dict]:
    """Every op's choice for each case it has run in this process (under the current knobs):
    the implementation chosen and why each one above it could not run."""
    rows = []
    for op in OPS.values():
        if op._env is not env():
            continue
        for c, impl in sorted(op._chosen.items(), key=lambda kv: str(kv[0])):
            skipped = {}
            for name, why in op.explain(c):
                if name == impl.name:
                    break
                skipped[name] = why
            names = op.fields or tuple(str(i) for i in range(len(c.shape)))
            shape = {k: _text(v) for k, v in zip(names, c.shape, strict=False)}
            rows.append({"op": op.name, "device": c.device, "dtype": _text(c.dtype),
                         "shape": shape, "native_rows": c.native_rows, "chosen": impl.name,
                         "skipped": skipped})
    return rows



def _text(v) -> str:
    return str(v).removeprefix("torch.")
