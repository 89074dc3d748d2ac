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
``stitch``, ``race_runners_up`` and ``orchestrations`` serve the program-level optimizer (OLLIE Algorithm
1, Korch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

from rewriter.ir import ExpressionError
from rewriter.lower import Candidate

from .cuda import CudaBackend
from .measure import MeasurementDB, device_id
from .orchestrate import (
    Orchestration,
    agreeing,
    faster_end_to_end,
    fuse_boundaries,
    fused_kernels,
    orchestrate,
    race_runners_up,
    race_shared_in_place,
    settled,
)
from .program import CompiledProgram, compile_candidate, remeasure, stitch
from .tvm_kernel import vector_lanes


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

    @property
    def lanes(self) -> int:
        """Lanes of this CPU's widest vector of ``dtype``: the block a blocked layout stores."""
        return vector_lanes(self.dtype)

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

    def race_runners_up(
        self, program: CompiledProgram, alternatives: Mapping[str, Sequence[CompiledProgram]], ends: set[str]
    ) -> tuple[CompiledProgram, int]:
        """The stitched program with each subprogram (its kernels up to one of ``ends``) raced
        where it runs against its runners-up (``alternatives``: subprogram output -> programs),
        a runner-up taken where whole runs are faster with it (``race_runners_up``); and how
        many were taken. Done once before orchestration, so that every orchestration method
        starts from the same kernels."""
        return race_runners_up(program, alternatives, ends)

    def orchestrations(
        self,
        program: CompiledProgram,
        required: set[str],
        boundaries: set[str],
        methods: Sequence[str] = ("blp", "greedy"),
        **limits,
    ) -> dict[str, tuple[CompiledProgram, Orchestration]]:
        """Which primitives of a stitched program share a kernel, by each of ``methods``, from
        one set of plans: the greedy fusion across subprogram ``boundaries`` ("greedy"), and
        Korch's BLP over measured candidates ("blp", ``limits``: ``max_primitives``,
        ``time_limit``) that include the greedy plan's fused kernels (within what
        ``time_limit`` leaves after the greedy pass), taken into the greedy plan region by
        region where whole runs say so (``settled``); the greedy plan's fusions are likewise
        taken into the program as given. Each plan is raced where its program runs
        (``race_shared_in_place``) and checked against the program as given on the same inputs
        (``agreeing``): a plan that computes something else is left out, and where none is left
        the program is returned as it is. The plans are then raced end to end in one race
        (``faster_end_to_end``), the program as given ("none") with them: each of the races
        before decides slot by slot on noisy samples, and their choices together may make the
        program slower than it was. Each method keeps its own plan or one it was settled on,
        whichever whole runs find faster beyond doubt; so the BLP's program and the greedy one
        differ in what the BLP adds alone."""
        start = time.perf_counter()
        greedy = fuse_boundaries(program, boundaries, self.db, self.tune)
        plans = {"greedy": settled(program, race_shared_in_place(program, *greedy), (program, Orchestration("none")))}
        if "time_limit" in limits and limits["time_limit"] is not None:  # the greedy pass took its share
            limits["time_limit"] = max(0.0, limits["time_limit"] - (time.perf_counter() - start))
        if "blp" in methods:  # the greedy plan's fused kernels among the BLP's candidates
            blp = orchestrate(program, required, self.db, self.tune, seeds=fused_kernels(*greedy), **limits)
            plans = {"blp": settled(program, race_shared_in_place(program, *blp), plans["greedy"])} | plans
        checked = agreeing(plans, program, required)
        if not checked:  # no plan computes what its kernels compute apart: those kernels, as given
            return {m: (program, Orchestration("none", figures={"disagreed": sorted(plans)})) for m in methods}
        return faster_end_to_end(checked | {"none": (program, Orchestration("none"))}, methods)


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
