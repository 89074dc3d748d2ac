"""Backends: what ``derive`` and the program optimizer ask of a code generator.

A backend turns a candidate (``rewriter.lower.Candidate``: kernels in execution order) into an
executable program for its device, measures programs there, and names the device its timings
hold for. ``derive(expr, backend=...)`` takes any object with this interface, so a new device
plugs in without touching the pipeline:

    name: str                          "cpu", "reference", ...
    measures: bool                     whether costs are measured (else analytic)
    device() -> str                    the key measurements are stored under
    compile(candidate, inputs) -> program
    measure(program) -> float          seconds per run, on the device
    remeasure(programs)                time their kernels again, in turns, before a choice
    tolerance: float                   how close a program's results must be to the reference

A program is callable on named inputs (``program(**inputs) -> array``) and has ``kernels``,
``cost`` (seconds per run) and ``timings()`` (each kernel with its measured seconds).
``stitch`` and ``orchestrate`` serve the program-level optimizer (OLLIE Algorithm 1, Korch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Protocol, Sequence

import numpy as np

from rewriter.ir import ExpressionError, tensor_shapes
from rewriter.lower import Candidate

from .cuda import CudaBackend
from .measure import MeasurementDB, device_id
from .orchestrate import Orchestration, fuse_boundaries, orchestrate
from .program import CompiledProgram, compile_candidate, race_in_place, remeasure, stitch


class Backend(Protocol):
    name: str
    measures: bool
    tolerance: float

    def device(self) -> str: ...

    def compile(self, candidate: Candidate, inputs: Mapping[str, tuple[int, ...]]): ...

    def measure(self, program) -> float: ...

    def remeasure(self, programs: Sequence) -> None: ...


@dataclass
class CpuBackend:
    """This CPU: BLAS calls for matched operators, TVM kernels (LLVM) for the rest, timed here
    and remembered in ``db`` (default: the user cache). ``tune`` races that many TVM schedules
    per generated kernel."""

    dtype: str = "float32"
    tune: int = 0
    db: MeasurementDB = field(default_factory=MeasurementDB)
    name: str = field(default="cpu", init=False)
    measures: bool = field(default=True, init=False)

    @property
    def tolerance(self) -> float:
        return 1e-6 if np.dtype(self.dtype) == np.float64 else 1e-3

    def device(self) -> str:
        return device_id()

    def compile(self, candidate: Candidate, inputs: Mapping[str, tuple[int, ...]]) -> CompiledProgram:
        return compile_candidate(candidate, inputs, self.dtype, self.db, self.tune)

    def measure(self, program: CompiledProgram) -> float:
        return program.measure(self.db)

    def remeasure(self, programs: Sequence[CompiledProgram]) -> None:
        remeasure(programs, self.db, max_seconds=0.5)

    def stitch(self, parts, inputs: Mapping[str, tuple[int, ...]]) -> CompiledProgram:
        return stitch(parts, inputs)

    def orchestrate(
        self,
        program: CompiledProgram,
        required: set[str],
        boundaries: set[str],
        method: str = "blp",
        alternatives: Mapping[str, Sequence[CompiledProgram]] | None = None,
        **limits,
    ) -> tuple[CompiledProgram, Orchestration]:
        """Which primitives of a stitched program share a kernel: Korch's BLP over measured
        candidates ("blp", ``limits``: ``max_primitives``, ``time_limit``), or the greedy
        fusion across subprogram ``boundaries`` ("greedy"); then the plan raced where the program
        runs (``race_shared_in_place``, with the subprograms' runners-up ``alternatives``)."""
        if method == "greedy":
            orchestrated, plan = fuse_boundaries(program, boundaries, self.db, self.tune)
        else:
            orchestrated, plan = orchestrate(program, required, self.db, self.tune, **limits)
        return race_shared_in_place(program, orchestrated, plan, alternatives)


def race_shared_in_place(
    stitched: CompiledProgram,
    orchestrated: CompiledProgram,
    plan: Orchestration,
    runners_up: Mapping[str, Sequence[CompiledProgram]] | None = None,
) -> tuple[CompiledProgram, Orchestration]:
    """The orchestrated program checked where it runs (``race_in_place``): each kernel that
    computes several primitives against those primitives' own kernels (from ``stitched``), each
    kernel that a subprogram's derivation chose against its runners-up (``runners_up``: output
    -> compiled programs, where orchestration left that kernel as it was), then every kernel's
    implementations. The plan loses the shared kernels taken apart; ``figures`` counts them
    (``apart_in_place``) and the runners-up taken (``runners_up_in_place``)."""
    constant = set(stitched.constants)
    apart = {
        k.output: [[s for s in stitched.steps if s.kernel.output in k.primitives and s.kernel.output not in constant]]
        for k in plan.shared
    }
    made = {s.kernel.output: s.kernel.expr for s in stitched.steps}
    kept = {s.kernel.output for s in orchestrated.steps if made.get(s.kernel.output) == s.kernel.expr}
    runners_up = {n: programs for n, programs in (runners_up or {}).items() if n in kept and n not in apart}
    others = {
        name: [[s for s in p.steps if s.kernel.output not in p.constants] for p in programs]
        for name, programs in runners_up.items()
    }
    extra = {n: v for programs in runners_up.values() for p in programs for n, v in p.constants.items()}
    orchestrated = replace(orchestrated, constants=extra | orchestrated.constants, buffers={})
    raced, picks = race_in_place(orchestrated, apart | others)
    raced, _ = race_in_place(raced)  # the implementations of the kernels the first race put back
    before = {s.kernel.output: s.kernel.expr for s in orchestrated.steps}
    after = {s.kernel.output: s.kernel.expr for s in raced.steps}
    changed = {n for n in picks if after.get(n) != before[n]}  # another kernel computes it now
    separated = changed & set(apart)
    plan = replace(plan, shared=[k for k in plan.shared if k.output not in separated])
    plan.figures["apart_in_place"] = len(separated)
    plan.figures["runners_up_in_place"] = len(changed & set(others))
    used = {n for s in raced.steps for n in tensor_shapes(s.kernel.expr)} | {s.kernel.output for s in raced.steps}
    raced.constants = {n: v for n, v in raced.constants.items() if n in used}  # runners-up's, if not taken
    return raced.prepare(), plan


@dataclass
class ReferenceBackend:
    """No code generation: a candidate runs as it is (BLAS for matched matmuls, the reference
    semantics for every other kernel) and costs the analytic stand-in. For looking at what the
    search finds without compiling; never for timing."""

    rtol: float = 1e-6
    name: str = field(default="reference", init=False)
    measures: bool = field(default=False, init=False)

    @property
    def tolerance(self) -> float:
        return self.rtol

    def device(self) -> str:
        return "analytic"

    def compile(self, candidate: Candidate, inputs: Mapping[str, tuple[int, ...]]) -> Candidate:
        return candidate

    def measure(self, program: Candidate) -> float:
        return program.cost

    def remeasure(self, programs: Sequence[Candidate]) -> None:
        pass


BACKENDS = {"cpu": CpuBackend, "reference": ReferenceBackend, "cuda": CudaBackend}


def as_backend(backend: str | Backend) -> Backend:
    """A backend object from itself or from its name (``"cpu"``, ``"reference"``, ``"cuda"``)."""
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise ExpressionError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[backend]()
