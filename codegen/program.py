"""Compiled programs: a candidate's kernels as calls over preallocated buffers, timed and saved.

``compile_candidate(candidate, inputs)`` turns a derived candidate (``rewriter.instantiate``) into
a ``CompiledProgram``:

* a matched operator runs the implementations its record lists for this backend
  (``Operator.implementations["cpu"]``, ``rewriter.lower.operators``), raced by measurement:
  "blas" (Matmul / BatchMatmul: numpy's BLAS on strided views of the operands, in place, by
  the strides the iterator mapping table found), "packed" (a kernel summing over a weight read
  along its vector lanes, a Matmul's or an eOperator's with its epilogue: its scope by TVM, the
  weight laid out in panels once, ``codegen.packed``), "packed_wide" (the same in rows of six
  vectors where AVX-512 has room for them: which is faster depends on the CPU),
  "transposed" (Matmul over one weight whose output runs along the other operand: the product
  computed with lanes along the weight's rows, over the weight laid out k-major in panels once, then
  transposed into the output, ``codegen.packed``),
  "im2col" (a convolution as im2col + batched BLAS, ``codegen.im2col``), "panels" (a
  convolution whose weight is a weight: TVM directly over the weight laid out in panels of
  output channels once, ``codegen.panels``), "band" (a band matmul
  as blocked batched BLAS, ``codegen.band``), "tvm" (its scope compiled by TVM,
  ``codegen.tvm_kernel``);
* an eOperator is its scope compiled by TVM, raced against "packed" (and "packed_wide",
  "transposed", "panels") where that applies; ``tune``
  races a few TVM schedules per kernel;
* an opaque operation (a gather by run-time indices) runs its numpy function, "opaque";
* kernels that read only weights run once, when ``bind`` is given their values (OLLIE 5.4), and
  the weights an implementation reads laid out are laid out then (``prepare``).

``measure(db)`` times each distinct kernel once on this device (``codegen.measure``), and the
program's cost is the sum of its kernels' medians. ``save(dir)`` / ``load(dir)`` keep a program
(kernel texts, compiled libraries, bound weights) so it runs again without searching.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

from rewriter.ir import ExpressionError, Opaque, parse, rename_tensors, tensor_shapes
from rewriter.lower import (
    OPERATORS,
    Candidate,
    GemmMatch,
    Kernel,
    fuse,
    fusion_pairs,
    match_operator,
    multiply_adds,
    run_gemm,
)
from rewriter.semantics import bound_constants, run_opaque

from .band import band_call
from .im2col import im2col_call
from .measure import (
    MeasurementDB,
    Race,
    last_level_cache,
    median_interval,
    race_in_turns,
    signature,
    time_callable,
    time_in_turns,
)
from .native import OUTPUT, NativeRun, driver
from .packed import packed_call, packed_wide_call, transposed_call
from .panels import panels_call
from .tvm_kernel import (
    CODEGEN_VERSION,
    CodegenError,
    Schedule,
    TvmKernel,
    aligned_copy,
    aligned_empty,
    bindable,
    candidate_schedules,
    compile_scope,
    is_aligned,
    load_kernel,
    unmerged_views,
    viewed,
)

BACKEND = "cpu"  # the key of this code generator's implementations in an operator record
# an eOperator is compiled from its scope (its weights in panels), or one with a product inside
# it computes the product in a layout of its own and its epilogue where it lays the product out
EOP_IMPLEMENTATIONS = ("tvm", "packed", "packed_wide", "transposed", "panels")
# kernels compiled at once (``compiled_in_batches``): one per CPU this process may run on
COMPILE_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
T, R = TypeVar("T"), TypeVar("R")


def _blas_call(kernel: Kernel, dtype: str):
    if not isinstance(kernel.match, GemmMatch):
        return None

    def call(values, out):
        run_gemm(kernel.match, values, out.shape, out)

    return call


def _opaque_call(kernel: Kernel, dtype: str):
    if kernel.kind != "opaque":
        return None

    def call(values, out):
        out[...] = run_opaque(kernel.expr, values)

    return call


# implementation name -> (kernel, dtype) -> (values, out) -> None, or None where it does not apply.
# A call with a ``prepare(values)`` method lays out the bound weights it reads once (``bind``).
LIBRARY_CALLS = {
    "blas": _blas_call,
    "packed": packed_call,
    "packed_wide": packed_wide_call,
    "transposed": transposed_call,
    "im2col": im2col_call,
    "panels": panels_call,
    "band": band_call,
    "opaque": _opaque_call,
}


@dataclass
class Step:
    """One kernel call: ``impl`` names its implementation ("blas", "im2col", "band", "tvm");
    ``seconds`` is its measured median."""

    kernel: Kernel
    impl: str
    call: Callable[[dict, np.ndarray], None]  # (values, out) -> writes out
    compiled: TvmKernel | None = None
    seconds: float | None = None

    def signature(self, dtype: str) -> str:
        """The measurement key: what runs, and for the code this package generates its version
        (a change to the lowering or to a product's layout must not reuse the old code's timings)."""
        shapes = sorted(tensor_shapes(self.kernel.expr).items())
        schedule = self.compiled.schedule if self.compiled else None
        version = CODEGEN_VERSION  # every implementation's call is this package's code
        cold = "weights cold" if self.kernel.weights else None  # how ``_timing_call`` times it
        return signature(
            "kernel", self.impl, self.kernel.kind, self.kernel.expr, shapes, dtype, schedule, version, cold
        )

    def renamed(self, names: Mapping[str, str], dtype: str) -> Step:
        """This call over renamed tensors: the same compiled code and measured time."""
        kernel = self.kernel.renamed(dict(names))
        if self.impl == "tvm":
            compiled = self.compiled.renamed(kernel.expr)
            return Step(kernel, "tvm", _tvm_call(compiled), compiled, self.seconds)
        return replace(_step(kernel, self.impl, dtype), seconds=self.seconds)


class _Dispatch:
    """A program's kernel calls bound to their arguments once. Planned buffers, constants and
    laid-out weights stay where they are between runs, so a run sets only the arrays that change
    (the inputs and the outputs made afresh) and calls the kernels in turn. Consecutive compiled
    kernels (a call with a ``native`` description: its TVM functions and their arguments by name)
    run as one ``NativeRun``, one call into C for all of them, each argument bound as the view its
    kernel takes (``TvmKernel.views``: merged loops' dimensions merged). Any other call (a
    library call through numpy, one reading a weight laid out afresh each call) is called from
    Python between such runs: a program of compiled kernels only is one native call.

    ``sinks`` (per step of the program, a list or None): each run appends to a step's list its
    seconds in that run, a compiled kernel's read by the native loop's own clock
    (``NativeRun(clocked=True)``), any other call's around it in Python; the run is the same
    native calls as one without a clock."""

    def __init__(
        self,
        values: dict[str, np.ndarray],
        per_run: Sequence[str],
        dtype: str,
        sinks: Sequence[list[float] | None] | None = None,
    ) -> None:
        self.values = values  # what calls read by name: constants, weights, buffers, and per run the rest
        self.per_run = set(per_run)  # names a run sets (inputs; outputs made afresh join as added)
        self.fresh: dict[str, tuple[int, ...]] = {}  # outputs made afresh -> their shapes
        self.dtype = dtype
        self.calls: list[Callable[[], None]] = []
        self.natives: list[NativeRun] = []
        self.sinks = sinks
        self.owners: dict[int, list[list[float] | None]] = {}  # per native run, each call's step's sink

    def add(self, step: Step, out: np.ndarray | None, index: int = 0) -> None:
        """Bind ``step`` (the program's ``index``-th) writing into ``out`` (None: a new array each run)."""
        name = step.kernel.output
        if out is None:
            self.fresh[name] = tuple(step.kernel.expr.shape)
            self.per_run.add(name)
        else:
            self.values[name] = out
        sink = self.sinks[index] if self.sinks is not None else None
        native = self._native(step, name)
        if native is None:
            call, values = step.call, self.values
            self.calls.append(lambda: call(values, values[name]))
            if sink is not None:
                self.calls[-1] = _clocked(self.calls[-1], sink)
            return
        if not self.calls or not isinstance(self.calls[-1], NativeRun):
            self.natives.append(NativeRun(self.dtype, clocked=self.sinks is not None))
            self.calls.append(self.natives[-1])
            self.owners[id(self.natives[-1])] = []
        for function, args, views in native:
            self.calls[-1].add(function, args, views, str(step.kernel))
            self.owners[id(self.calls[-1])].append(sink)

    def _native(self, step: Step, name: str) -> list | None:
        """The step's native calls with each argument bound (a per-run name, or its array), or
        None where it has none or reads an array it cannot take as it is."""
        described = getattr(step.call, "native", None)
        if described is None or driver() is None:
            return None
        bound = []
        for function, args, views in described:
            resolved = []
            for arg in args:
                arg = name if arg is OUTPUT else arg
                if isinstance(arg, str) and arg not in self.per_run:
                    arg = self.values.get(arg)
                if arg is None or not (isinstance(arg, str) or is_aligned(arg)):
                    return None
                resolved.append(arg)
            bound.append((function, resolved, views))
        return bound

    def run(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One run with the per-run ``arrays`` (every input); returns the outputs made afresh.
        Nothing of the run is held afterwards."""
        made = {n: aligned_empty(shape, self.dtype) for n, shape in self.fresh.items()}
        current = {**arrays, **made}
        self.values.update(current)
        for native in self.natives:
            for name in native.slots:
                native.set(name, current[name])
        try:
            for call in self.calls:
                call()
        finally:
            self.values.update(dict.fromkeys(current))
        if self.sinks is not None:
            self._record()
        return made

    def _record(self) -> None:
        """Each step's seconds of the run just made into its sink (its native calls summed)."""
        sinks: dict[int, list[float]] = {}
        totals: dict[int, float] = {}
        for native in self.natives:
            for sink, seconds in zip(self.owners[id(native)], native.seconds()):
                if sink is not None:
                    sinks[id(sink)] = sink
                    totals[id(sink)] = totals.get(id(sink), 0.0) + seconds
        for key, sink in sinks.items():
            sink.append(totals[key])


def _clocked(call: Callable[[], None], sink: list[float]) -> Callable[[], None]:
    """``call`` timed in Python, its seconds appended to ``sink`` (a call no native loop makes)."""

    def timed() -> None:
        start = time.perf_counter()
        call()
        sink.append(time.perf_counter() - start)

    return timed


@dataclass(frozen=True)
class BufferPlan:
    """Where each intermediate lives: ``slot[tensor]`` indexes ``sizes`` (elements); tensors
    sharing a slot are never live at once."""

    slot: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    sizes: list[int]


def plan_buffers(steps: Sequence[Step], unplanned: set[str]) -> BufferPlan:
    """A liveness plan for the intermediates of ``steps`` not in ``unplanned`` (outputs made
    afresh, constants): in step order, each output takes the smallest free slot that holds it
    (a new one if none does), and a tensor's slot is freed after its last reader has run, never
    before its own step's output is placed (a kernel never writes over what it reads).

    As onnxruntime's arena does: a model whose every intermediate had memory of its own wrote
    each into memory last touched a whole run earlier, far out of cache (MobileNetV2: 10.2 ms of
    kernels in the model against 7.1 ms for the same calls repeated on their buffers)."""
    twice = sorted(name for name, n in Counter(s.kernel.output for s in steps).items() if n > 1)
    if twice:  # the first one's readers would read the second one's buffer, planned for its own life
        raise RuntimeError(f"a program makes {', '.join(twice)} more than once")
    last_read: dict[str, int] = {}
    for index, step in enumerate(steps):
        for name in tensor_shapes(step.kernel.expr):
            last_read[name] = index
    slot, shapes, sizes, free = {}, {}, [], []
    for index, step in enumerate(steps):
        name = step.kernel.output
        if name not in unplanned:
            shapes[name] = tuple(step.kernel.expr.shape)
            size = int(np.prod(shapes[name]))
            fits = [s for s in free if sizes[s] >= size]
            if fits:
                slot[name] = min(fits, key=lambda s: sizes[s])
                free.remove(slot[name])
            else:
                slot[name] = len(sizes)
                sizes.append(size)
        ends = [t for t in tensor_shapes(step.kernel.expr) if last_read[t] == index and t in slot]
        if name in slot and last_read.get(name, -1) <= index:
            ends.append(name)
        free += [slot[t] for t in ends]
    return BufferPlan(slot, shapes, sizes)


@dataclass(frozen=True)
class ImplementationShare:
    """A program's kernels of one implementation (``CompiledProgram.by_implementation``)."""

    impl: str
    kernels: int
    seconds: float
    multiply_adds: int

    @property
    def gflops(self) -> float:
        """Their arithmetic rate, 2 flops a multiply-add (0 where they sum nothing)."""
        return 2 * self.multiply_adds / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class CompiledProgram:
    """A candidate program compiled for this CPU: ``program(**inputs) -> np.ndarray``.

    Intermediates live in buffers planned by liveness (``plan_buffers``: a tensor no later step
    reads gives its memory to the next one), allocated on the first call and reused (the result
    is a new array each call), so one program must not be called from two threads at once. The
    first call also binds every kernel call to its buffers (``_Dispatch``): a run is then one
    native call for each stretch of compiled kernels (``codegen.native``), with any library call
    through numpy made from Python between them."""

    steps: list[Step]
    inputs: dict[str, tuple[int, ...]]
    dtype: str = "float32"
    source: object = field(default=None, repr=False)  # the search state the candidate came from
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # bound weight-only outputs
    buffers: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)  # planned slots, reused
    # bound weights as the implementations that read them lay them out (a packed matmul's panels)
    prepared: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    _dispatches: dict[tuple, _Dispatch] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.inputs = {name: tuple(shape) for name, shape in self.inputs.items()}
        reads = set().union(*(tensor_shapes(s.kernel.expr) for s in self.steps))
        tables = bound_constants(reads - set(self.constants))  # a rule's constant tables bind themselves
        if tables:
            self.constants = {**{n: _aligned(v, self.dtype) for n, v in tables.items()}, **self.constants}

    @property
    def kernels(self) -> list[Kernel]:
        return [s.kernel for s in self.steps]

    @property
    def output(self) -> str:
        return self.steps[-1].kernel.output

    @property
    def cost(self) -> float:
        """Measured seconds per run (weight-only kernels run once at build time: not counted)."""
        if any(s.seconds is None for s in self._timed()):
            raise RuntimeError("CompiledProgram.cost: call measure() first")
        return sum(s.seconds for s in self._timed())

    def _timed(self) -> list[Step]:
        return [s for s in self.steps if not s.kernel.weight_only and s.kernel.output not in self.constants]

    def __call__(self, **inputs) -> np.ndarray:
        return self.run(inputs)[self.output]

    def run(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The inputs and outputs of one run on ``inputs``: the last kernel's output and
        ``outputs``, each a new array. Intermediates stay in the planned buffers.

        Each line here runs every call, after kernels that have flushed Python's own code and
        data from the caches: MobileNetV2's checks and bindings took 18 us a run warm and
        120-150 in place (DESIGN.md, "Measuring"), so an input as the kernels take it passes
        one test (``bindable``), and every address is taken in C (``address``)."""
        if any(name in self.constants for name in inputs):  # laid-out weights and weight-only outputs came from them
            kept = {n: v for n, v in self.constants.items() if n in self.inputs and n not in inputs}
            return self.rebound(kept).run(inputs, outputs)
        given, missing = {}, []
        for name, shape in self.inputs.items():
            value = inputs.get(name)
            if value is None:
                if name not in self.constants:
                    missing.append(name)
            elif type(value) is np.ndarray and value.shape == shape and value.dtype == self._dtype and bindable(value):
                given[name] = value
            else:
                given[name] = self._converted(name, value)
        if missing:
            raise ExpressionError(f"missing input tensor(s): {', '.join(sorted(missing))}")
        fresh = (self.output, *outputs)
        dispatch = self._dispatches.get(fresh)
        if dispatch is None:
            dispatch = self._dispatches[fresh] = self._dispatch(fresh)
        return {**given, **dispatch.run(given)}

    def _converted(self, name: str, value) -> np.ndarray:
        """``value`` as the kernels take input ``name``: checked for its shape, in the program's
        dtype, C-contiguous and aligned (a copy where it is not)."""
        shape = np.shape(value)
        if shape != self.inputs[name]:
            raise ExpressionError(f"input {name} has shape {shape}, the program expects {self.inputs[name]}")
        return _aligned(value, self.dtype)

    @functools.cached_property
    def _dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    def _dispatch(self, fresh: tuple[str, ...], sinks: Sequence[list[float] | None] | None = None) -> _Dispatch:
        """The steps' calls bound to their buffers for runs that return ``fresh`` new arrays
        (``sinks``: per step, where its seconds go each run; ``_Dispatch``)."""
        plan = plan_buffers(self.steps, set(fresh) | set(self.constants))
        per_run = [n for n in self.inputs if n not in self.constants]
        dispatch = _Dispatch({**self.constants, **self.prepared}, per_run, self.dtype, sinks)
        for index, step in enumerate(self.steps):
            if step.kernel.output not in self.constants:
                name = step.kernel.output
                dispatch.add(step, None if name in fresh else self._buffer(plan, name), index)
        return dispatch

    def _buffer(self, plan: BufferPlan, name: str) -> np.ndarray:
        """``name``'s planned memory (kept between calls: allocating it afresh costs page faults
        on every call), as an array of its shape."""
        slot, shape = plan.slot[name], plan.shapes[name]
        size = plan.sizes[slot]
        if slot not in self.buffers or self.buffers[slot].size < size:
            self.buffers[slot] = aligned_empty((size,), self.dtype)
        return self.buffers[slot][: int(np.prod(shape))].reshape(shape)

    def rebound(self, weights: Mapping[str, np.ndarray]) -> CompiledProgram:
        """A new program with the same compiled kernels and measured times, bound to ``weights``
        (an equal subprogram of a model with its own weights)."""
        return CompiledProgram(self.steps, self.inputs, self.dtype, self.source).bind(weights)

    def timings(self) -> list[tuple[Kernel, float]]:
        """Each kernel that runs per call, with its measured seconds."""
        return [(s.kernel, s.seconds) for s in self._timed() if s.seconds is not None]

    def bind(self, weights: Mapping[str, np.ndarray]) -> CompiledProgram:
        """Fix ``weights`` as constants and evaluate the kernels that read only them, once
        (compile-time evaluation, OLLIE 5.4); the program then takes the other inputs alone."""
        self.constants.update({n: _aligned(v, self.dtype) for n, v in weights.items()})
        values = dict(self.constants)
        for step in self.steps:
            if step.kernel.weight_only and set(tensor_shapes(step.kernel.expr)) <= set(values):
                out = aligned_empty(step.kernel.expr.shape, self.dtype)
                step.call(values, out)
                values[step.kernel.output] = self.constants[step.kernel.output] = out
        return self.prepare()

    def prepare(self) -> CompiledProgram:
        """Lay the bound weights out for the implementations that read them in a layout of their
        own (their calls' ``prepare``: a packed matmul's panels), once rather than every run."""
        self._dispatches.clear()  # bound to the weights as they were
        self.prepared = {}
        for step in self.steps:
            if hasattr(step.call, "prepare"):
                self.prepared.update(step.call.prepare(self.constants))
        return self

    def measure(self, db: MeasurementDB | None = None, seed: int = 0, **timing) -> float:
        """Time every kernel on random inputs of its shapes (once per signature with a database)."""
        rng = np.random.default_rng(seed)
        for step in self._timed():
            run = _timing_call(step, self.dtype, rng)
            result = db.measure(step.signature(self.dtype), run, **timing) if db else time_callable(run, **timing)
            step.seconds = result.median
        return self.cost

    def listing(self) -> str:
        """One line per kernel: output, kind, implementation, operand shapes (and strides), time."""
        lines = []
        for step in self.steps:
            k = step.kernel
            reads = ", ".join(f"{n}{list(s)}" for n, s in tensor_shapes(k.expr).items())
            strides = f" strides a={k.match.a.strides} b={k.match.b.strides}" if isinstance(k.match, GemmMatch) else ""
            timed = (
                "weights, once"
                if k.weight_only
                else (f"{step.seconds * 1e3:.3f} ms" if step.seconds is not None else "-")
            )
            lines.append(f"{k.output}{list(k.expr.shape)} = {k.kind} [{step.impl}] ({reads}){strides}  {timed}")
        return "\n".join(lines)

    def by_implementation(self, seconds: Sequence[float | None] | None = None) -> list[ImplementationShare]:
        """The kernels that run per call grouped by implementation, most time first: how many,
        their seconds summed (``seconds``, per step, else each step's recorded time) and their
        summations' multiply-adds. Where the time lies bounds what orchestration can still
        save: it fuses and orders generated kernels, and a library product at the rate of the
        machine's best library leaves nothing to fuse away."""
        seconds = [s.seconds for s in self.steps] if seconds is None else seconds
        runs = {id(s) for s in self._timed()}
        groups: dict[str, ImplementationShare] = {}
        for step, taken in zip(self.steps, seconds):
            if id(step) not in runs or taken is None:
                continue
            group = groups.get(step.impl, ImplementationShare(step.impl, 0, 0.0, 0))
            groups[step.impl] = ImplementationShare(
                step.impl,
                group.kernels + 1,
                group.seconds + taken,
                group.multiply_adds + multiply_adds(step.kernel.expr),
            )
        return sorted(groups.values(), key=lambda g: -g.seconds)

    def save(self, directory: str | Path) -> Path:
        """Write the program (kernel texts, libraries, bound weights) to ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        entries = []
        for index, step in enumerate(self.steps):
            k = step.kernel
            entry = {
                "kind": k.kind,
                "output": k.output,
                "expr": str(k.expr),
                "shapes": tensor_shapes(k.expr),
                "impl": step.impl,
                "weight_only": k.weight_only,
                "weights": sorted(k.weights),
                "seconds": step.seconds,
            }
            if step.compiled is not None and step.compiled.path is not None:
                entry["library"] = f"kernel{index}.so"
                shutil.copyfile(step.compiled.path, directory / entry["library"])
                entry["schedule"] = step.compiled.schedule.__dict__
                entry["views"] = step.compiled.views
            entries.append(entry)
        for name, value in self.constants.items():
            np.save(directory / f"{name}.npy", value)
        meta = {"dtype": self.dtype, "inputs": self.inputs, "kernels": entries, "constants": sorted(self.constants)}
        (directory / "program.json").write_text(json.dumps(meta, indent=1))
        return directory


def load(directory: str | Path, operators=OPERATORS) -> CompiledProgram:
    """A program saved by ``CompiledProgram.save``, ready to run (nothing is searched again).
    Its kernels are matched again against ``operators`` (pass the records of operators that
    are not registered, if the program uses them)."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "program.json").read_text())
    except (OSError, ValueError) as err:
        raise ExpressionError(f"{directory}: not a saved program ({err})") from None
    dtype, steps = meta["dtype"], []
    for entry in meta["kernels"]:
        expr = parse(entry["expr"], {n: tuple(s) for n, s in entry["shapes"].items()})
        kind, match = ("opaque", None) if isinstance(expr, Opaque) else match_operator(expr, operators)
        match = match if kind == entry["kind"] else None
        kernel = Kernel(
            entry["kind"], entry["output"], expr, match, entry["weight_only"], frozenset(entry.get("weights", ()))
        )
        library = directory / entry["library"] if "library" in entry else None
        schedule = Schedule(**entry["schedule"]) if "schedule" in entry else None
        views = entry.get("views") or unmerged_views(expr)  # saved before loops merged: the scope's shapes
        step = _step(kernel, entry["impl"], dtype, library=library, schedule=schedule, views=views)
        step.seconds = entry.get("seconds")
        steps.append(step)
    constants = {name: np.load(directory / f"{name}.npy") for name in meta["constants"]}
    inputs = {n: tuple(s) for n, s in meta["inputs"].items()}
    return CompiledProgram(
        steps, inputs, dtype, constants={n: _aligned(v, dtype) for n, v in constants.items()}
    ).prepare()


def remeasure(
    programs: Sequence[CompiledProgram], db: MeasurementDB | None = None, rounds: int = 3, seed: int = 0, **timing
) -> None:
    """Time the kernels of ``programs`` again, in turns (``time_in_turns``), and keep each one's
    new median (in ``db`` too, replacing the stored timing). The fastest few candidates are
    compared this way before one is chosen: their kernels were measured at different times,
    some in earlier searches, and a slow spell then would decide the choice."""
    rng = np.random.default_rng(seed)
    steps: dict[str, list[Step]] = {}
    calls = {}
    for program in programs:
        for step in program._timed():
            key = step.signature(program.dtype)
            if key not in calls:
                calls[key] = _timing_call(step, program.dtype, rng)
            steps.setdefault(key, []).append(step)
    for key, timing in time_in_turns(calls, rounds, **timing).items():
        for step in steps[key]:
            step.seconds = timing.median
        if db is not None:
            db.put(key, timing)


# An alternative whose in-place time is this many times the best one's leaves the race (timed
# twice past its cold run): each run of the program runs one alternative of every raced kernel,
# so a slow one would otherwise slow ``rounds`` runs, each of them a whole run of the program.
_BEHIND = 2.0


def race_in_place(
    program: CompiledProgram, alternatives: Mapping[str, Sequence[Sequence[Step]]] | None = None, rounds: int = 6
) -> CompiledProgram:
    """``program`` with each kernel's implementation chosen by its time where the program runs
    it: every kernel with several implementations (a product: BLAS, packed, TVM), or with
    ``alternatives`` (by its output: other steps computing it, such as the kernels a fused
    kernel was made of), takes each in turn across ``rounds`` runs per alternative of the whole
    program (on zeros), each call timed where it stands, and the one with the least median is
    kept; each kept step's ``seconds`` becomes its median there (an alternative ``_BEHIND``
    times slower than the best leaves the race early). An alternative of several steps also
    runs with each of its steps taking each of its implementations; one that reads a tensor the
    program does not make by then, or has no steps (it would never be timed), is left out.

    Timed alone, a kernel runs with both cores awake and its inputs in cache; in a program it
    follows other kernels, and its times and their ranking differ (measured here: BERT-base's
    query-key-value product, TVM's 0.52 ms and packed 0.58 ms alone, 0.76 and 0.68 after 3 ms of
    other work on one core). The implementations' own measurements decide what is compiled;
    this race (``race_slots``) decides among what was compiled, as the program is used."""
    slots = []  # per step of the program: its alternatives, each a list of steps
    available = set(program.inputs) | set(program.constants)
    for step in program.steps:
        found = [[step]]
        if not (step.kernel.weight_only or step.kernel.output in program.constants):
            for given in (alternatives or {}).get(step.kernel.output, ()):
                if given and runs_on(given, available):  # (a tensor orchestration fused away is no input)
                    found += _variants(list(given), program.dtype)
            found += [[o] for o in _options(step, program.dtype) if o.impl != step.impl]
        slots.append(found)
        available.add(step.kernel.output)
    if all(len(found) == 1 for found in slots):
        return program
    chosen = []
    for found, (k, seconds) in zip(slots, race_slots(program, slots, rounds)):
        chosen += [replace(s, seconds=t) if t is not None else s for s, t in zip(found[k], seconds)]
    return replace(program, steps=_made_once(chosen), constants=dict(program.constants), buffers={}).prepare()


def race_slots(
    program: CompiledProgram, slots: Sequence[Sequence[Sequence[Step]]], rounds: int = 6
) -> list[tuple[int, list[float | None]]]:
    """Per slot of ``slots`` (the program's steps in order, each slot a list of alternatives,
    each a list of steps that compute the same tensors from what the slots before make), the
    alternative whose steps' summed median time is least where the program runs them, and each
    of its steps' median seconds there (None where the slot was not raced): the slots with
    several alternatives take each in turn across ``rounds`` runs per alternative of the whole
    program (on zeros), each call timed where it stands; an alternative ``_BEHIND`` times slower
    than the best leaves the race early. ``program`` gives the inputs, constants and dtype.

    Each slot takes its alternatives in an order of its own, shuffled anew each cycle: in step,
    slots with as many alternatives would always run their k-th ones together (every product of
    a program its BLAS call in one run, its TVM kernel in the next), and each would be timed
    beside neighbours the program it is chosen for may not have (a BLAS call after a TVM
    kernel wakes another thread pool).

    Slots alike up to tensor names (every layer's products, where the program repeats a layer)
    are decided together, on the samples of all of them: decided apart, each on its own few
    samples, identical layers of one program could take different implementations, and a
    choice on twelve times the samples is less often one that a fast moment made."""
    raced = [i for i, found in enumerate(slots) if len(found) > 1]
    if not raced:
        return [(0, [None] * len(found[0])) for found in slots]
    alike: dict[tuple, list[int]] = {}
    for i in raced:
        alike.setdefault(tuple(_form(alternative) for alternative in slots[i]), []).append(i)
    pool = {i: group for group in alike.values() for i in group}
    prepared = dict(program.prepared)
    for step in (s for i in raced for found in slots[i] for s in found):
        if hasattr(step.call, "prepare"):
            prepared.update(step.call.prepare(program.constants))
    samples: dict[tuple, list[float]] = {}  # (slot, alternative, step) -> seconds per run
    live = {i: list(range(len(slots[i]))) for i in raced}  # the alternatives still in the race
    upcoming: dict[int, list[int]] = {i: [] for i in raced}  # each slot's order for this cycle
    rng = np.random.default_rng(0)
    buffers: dict[str, np.ndarray] = {}

    def median(i: int, k: int) -> float:  # over the samples of every slot alike (each one's cold run left out)
        warm = [[t for i2 in pool[i] for t in samples.get((i2, k, j), [])[1:]] for j in range(len(slots[i][k]))]
        return sum(float(np.median(w)) if w else _median(samples[i, k, j]) for j, w in enumerate(warm))

    def next_alternative(i: int) -> int:
        upcoming[i] = [k for k in upcoming[i] if k in live[i]] or [int(k) for k in rng.permutation(live[i])]
        return upcoming[i].pop()

    while any(len(samples.get((i, k, 0), ())) < 1 + rounds for i in raced for k in live[i]):
        steps, sinks = [], []
        for i, found in enumerate(slots):
            k = next_alternative(i) if i in live else 0
            steps += found[k]
            sinks += [samples.setdefault((i, k, j), []) if i in live else None for j in range(len(found[k]))]
        trial = CompiledProgram(
            _made_once(steps, timed=True), program.inputs, program.dtype, constants=program.constants, buffers=buffers
        )
        trial.prepared = prepared
        _watched(trial, sinks, buffers)()
        for i in raced:  # an alternative far behind the best, each timed twice past its cold run, leaves
            if all(len(samples.get((i, k, 0), ())) >= 3 for k in live[i]):
                best = min(median(i, k) for k in live[i])
                live[i] = [k for k in live[i] if median(i, k) <= _BEHIND * best]
    choices = []
    for i, found in enumerate(slots):
        if i not in live:
            choices.append((0, [None] * len(found[0])))
            continue
        best = min(live[i], key=lambda k: median(i, k))
        choices.append((best, [_median(samples[i, best, j]) for j in range(len(found[best]))]))
    return choices


def _form(steps: Sequence[Step]) -> tuple:
    """What ``steps`` run, up to tensor names: each one's implementation, kernel and schedule
    over names given in order of first use (so two layers' products are alike)."""
    names: dict[str, str] = {}
    for step in steps:
        for name in [*tensor_shapes(step.kernel.expr), step.kernel.output]:
            names.setdefault(name, f"T{len(names)}")
    return tuple(
        (s.impl, s.kernel.kind, rename_tensors(s.kernel.expr, names), s.compiled.schedule if s.compiled else None)
        for s in steps
    )


def _made_once(steps: list[Step], timed: bool = False) -> list[Step]:
    """``steps`` less each one whose tensor an earlier one makes (``timed``: each such one writing a
    tensor of its own instead, read by none, so that a race still times it): two kernels taken apart
    into their primitives make a primitive they both inlined twice (Korch's recomputation), and a
    tensor made twice is one name for two planned buffers (``plan_buffers`` refuses it)."""
    made: set[str] = set()
    kept = []
    for step in steps:
        name = step.kernel.output
        if name not in made:
            made.add(name)
            kept.append(step)
        elif timed:
            again = next(f"{name}_again{k}" for k in itertools.count() if f"{name}_again{k}" not in made)
            made.add(again)
            kept.append(replace(step, kernel=step.kernel.renamed({name: again})))  # (the call takes out as given)
    return kept


def in_place_times(programs: Sequence[CompiledProgram], rounds: int = 6) -> list[list[list[float]]]:
    """Each step's seconds where its program runs it: the ``programs`` take turns for ``1 +
    rounds`` whole runs each (on zeros, like ``race_in_place``; the first run, its buffers and
    code still cold, left out), every call timed where it runs (``_watched``: compiled kernels
    by the native loop's clock, so a kernel's time holds no crossing from Python that a run
    without a clock does not make). Returns, per program and step,
    its samples (none for a weight-only step: it never runs). The programs share one set of
    buffers, as alternatives of one program would."""
    buffers: dict[int, np.ndarray] = {}
    samples = [[[] for _ in p.steps] for p in programs]
    watched = [_watched(program, per_step, buffers) for program, per_step in zip(programs, samples)]
    for _ in range(1 + rounds):
        for trial in watched:
            trial()
    return [[s[1:] for s in per_step] for per_step in samples]


def outside_kernels(program: CompiledProgram, rounds: int = 64, confidence: float = 0.95) -> tuple[float, float, float]:
    """A whole run's time over the sum of its kernels' times, as ``(low, median, high)``: the
    median over ``rounds`` rounds and the interval that holds the true one at ``confidence``
    (``median_interval``). Each round runs the program as it is used (on zeros in its dtype,
    in its own buffers) and then once more with every call timed (``_watched``); its ratio is
    the first run's time over the second's calls summed. What a run spends outside its kernels
    (Python between library calls and around native runs) is the ratio less 1. Taken a
    moment apart, a median of whole runs and a sum of in-place medians each move with the
    machine's slow spells (seconds long): InfoGAN's came out 1.50 in one benchmark run."""
    per_step: list[list[float]] = [[] for _ in program.steps]
    watched = _watched(program, per_step, program.buffers)  # the same memory, as runs in a row find it
    inputs = _zero_inputs(program)
    program.run(inputs)  # cold: buffers, code and the laid-out weights
    watched()
    ratios = []
    for _ in range(rounds):
        start = time.perf_counter()
        program.run(inputs)
        whole = time.perf_counter() - start
        watched()
        ratios.append(whole / sum(s[-1] for s in per_step if s))
    return median_interval(ratios, confidence)


def _watched(program: CompiledProgram, per_step: Sequence[list[float] | None], buffers: dict) -> Callable[[], None]:
    """A whole run of ``program`` on zeros, in ``buffers``, with every call timed where it runs
    (``per_step[i]`` receives step i's seconds; None: step i untimed; a weight-only step never
    runs): its compiled kernels by the native loop's clock, as one run without a clock calls
    them (``_Dispatch``'s ``sinks``)."""
    trial = CompiledProgram(program.steps, program.inputs, program.dtype, constants=program.constants, buffers=buffers)
    trial.prepared = program.prepared
    dispatch = trial._dispatch((trial.output,), per_step)
    return functools.partial(dispatch.run, _zero_inputs(program))


def _zero_inputs(program: CompiledProgram) -> dict[str, np.ndarray]:
    """Zeros for each input ``program`` takes per run, in its dtype and aligned, so a timed run
    converts none of them (0 is also a valid index for any gather)."""
    given = (n for n in program.inputs if n not in program.constants)
    return {n: _aligned(np.zeros(program.inputs[n]), program.dtype) for n in given}


# rounds a race of whole runs runs before it looks at its intervals or its clock
# (``race_in_turns``'s ``min_rounds``): the 95% interval of a median of n ratios runs from
# about the 23rd to the 77th percentile of the ratios at n = 12, the 30th to the 70th at 32,
# and at 8 (the 11th to the 89th) a noisy minute can decide a race. ViT-Base's programs (210 ms
# a run, a Zen 3, 85th stop) ran about 12 rounds in the settling's 5 s, with intervals 4-13%
# wide (GPT-2's, 37 ms a run, about 1%); InfoGAN's benchmark (86th stop) put one program 1.277x
# (1.015-2.394) a copy of itself at its first look, 8 rounds in. A 37 ms program is past 32
# rounds in 2.4 s.
WHOLE_RACE_ROUNDS = 32


def race_whole(programs: Mapping[str, CompiledProgram], baseline: str, **limits) -> Race:
    """Whole runs of ``programs`` (on zeros, like ``race_in_place``) in turns, each against
    ``baseline``'s in the same round (``race_in_turns``, ``limits`` its own, at least
    ``WHOLE_RACE_ROUNDS`` rounds unless they say otherwise): whether each is
    faster or slower than the baseline, or neither by more than the resolution. The race that
    took each one's median of at most 30 rounds could not tell such programs apart: one saved
    BERT program, loaded three times and raced against itself six times, came out 0.973-1.040
    of itself, where the BLP's plan and the greedy one differ by about 1%.

    The programs run in one set of buffers (``in_one_pool``), as ``in_place_times`` runs
    them: where each had buffers of its own, copies of one GPT-2 program (32 tokens, a Zen 4)
    ran 0.991-1.005x the program, beyond the race's interval in 7 of 8 races; copies in its
    buffers 0.996-1.002x, beyond it in 1 of 8."""
    pooled = in_one_pool(programs)
    runs = {name: functools.partial(program.run, _zero_inputs(program)) for name, program in pooled.items()}
    return race_in_turns(runs, baseline, **({"min_rounds": WHOLE_RACE_ROUNDS} | limits))


def in_one_pool(programs: Mapping[str, CompiledProgram]) -> dict[str, CompiledProgram]:
    """Copies of ``programs`` whose intermediates live in one set of buffers, each slot as
    large as the largest program's (programs that never run at once can share memory), and
    whose weights, bound and laid out, are one array each where the programs hold the same
    one under one name (the first program's), so none is faster or slower for where its
    memory happens to lie.

    The weights too: a saved GPT-2 program (32 tokens, a Zen 3; 340 MB of packed panels) raced
    against a copy of itself in one pool of buffers came out 1.002-1.018x where the copy had
    laid its weights out anew, beyond the race's interval in 7 of 8 races (the copy slower in
    every one), and 0.992-1.001x where it read the program's own, beyond it in 1 of 8. Two
    plans of one model lay their weights out apart (each program's ``prepare``)."""
    pools: dict[str, dict[int, np.ndarray]] = {}
    weights: dict[str, np.ndarray] = {}
    copies = {}
    for name, program in programs.items():
        pool = pools.setdefault(program.dtype, {})
        plan = plan_buffers(program.steps, {program.output} | set(program.constants))
        for slot, size in enumerate(plan.sizes):
            if slot not in pool or pool[slot].size < size:
                pool[slot] = aligned_empty((size,), program.dtype)
        constants = {n: _one_array(weights, n, v) for n, v in program.constants.items()}
        prepared = {n: _one_array(weights, n, v) for n, v in program.prepared.items()}
        copies[name] = replace(program, buffers=pool, constants=constants, prepared=prepared)
    return copies


def _one_array(arrays: dict[str, np.ndarray], name: str, array: np.ndarray) -> np.ndarray:
    """``arrays[name]`` where it holds what ``array`` does, else ``array`` (the first one under
    ``name`` is kept in ``arrays``)."""
    first = arrays.setdefault(name, array)
    if first is array or (first.shape == array.shape and first.dtype == array.dtype and np.array_equal(first, array)):
        return first
    return array


def runs_on(steps: Sequence[Step], available: set[str]) -> bool:
    """Whether ``steps``, in order, read only ``available`` tensors and each other's outputs."""
    made = set(available)
    for step in steps:
        if not set(tensor_shapes(step.kernel.expr)) <= made:
            return False
        made.add(step.kernel.output)
    return True


def _variants(steps: list[Step], dtype: str) -> list[list[Step]]:
    """``steps``, then ``steps`` with one of them taking each of its other implementations (a
    product and its epilogue apart: the product by BLAS, packed, TVM)."""
    found = [steps]
    for index, step in enumerate(steps):
        if not step.kernel.weight_only:
            found += [[*steps[:index], o, *steps[index + 1 :]] for o in _options(step, dtype) if o.impl != step.impl]
    return found


def _median(samples: list[float]) -> float:
    """The median of a step's in-place times, the first (its buffers and code still cold) left out."""
    return float(np.median(samples[1:] or samples))


def _options(step: Step, dtype: str) -> list[Step]:
    """The implementations of ``step``'s kernel that apply (TVM: with the default schedule)."""
    found = []
    for impl in implementations(step.kernel):
        try:
            found.append(_step(step.kernel, impl, dtype))
        except (CodegenError, ExpressionError):
            continue
    return found


def _timing_call(step: Step, dtype: str, rng) -> Callable[[], None]:
    """``step`` on random inputs of its shapes, as a callable to time (an opaque operation on
    zeros: random values are no valid gather indices, 0 is); weights laid out beforehand where
    its implementation does that once (``prepare``).

    Weights are timed cold, as a model runs them: each run of a model streams every weight from
    memory once, while a kernel called again and again on one weight finds it in the last-level
    cache. So the calls take turns over copies of the weights that together span twice that
    cache (``_cold_copies``). Measured here: BERT-base's 32x3072 @ 3072x768 product takes 1.00
    ms on a cached weight and 1.26 ms in the model, and the ranking of its implementations
    differs between the two."""
    sample = (lambda s: np.zeros(s)) if step.kernel.kind == "opaque" else (lambda s: rng.uniform(-1, 1, s))
    values = {n: _aligned(sample(s), dtype) for n, s in tensor_shapes(step.kernel.expr).items()}
    weights = [n for n in values if n in step.kernel.weights]
    turns = [values] + [
        {**values, **{n: _fresh_copy(values[n]) for n in weights}}
        for _ in range(_cold_copies(sum(values[n].nbytes for n in weights)) - 1)
    ]
    if hasattr(step.call, "prepare"):
        for each in turns:
            each.update(step.call.prepare(each))
    out = aligned_empty(step.kernel.expr.shape, dtype)
    if len(turns) == 1:
        return lambda: step.call(values, out)
    cycle = itertools.cycle(turns)
    return lambda: step.call(next(cycle), out)


def _fresh_copy(array: np.ndarray) -> np.ndarray:
    copy = aligned_empty(array.shape, array.dtype)
    copy[...] = array
    return copy


def _cold_copies(nbytes: int) -> int:
    """Copies of ``nbytes`` of weights that together span twice the last-level cache (at most 64)."""
    return min(64, -(-2 * last_level_cache() // nbytes)) if nbytes else 1


def _aligned(value, dtype: str) -> np.ndarray:
    """A C-contiguous, 64-byte aligned, writable array (TVM refuses read-only buffers)."""
    array = np.asarray(value)
    return aligned_copy(array if array.flags.writeable else array.copy(), dtype)


# --------------------------------------------------------------------------------------------
# Kernels to steps


def _step(
    kernel: Kernel, impl: str, dtype: str, library: Path | None = None, schedule: Schedule | None = None, views=None
) -> Step:
    """``kernel`` by the implementation named ``impl``; an ExpressionError where that does not
    apply to it (a saved program's kernel no operator matches any more, an unknown name)."""
    if impl in LIBRARY_CALLS:
        call = LIBRARY_CALLS[impl](kernel, dtype)
        if call is None:
            raise ExpressionError(f"implementation {impl!r} does not apply to {kernel}")
        return Step(kernel, impl, call)
    if impl != "tvm":
        raise ExpressionError(f"unknown implementation {impl!r}; known: {', '.join([*LIBRARY_CALLS, 'tvm'])}")
    if library is not None:
        compiled = load_kernel(kernel.expr, library, dtype, schedule or Schedule(), views)
    else:
        compiled = compile_scope(kernel.expr, dtype=dtype, schedule=schedule)
    return Step(kernel, impl, _tvm_call(compiled), compiled)


def _tvm_call(compiled: TvmKernel):
    """The kernel's function on a step's buffers by name. Every buffer a step reads or writes is
    aligned where it is made (``aligned_empty``, ``_aligned``), so no call checks it again:
    ``TvmKernel.run``'s check costs a microsecond an argument, more than a small kernel runs."""
    function, names, views = compiled.function, tuple(compiled.inputs), compiled.views

    def call(values, out):
        function(*viewed([*(values[n] for n in names), out], views))

    call.native = ((function, (*names, OUTPUT), views),)  # what ``_Dispatch`` runs natively
    return call


def compile_candidate(
    candidate: Candidate,
    inputs: Mapping[str, tuple[int, ...]],
    dtype: str = "float32",
    db: MeasurementDB | None = None,
    tune: int = 0,
) -> CompiledProgram:
    """``candidate`` compiled; where a kernel has several implementations, the fastest measured.

    A matched operator races the implementations its record lists for this backend (a
    convolution: im2col + BLAS and TVM; a band matmul: blocked BLAS and TVM); with ``tune`` > 0
    every TVM kernel also races up to ``tune`` schedules
    (``candidate_schedules``: tile, vector width, parallel loops, unrolling), each measured
    once per device in ``db``. A candidate that post-processing fused (``candidate.unfused``)
    starts from its unfused kernels, and each eOperator fusion is kept only where the fused
    kernel measures faster (``_fused``).
    """
    kernels = candidate.unfused or candidate.kernels
    steps = []
    for _, options in compiled_in_batches(kernels, lambda kernel: _implemented(kernel, dtype, tune)):
        if isinstance(options, CodegenError):
            raise options
        steps.append(_fastest_of(options, dtype, db))
    if candidate.unfused:
        steps = _fused(steps, dtype, db, tune)
    return CompiledProgram(steps, dict(inputs), dtype, source=candidate.source)


def implementations(kernel: Kernel) -> tuple[str, ...]:
    """The implementation names this backend races for ``kernel``: its operator record's (an
    eOperator, or an operator that lists none for this backend: TVM; an opaque operation: its
    numpy function)."""
    if kernel.kind == "opaque":
        return ("opaque",)
    listed = kernel.operator.implementations.get(BACKEND) if kernel.operator is not None else None
    return tuple(listed) if listed else EOP_IMPLEMENTATIONS


def _implemented(kernel: Kernel, dtype: str, tune: int) -> list[Step]:
    """The kernel's implementations that apply, compiled (with ``tune``, up to ``tune`` TVM
    schedules); a CodegenError where none does."""
    options, refused = [], []
    for impl in implementations(kernel):
        if impl != "tvm":
            try:
                call = LIBRARY_CALLS[impl](kernel, dtype)
            except CodegenError as err:  # a library call TVM compiles for (packed) was refused
                refused.append(err)
                continue
            options += [Step(kernel, impl, call)] if call is not None else []
            continue
        for schedule in candidate_schedules(kernel.expr, tune) if tune > 0 else [None]:
            try:
                options.append(_step(kernel, "tvm", dtype, schedule=schedule))
            except CodegenError as err:
                refused.append(err)  # TVM refused this one: the others remain
    if not options:
        raise (
            refused[0]
            if refused
            else CodegenError(f"no implementation of {implementations(kernel)} applies to {kernel}")
        )
    return options


def _fastest_of(options: list[Step], dtype: str, db: MeasurementDB | None) -> Step:
    """The fastest of one kernel's compiled implementations (one alone is not measured)."""
    if len(options) > 1 and not options[0].kernel.weight_only:
        CompiledProgram(options, {}, dtype).measure(db)
        options = sorted(options, key=lambda s: s.seconds)
    return options[0]


def compiled_in_batches(items: Sequence[T], build: Callable[[T], R]) -> Iterator[tuple[T, R | CodegenError]]:
    """``(item, build(item))`` for each item in order (the CodegenError in place of a result
    where building raised one), built ``COMPILE_THREADS`` at a time on threads, for a caller
    that compiles kernels and then times them. TVM's and LLVM's compilers release the GIL, and
    a small kernel's compilation is mostly their fixed cost (0.2-0.5 s), so two cores build two
    at once. A batch is handed out only once all of it is built: whatever the caller times
    runs with nothing compiling beside it. A caller that stops early leaves the next batches
    unbuilt."""
    for start in range(0, len(items), COMPILE_THREADS):
        batch = items[start : start + COMPILE_THREADS]
        if len(batch) == 1:
            built = [_built(build, batch[0])]
        else:
            with ThreadPoolExecutor(len(batch)) as pool:
                built = list(pool.map(lambda item: _built(build, item), batch))
        yield from zip(batch, built)


def _built(build: Callable[[T], R], item: T) -> R | CodegenError:
    try:
        return build(item)
    except CodegenError as err:
        return err


def _fused(
    steps: list[Step],
    dtype: str,
    db: MeasurementDB | None,
    tune: int,
    producers: Callable[[str], bool] = lambda output: True,
    check: bool = False,
    log: list[Fusion] | None = None,
) -> list[Step]:
    """eOperator fusion by measurement (OLLIE 5.4 post-processing): an eOperator read only by
    one later eOperator is fused into it when the fused kernel takes less time than the two
    apart. A weight-only producer runs once at build time and counts as free; two weight-only
    kernels fuse without measuring (one temporary fewer). Only producers whose output
    ``producers`` accepts are fused; with ``check``, a fused kernel whose results differ from
    the two apart (on random inputs) is refused; ``log`` receives each fusion made."""
    steps, refused = list(steps), set()
    while True:
        outputs = [s.kernel.output for s in steps]
        pairs = [
            (producer, consumer)
            for producer, consumer in fusion_pairs([s.kernel for s in steps])
            if (outputs[producer], outputs[consumer]) not in refused and producers(outputs[producer])
        ]
        build = lambda pair: _implemented(fuse(steps[pair[0]].kernel, steps[pair[1]].kernel), dtype, tune)  # noqa: E731
        for (producer, consumer), options in compiled_in_batches(pairs, build):
            if isinstance(options, CodegenError):
                raise options
            apart = [steps[producer], steps[consumer]]
            pair = (outputs[producer], outputs[consumer])
            kernel = options[0].kernel
            fused = _fastest_of(options, dtype, db)
            timed = [s for s in apart if not s.kernel.weight_only]
            if not kernel.weight_only:
                CompiledProgram([fused, *timed], {}, dtype).measure(db)
                if fused.seconds >= sum(s.seconds for s in timed):
                    refused.add(pair)
                    continue
            if check and not _same_results(fused, apart, dtype):
                refused.add(pair)
                continue
            if log is not None:
                log.append(Fusion(*pair, sum(s.seconds or 0.0 for s in timed), fused.seconds or 0.0))
            steps[consumer] = fused
            del steps[producer]
            break
        else:
            return steps


@dataclass(frozen=True)
class Fusion:
    """One eOperator fusion made by post-processing: ``producer`` computed inside ``consumer``."""

    producer: str
    consumer: str
    seconds_apart: float
    seconds_fused: float


def _same_results(fused: Step, apart: list[Step], dtype: str, seed: int = 0) -> bool:
    """The fused kernel computes what the two kernels apart compute, on random inputs."""
    rng = np.random.default_rng(seed)
    values = {n: _aligned(rng.uniform(-1, 1, s), dtype) for n, s in tensor_shapes(fused.kernel.expr).items()}
    want = dict(values)
    for step in apart:
        want[step.kernel.output] = aligned_empty(step.kernel.expr.shape, dtype)
        step.call(want, want[step.kernel.output])
    got = aligned_empty(fused.kernel.expr.shape, dtype)
    fused.call(values, got)
    return results_agree(got, want[apart[-1].kernel.output])


def results_agree(got: np.ndarray, want: np.ndarray) -> bool:
    """Two computations of one value agree: within 1e-3, relative to the larger of 1 and the
    largest finite magnitude wanted; NaN where NaN is wanted."""
    scale = max(1.0, float(np.abs(want, where=np.isfinite(want), out=np.zeros_like(want)).max(initial=0.0)))
    return bool(np.allclose(got, want, rtol=1e-3, atol=1e-3 * scale, equal_nan=True))


def stitch(
    parts: Sequence[tuple[CompiledProgram, Mapping[str, str]]], inputs: Mapping[str, tuple[int, ...]]
) -> CompiledProgram:
    """One program that runs ``parts`` one after another (OLLIE Algorithm 1: the best program
    of every subprogram, stitched), each part's tensors renamed by its mapping: its inputs and
    output to the model's tensors, its temporaries to names of their own. Bound constants come
    along renamed; nothing is compiled or measured again."""
    steps: list[Step] = []
    constants: dict[str, np.ndarray] = {}
    dtypes = {program.dtype for program, _ in parts}
    if len(dtypes) > 1:
        raise ValueError(f"stitch: the parts have different dtypes {sorted(dtypes)}")
    for program, names in parts:
        steps += [step.renamed(names, program.dtype) for step in program.steps]
        constants.update({names.get(n, n): value for n, value in program.constants.items()})
    return CompiledProgram(steps, dict(inputs), dtypes.pop(), constants=constants).prepare()
