"""Whole programs and models (OLLIE Algorithm 1, section 5.1): derive each subprogram, stitch,
post-process, orchestrate.

A front-end (``load_onnx``, ``from_torch``) gives a ``Program``: one definition per operator,
non-linear activations their own definitions. Parallel definitions that differ in one input
merge into a batched one where it measures faster; element-wise definitions and unfolding views
fuse into their neighbours; each remaining definition is a subprogram. Each one is
derived with the cpu backend (compiled, verified, measured) with the model's constants named as
weights, so layout eOperators on weights run once at build time (5.4). Subprograms that are equal
up to tensor names (a repeated ResNet block) are derived once: they are renamed to positional
names ``ARG0, ARG1, ...`` and fingerprinted. The best program of every subprogram is stitched
into one compiled program over the model's tensors, whose kernels are then orchestrated (Korch):
candidate kernels of several eOperators are compiled and measured, and a binary linear program
chooses which primitives share a kernel, computing one twice where that saves time
(``backend.orchestrations``; the greedy baseline, OLLIE 5.4's fusion of an eOperator into the one
that alone reads it across subprograms, is ``orchestration="greedy"``). Ctrl-C or the time
budget stops the search; the subprograms not reached yet run as their identity kernel, so a
result is always written. An opaque definition
(a gather by run-time indices, ``rewriter.ir.Opaque``) is not searched: it runs its library
function, and the scopes around it are derived as usual.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from codegen.backend import Backend, as_backend
from codegen.orchestrate import Orchestration, agreeing, race_figures
from codegen.program import load, race_whole
from rewriter.ir import Definition, ExpressionError, Opaque, Program, Scope, parse, rename_tensors, tensor_shapes
from rewriter.lower import Candidate, Kernel, absorbs, instantiate, is_view, mark_weight_only
from rewriter.search import eager_closure, fingerprint, registered
from rewriter.semantics import evaluate

from .derive import derive


@dataclass
class Subprogram:
    """One definition of the program: how it was derived, and what that measured."""

    name: str
    expr: Definition
    kernels: tuple[str, ...]  # the kinds of its derived program's kernels, in order
    arguments: dict[str, str]  # positional name -> the program's tensor name
    # "derived", "reused" (an equal subprogram was derived), "identity" (not searched), "opaque"
    state: str
    original_s: float  # the definition as one TVM kernel, measured
    optimized_s: float
    search_s: float
    explain: str = ""
    kernels_before: int = 1  # the definition instantiated as written

    @property
    def kernels_after(self) -> int:
        return len(self.kernels)


@dataclass
class OptimizedProgram:
    """A program whose subprograms' derived programs are stitched into one compiled ``program``
    and orchestrated (``orchestration``: which primitives share a kernel); callable on the
    model's inputs."""

    inputs: dict[str, tuple[int, ...]]
    outputs: tuple[str, ...]
    subprograms: list[Subprogram]
    program: object  # codegen.program.CompiledProgram over the model's tensor names
    orchestration: Orchestration = field(default_factory=lambda: Orchestration("none"))
    # subprogram output -> its runners-up (programs of other kernel structures the derivation
    # measured), over the model's names: orchestration races them where the program runs them
    alternatives: dict[str, list] = field(default_factory=dict, repr=False, compare=False)

    @property
    def cost(self) -> float:
        """Measured seconds per run: the stitched program's kernels."""
        return self.program.cost

    def __call__(self, **inputs) -> np.ndarray | tuple:
        values = self.program.run(inputs, self.outputs)
        outs = tuple(values[name] for name in self.outputs)
        return outs[0] if len(outs) == 1 else outs

    def stats(self) -> list[dict]:
        """One row per subprogram, then one per kernel that computes several primitives
        (``stats.jsonl``)."""
        rows = [
            {
                "subprogram": s.name,
                "state": s.state,
                "original_s": s.original_s,
                "optimized_s": s.optimized_s,
                "search_s": s.search_s,
                "kernels": list(s.kernels),
            }
            for s in self.subprograms
        ]
        return rows + [
            {"kernel": k.output, "primitives": list(k.primitives), "apart_s": k.apart_seconds, "fused_s": k.seconds}
            for k in self.orchestration.shared
        ]

    def save(
        self, directory: str | Path, extra: Mapping[str, str] | None = None, measurements: str | Path | None = None
    ) -> Path:
        """The stitched program (kernels, libraries, bound weights), ``model.json``, ``stats.jsonl``,
        the ``extra`` text files and a snapshot of the ``measurements`` database; written to a
        temporary folder first and renamed, so an interrupted save leaves no half-written
        ``directory``."""
        directory = Path(directory)
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        self.program.save(partial / "program")
        entries = [
            {
                "name": s.name,
                "expr": str(s.expr),
                "shapes": tensor_shapes(s.expr),
                "kernels": list(s.kernels),
                "arguments": s.arguments,
                "state": s.state,
                "original_s": s.original_s,
                "optimized_s": s.optimized_s,
                "search_s": s.search_s,
                "explain": s.explain,
                "kernels_before": s.kernels_before,
            }
            for s in self.subprograms
        ]
        meta = {
            "inputs": self.inputs,
            "outputs": self.outputs,
            "subprograms": entries,
            "orchestration": self.orchestration.to_json(),
        }
        (partial / "model.json").write_text(json.dumps(meta, indent=1))
        (partial / "stats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in self.stats()))
        for name, text in (extra or {}).items():
            (partial / name).write_text(text)
        if measurements is not None:
            _snapshot(measurements, partial / "measurements.sqlite")
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
        return directory


def _snapshot(database: str | Path, target: Path) -> None:
    """A copy of an sqlite database that may be in use (sqlite's online backup)."""
    with sqlite3.connect(database) as source, sqlite3.connect(target) as copy:
        source.backup(copy)


def load_optimized(directory: str | Path) -> OptimizedProgram:
    """An optimized program saved by ``OptimizedProgram.save``: runs without searching."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "model.json").read_text())
    except (OSError, ValueError) as err:
        raise ExpressionError(f"{directory}: not an optimized model ({err})") from None
    subprograms = []
    for e in meta["subprograms"]:
        expr = parse(e["expr"], {n: tuple(s) for n, s in e["shapes"].items()})
        subprograms.append(
            Subprogram(
                e["name"],
                expr,
                tuple(e["kernels"]),
                e["arguments"],
                e["state"],
                e["original_s"],
                e["optimized_s"],
                e["search_s"],
                e["explain"],
                e["kernels_before"],
            )
        )
    inputs = {n: tuple(s) for n, s in meta["inputs"].items()}
    orchestration = Orchestration.from_json(meta["orchestration"]) if "orchestration" in meta else Orchestration("none")
    return OptimizedProgram(inputs, tuple(meta["outputs"]), subprograms, load(directory / "program"), orchestration)


def fold_weights(program: Program, weights: Mapping[str, np.ndarray]) -> tuple[Program, dict[str, np.ndarray]]:
    """Compile-time evaluation (OLLIE 5.4) across the program: a definition that reads only
    weights (an exporter's Identity of an initializer, a weight transposed or scaled), and is
    no output, is evaluated once by the reference semantics and becomes a weight itself. The
    definitions that read it then read a weight: bound and laid out once, where as a tensor of
    its own subprogram it would be computed again on every run. Returns the program without
    those definitions, and the weights with their values."""
    folded, kept = dict(weights), []
    for name, expr in program.definitions:
        reads = tensor_shapes(expr)
        if isinstance(expr, Scope) and name not in program.outputs and set(reads) <= set(folded):
            values = {n: folded[n] for n in reads}
            # float: a program's values are (integer data included: a Cast to float before a
            # division and a log is no cast here), so integer weights fold to float64, exactly
            dtype = np.result_type(*values.values(), np.float32)
            folded[name] = evaluate(expr, values).astype(dtype)
        else:
            kept.append((name, expr))
    return Program(tuple(kept), program.outputs), folded


def merge_parallel(program: Program, costs: Callable[[Sequence[Scope]], Sequence[float]]) -> Program:
    """Merge parallel definitions with the inter-expression rules (OLLIE 4.1, Figure 5): a
    variant that computes n definitions by one new batched definition and reads them back as
    views (attention's Q, K and V projections, which share their input) is taken where the
    batched definition's cost is below the n definitions' together. ``costs`` gives the
    seconds of each of a list of definitions, measured together (the batched one and its
    members in turns: measured apart, each in its own moment, a slow spell of the machine
    decided). A stacked weight costs nothing: it is computed at build time.

    Groups equal up to tensor names (every layer's Q, K and V) are decided once and alike: each
    layer weighed apart on this noisy machine merged BERT's three projections in some layers,
    two of them in others and none in the rest, and measured the same kernels twelve times.

    Definitions merge only with definitions of the same traversal, summation and input shapes
    that read the same definitions (what a batched definition's members share), so the rules
    see each such group alone, as ``fuse_elementwise``'s see each pair: applied to the whole
    program, they made a whole-program variant per candidate, and a 30-layer decoder (1807
    definitions) spent more than 14 minutes here. A merge is kept where what the batched
    definition reads beyond its first member's reads is an input of the program (a weight): the
    stack must exist where the batch is computed."""
    tried: set = set()
    decided: dict = {}  # the forms of a batched definition and its members -> merge or not
    changed = True
    while changed:
        changed = False
        for group in _parallel_groups(program):
            merged = _merged(program, group, costs, tried, decided)
            if merged is not None:
                program, changed = merged, True
    return program


def _parallel_groups(program: Program) -> list[list[str]]:
    """Names of the scopes that could merge, grouped by traversal, summation, input shapes and
    the definitions they read: a merge's members differ only in inputs of the program, so they
    read the same definitions (a decoder's gate and up projections of one layer, not of two)."""
    defined = {name for name, _ in program.definitions}
    groups: dict[tuple, list[str]] = {}
    for name, expr in program.definitions:
        if isinstance(expr, Scope):
            reads = tensor_shapes(expr)
            shapes = tuple(sorted(reads.values()))
            key = (expr.traversal, expr.summation, expr.reduce, shapes, frozenset(reads.keys() & defined))
            groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _merged(
    program: Program, group: list[str], costs: Callable[[Sequence[Scope]], Sequence[float]], tried: set, decided: dict
) -> Program | None:
    """``program`` with one merge of ``group``'s definitions that the rules propose and
    ``costs`` prefers (each form of merge weighed once, ``decided``), or None."""
    defined = dict(program.definitions)
    before = {name: defined[name] for name in group}
    alone = Program(tuple(before.items()), tuple(group))
    for rule_ in registered("inter"):
        for variant in rule_.apply(alone):
            after = dict(variant.definitions)
            added = set(after) - set(before)
            replaced = frozenset(n for n, e in before.items() if after.get(n) != e)
            if len(added) != 1 or len(after) != len(before) + 1 or replaced in tried:
                continue
            (batched,) = added
            if not replaced or not all(is_view(after[n]) and _reads(after[n]) == {batched} for n in replaced):
                continue
            tried.add(replaced)
            first = next(name for name, _ in program.definitions if name in replaced)
            stacked = _reads(after[batched]) - _reads(defined[first])
            if batched in defined or not stacked <= set(program.inputs):
                continue
            members = [before[n] for n in group if n in replaced]
            form = tuple(_form(e) for e in [after[batched], *members])
            if form not in decided:
                seconds = costs([after[batched], *members])
                decided[form] = seconds[0] < sum(seconds[1:])
            if decided[form]:
                return _spliced(program, first, variant, replaced | {batched})
    return None


def _spliced(program: Program, first: str, variant: Program, names: set[str]) -> Program:
    """``program`` with the definitions ``names`` of ``variant`` (a batched definition and its
    views) in place of the ones they replace, all at the position of ``first``."""
    merged = tuple((name, expr) for name, expr in variant.definitions if name in names)
    definitions: list = []
    for name, expr in program.definitions:
        if name == first:
            definitions.extend(merged)
        elif name not in names:
            definitions.append((name, expr))
    return Program(tuple(definitions), program.outputs)


def _reads(expr: Scope) -> set[str]:
    return set(tensor_shapes(expr))


def fuse_elementwise(program: Program) -> Program:
    """Fold producers into their readers with the inter-expression rules (OLLIE 4.1, 5.4) where
    the fusion policy admits it (``rewriter.lower.absorbs``: an element-wise producer into a
    reader that sums nothing, an unfolding view or a reshape of unit dimensions into any
    reader). The eager rules simplify every definition first and after each fusion, so that a
    view is seen as one (a Slice + Concat unfold merges into one read).

    The rules see each candidate pair alone: a producer read by one definition only (and not an
    output) and its reader, as a two-definition program; a variant of it that leaves the reader
    alone is the fusion. So a pass costs one rule application per pair, not one whole-program
    variant per pair (a 12-layer transformer has hundreds of definitions); passes repeat until
    nothing fuses (a fusion can leave a producer with one reader)."""
    eager = registered("eager")
    definitions = {name: _closed(e, eager) if isinstance(e, Scope) else e for name, e in program.definitions}
    readers: dict[str, list[str]] = {}
    for name, expr in definitions.items():
        for tensor in tensor_shapes(expr):
            readers.setdefault(tensor, []).append(name)
    changed = True
    while changed:
        changed = False
        for producer in list(definitions):
            consumers = readers.get(producer, [])
            if producer in program.outputs or len(consumers) != 1:
                continue
            (reader,) = consumers
            fused = _fused_pair(producer, definitions[producer], reader, definitions[reader], eager)
            if fused is None:
                continue
            for tensor in tensor_shapes(definitions.pop(producer)):
                readers[tensor] = [n for n in readers[tensor] if n != producer]
                readers[tensor] += [] if reader in readers[tensor] else [reader]
            del readers[producer]
            definitions[reader] = fused
            changed = True
    return Program(tuple(definitions.items()), program.outputs)


def _fused_pair(producer: str, made: Definition, reader: str, reads: Definition, eager) -> Scope | None:
    """``reads`` with ``made`` folded in by an inter-expression rule, closed under the eager
    rules, where the fusion policy admits it; None otherwise."""
    if not (isinstance(made, Scope) and isinstance(reads, Scope)) or not absorbs(reads, made):
        return None
    pair = Program(((producer, made), (reader, reads)), (reader,))
    for rule_ in registered("inter"):
        for variant in rule_.apply(pair):
            if [name for name, _ in variant.definitions] == [reader]:
                return _closed(variant.definitions[0][1], eager)
    return None


def _closed(expr: Scope, eager) -> Scope:
    return eager_closure(expr, eager)[0]


ORCHESTRATIONS = ("blp", "greedy")  # the methods of ``orchestrations``; "none" keeps the stitched kernels


def optimize_program(
    program: Program,
    weights: Mapping[str, np.ndarray],
    *,
    max_depth: int = 3,
    time_limit: float | None = None,
    subprogram_time_limit: float | None = 60.0,
    backend: str | Backend = "cpu",
    orchestration: str = "blp",
    layout: str = "auto",
    on_subprogram: Callable[[Subprogram, int, int], None] | None = None,
) -> OptimizedProgram:
    """OLLIE Algorithm 1. Evaluate the definitions that read only weights (``fold_weights``),
    merge parallel definitions where that measures faster
    (``merge_parallel``), fuse element-wise definitions and unfolding views into their
    neighbours (``fuse_elementwise``), store its NCHW tensors with their channels in blocks of
    the CPU's vector (``blocked_layouts``; ``layout`` "auto" optimizes the program both so and
    as written and keeps the blocked one where its whole runs measure faster, "blocked" or "as written"
    only one), derive every definition of ``program`` (``weights``: the
    constant inputs, bound into the compiled programs), deduplicated, stitch the best programs
    into one, and orchestrate its kernels (``backend.orchestrations``: ``orchestration`` "blp",
    Korch's binary linear program over measured candidate kernels, or "greedy", eOperators
    fused across subprogram boundaries pair by pair where that measures faster; "none" keeps
    the stitched kernels). ``time_limit`` bounds the whole search,
    ``subprogram_time_limit`` each subprogram's; ``backend`` compiles and measures (a
    ``codegen.backend`` object or its name: ``CpuBackend(tune=N)`` races N TVM schedules per
    generated kernel); ``on_subprogram(sub, k, n)`` reports progress."""
    if not isinstance(program, Program):
        raise ExpressionError(f"optimize_program() takes a Program, got {type(program).__name__}")
    backend = as_backend(backend)
    if orchestration not in (*ORCHESTRATIONS, "none"):
        raise ExpressionError(f"unknown orchestration {orchestration!r}; known: {', '.join(ORCHESTRATIONS)}, none")
    if layout not in ("auto", "blocked", "as written"):
        raise ExpressionError(f"unknown layout {layout!r}; known: auto, blocked, as written")
    if not (hasattr(backend, "stitch") and hasattr(backend, "orchestrations")):
        raise ExpressionError(
            f"optimize_program() stitches compiled programs: backend {backend.name!r} compiles none (use 'cpu')"
        )
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    interrupted = False
    program, weights = fold_weights(program, weights)
    try:
        found: dict = {}
        program = merge_parallel(program, lambda exprs: _measured_costs(exprs, weights, backend, found))
    except KeyboardInterrupt:  # Ctrl-C: nothing merged; every subprogram runs as written
        interrupted = True
    program = fuse_elementwise(program)
    variants = {"as written": program}
    if layout != "as written":
        blocked = blocked_layouts(program, getattr(backend, "lanes", 0))
        if blocked != program:
            variants = {"blocked": blocked} | ({} if layout == "blocked" else variants)
    results = {}
    for name, variant in variants.items():
        if results and (interrupted or (deadline is not None and time.perf_counter() >= deadline)):
            break
        results[name], interrupted = _optimized(
            variant,
            weights,
            backend,
            deadline,
            interrupted,
            max_depth,
            subprogram_time_limit,
            orchestration,
            on_subprogram,
        )
    if interrupted:  # Ctrl-C: the first layout, derived whole, without a race
        return next(iter(results.values()))
    return _faster_layout(results)


def blocked_layouts(program: Program, lanes: int) -> Program:
    """``program`` with its tensors stored in the layouts the registered layout rules propose
    (NCHW tensors with their channels in blocks: ``rules/channel_blocking.py``), in blocks of
    ``lanes`` (the CPU's float32 vector lanes), then of half that for the tensors whose
    channels ``lanes`` does not divide (MobileNetV2's 24); as it is where ``lanes`` is 0."""
    if not lanes:
        return program
    for rule_ in registered("layout"):
        while True:
            variant = next((v for v in rule_.apply(program) if lanes <= 2 * _block(v, program) <= 2 * lanes), None)
            if variant is None:
                break
            program = variant
    return program


def _block(variant: Program, program: Program) -> int:
    """The block a layout variant stores its new tensors in: their innermost dimension."""
    taken = {name for name, _ in program.definitions}
    return max(expr.shape[-1] for name, expr in variant.definitions if name not in taken)


def _faster_layout(results: dict[str, OptimizedProgram]) -> OptimizedProgram:
    """Of the program optimized in several layouts, the one whose whole runs measure faster
    than the one as written's (``race_whole``, in turns), else the one as written; its
    orchestration figures say which and the race's times (``layouts_ms``, ``layouts_vs``).
    Each other layout's program is first run against the one as written on the same inputs
    (``agreeing``), and left out with a warning where an output differs."""
    if len(results) > 1 and "as written" in results:
        written = results["as written"]
        plans = {name: (r.program, r.orchestration) for name, r in results.items() if name != "as written"}
        kept = agreeing(plans, written.program, set(written.outputs), unlike="the program as written")
        results = {name: r for name, r in results.items() if name == "as written" or name in kept}
    if len(results) == 1:
        return next(iter(results.values()))
    raced = race_whole({name: optimized.program for name, optimized in results.items()}, "as written")
    optimized = results[raced.fastest]
    figures = optimized.orchestration.figures | race_figures(raced, "layouts") | {"layout": raced.fastest}
    return replace(optimized, orchestration=replace(optimized.orchestration, figures=figures))


def _optimized(
    program: Program,
    weights,
    backend: Backend,
    deadline: float | None,
    interrupted: bool,
    max_depth: int,
    subprogram_time_limit: float | None,
    orchestration: str,
    on_subprogram,
) -> tuple[OptimizedProgram, bool]:
    """Every definition of ``program`` derived (deduplicated), stitched and orchestrated; and
    whether Ctrl-C stopped the search."""
    derived: dict[tuple, tuple] = {}
    subprograms, parts, runners_up = [], [], {}
    taken = set(program.inputs) | {name for name, _ in program.definitions}
    for index, (name, expr) in enumerate(program.definitions):
        remaining = None if deadline is None else deadline - time.perf_counter()
        budget = min((t for t in (remaining, subprogram_time_limit) if t is not None), default=None)
        searched = not interrupted and (budget is None or budget > 0)
        try:
            sub, compiled, others = _subprogram(
                name, expr, weights, derived, backend, max_depth if searched else None, budget
            )
        except KeyboardInterrupt:  # this one and the rest run as written
            interrupted = True
            sub, compiled, others = _subprogram(name, expr, weights, derived, backend, None, None)
        subprograms.append(sub)
        parts.append((compiled, _global_names(sub, compiled, taken)))
        runners_up[name] = [(other, _global_names(sub, other, taken)) for other in others]
        if on_subprogram:
            on_subprogram(sub, index, len(program.definitions))
    inputs = {n: s for n, s in program.inputs.items() if n not in weights}
    stitched = OptimizedProgram(inputs, program.outputs, subprograms, backend.stitch(parts, inputs))
    for name, others in runners_up.items():  # each renamed like its subprogram, with its bound constants
        stitched.alternatives[name] = [backend.stitch([other], inputs) for other in others]
    remaining = None if deadline is None else deadline - time.perf_counter()
    if orchestration == "none" or interrupted or (remaining is not None and remaining <= 0):
        return stitched, interrupted
    try:
        return orchestrate_program(stitched, orchestration, backend, remaining), interrupted
    except KeyboardInterrupt:  # Ctrl-C: the stitched program as derived
        return stitched, True


def runners_up_raced(optimized: OptimizedProgram, backend: str | Backend = "cpu") -> OptimizedProgram:
    """``optimized`` with each subprogram raced where the program runs it against its runners-up
    (``alternatives``: the derivation's next cheapest candidates of other kernel structures)
    and a runner-up taken where whole runs are faster with it (``backend.race_runners_up``);
    how many were taken is the figure ``runners_up_in_place``. The step before orchestration
    (``orchestrate_program`` takes it where the alternatives are still there): raced once, the
    BLP and the greedy plan start from the same kernels. Each subprogram is still whole here
    (fused across a boundary, its last kernel would no longer be one a runner-up replaces)."""
    if not optimized.alternatives:
        return optimized
    backend = as_backend(backend)
    ends = {s.name for s in optimized.subprograms} | set(optimized.outputs)
    program, taken = backend.race_runners_up(optimized.program, optimized.alternatives, ends)
    figures = optimized.orchestration.figures | {"runners_up_in_place": taken}
    return replace(
        optimized, program=program, orchestration=replace(optimized.orchestration, figures=figures), alternatives={}
    )


def orchestrate_program(
    optimized: OptimizedProgram, method: str = "blp", backend: str | Backend = "cpu", time_limit: float | None = None
) -> OptimizedProgram:
    """``optimized`` with its kernels orchestrated again (``optimize_program``'s last step):
    "blp", Korch's binary linear program over candidate kernels measured within
    ``time_limit``, or "greedy", eOperators fused across subprogram boundaries pair by pair
    (``orchestrations``)."""
    if method not in ORCHESTRATIONS:
        raise ExpressionError(f"unknown orchestration {method!r}; known: {', '.join(ORCHESTRATIONS)}")
    return orchestrations(optimized, (method,), backend, time_limit)[method]


def orchestrations(
    optimized: OptimizedProgram,
    methods: Sequence[str] = ORCHESTRATIONS,
    backend: str | Backend = "cpu",
    time_limit: float | None = None,
) -> dict[str, OptimizedProgram]:
    """``optimized`` orchestrated by each of ``methods`` from one set of plans
    (``backend.orchestrations``): the greedy plan, and the BLP's settled on it, its candidates
    measured within ``time_limit``; each method keeps its own plan or one it was settled on,
    on the same end-to-end race. So the BLP's program and the greedy one differ in what the
    BLP adds alone. Its subprograms' runners-up are raced first where they still are
    (``runners_up_raced``)."""
    unknown = [m for m in methods if m not in ORCHESTRATIONS]
    if unknown or not methods:
        raise ExpressionError(f"unknown orchestration {unknown or methods!r}; known: {', '.join(ORCHESTRATIONS)}")
    backend = as_backend(backend)
    optimized = runners_up_raced(optimized, backend)
    outputs = set(optimized.outputs)
    boundaries = {s.name for s in optimized.subprograms} - outputs
    limits = {"time_limit": time_limit} if "blp" in methods and time_limit is not None else {}
    kept = backend.orchestrations(optimized.program, outputs, boundaries, methods, **limits)
    # which layout the program was kept in, and how many runners-up it took
    carried = {
        k: v
        for k, v in optimized.orchestration.figures.items()
        if k in ("layout", "runners_up_in_place") or k.startswith("layouts_")
    }
    return {
        method: replace(optimized, program=program, orchestration=replace(plan, figures=plan.figures | carried))
        for method, (program, plan) in kept.items()
    }


def _subprogram(
    name: str, expr: Definition, weights, derived: dict, backend: Backend, max_depth: int | None, budget: float | None
):
    """The subprogram ``name = expr`` derived (``max_depth`` None: as written, one TVM kernel;
    an opaque definition: its library function), or reused from ``derived`` (equal subprograms
    up to tensor names), and its compiled program over positional names with its weights bound."""
    positional, arguments, constant = _positional(expr, weights)
    bound = {a: weights[t] for a, t in arguments.items() if t in weights}
    opaque = isinstance(expr, Opaque)
    key = None if opaque else (_form(positional), constant)
    kernels_before = 1 if opaque else len(instantiate(expr).kernels)
    start = time.perf_counter()
    others = []
    if key in derived:  # searched once already: same kernels, this subprogram's weights
        first, original_s, explain, runners = derived[key]
        compiled = first.rebound(bound)
        others = [p.rebound(bound) for p in runners]
        state, search_s = "reused", 0.0
    elif max_depth is None or opaque:  # one kernel as written: TVM's, or the opaque function
        kernels = mark_weight_only([Kernel("opaque" if opaque else "eop", "out", positional)], constant)
        compiled = backend.compile(Candidate(kernels), tensor_shapes(positional))
        backend.measure(compiled)
        compiled.bind(bound)
        state = "opaque" if opaque else "identity"
        search_s, original_s, explain = 0.0, compiled.cost, "not searched"
    else:
        derivation = derive(positional, max_depth, time_limit=budget, weights=constant, backend=backend)
        best = derivation.best
        as_written = (p for p in derivation.candidates if p.source is None and [k.kind for k in p.kernels] == ["eop"])
        original_s = next(as_written, best).cost  # (the identity is dropped only if its compiled form disagreed)
        explain = derivation.explain(best)
        derived[key] = (best, original_s, explain, _runners_up(derivation.candidates, best))
        compiled = best.rebound(bound)
        others = [p.rebound(bound) for p in derived[key][3]]
        state, search_s = "derived", time.perf_counter() - start
    kinds = tuple(k.kind for k in compiled.kernels)
    sub = Subprogram(name, expr, kinds, arguments, state, original_s, compiled.cost, search_s, explain, kernels_before)
    return sub, compiled, others


def _runners_up(candidates, best, count: int = 2) -> list:
    """The cheapest ``count`` verified candidates whose kernels differ in kind from ``best``'s and
    each other's (a matmul and its epilogue apart, where ``best`` is one fused kernel): timed
    alone they lost, where the program runs them they may not."""
    seen, found = {tuple(k.kind for k in best.kernels)}, []
    for candidate in candidates:
        kinds = tuple(k.kind for k in candidate.kernels)
        if kinds not in seen and len(found) < count:
            seen.add(kinds)
            found.append(candidate)
    return found


def _global_names(sub: Subprogram, compiled, taken: set[str]) -> dict[str, str]:
    """How a subprogram's compiled program names its tensors in the stitched program: its
    arguments and output as the model does, each temporary ``<subprogram>_<temporary>``."""
    names = dict(sub.arguments)
    for kernel in compiled.kernels[:-1]:
        fresh = next(
            f"{sub.name}_{kernel.output}{k or ''}"
            for k in range(len(taken) + 1)
            if f"{sub.name}_{kernel.output}{k or ''}" not in taken
        )
        names[kernel.output] = fresh
        taken.add(fresh)
    names[compiled.output] = sub.name
    return names


def _positional(expr: Definition, weights) -> tuple[Definition, dict[str, str], tuple[str, ...]]:
    """``expr`` over positional tensor names ``ARG0, ARG1, ..`` (so that equal definitions meet),
    the names' meaning, and which are weights."""
    arguments = {f"ARG{k}": tensor for k, tensor in enumerate(tensor_shapes(expr))}
    positional = rename_tensors(expr, {t: a for a, t in arguments.items()})
    return positional, arguments, tuple(a for a, t in arguments.items() if t in weights)


def _measured_costs(exprs: Sequence[Scope], weights, backend: Backend, found: dict) -> list[float]:
    """Seconds of the best program ``derive`` finds for each of ``exprs`` without explorative
    steps (operator matching and layouts only), compiled and measured; equal ones (up to tensor
    names) derived once (``found``), and all timed again together, in turns
    (``backend.remeasure``)."""
    programs = []
    for expr in exprs:
        positional, _, constant = _positional(expr, weights)
        key = (_form(positional), constant)
        if key not in found:
            found[key] = derive(positional, 0, weights=constant, backend=backend).best
        programs.append(found[key])
    backend.remeasure(list({id(p): p for p in programs}.values()))
    return [p.cost for p in programs]


def _form(expr: Scope) -> tuple:
    """What definitions equal up to tensor names share: equal subprograms are derived once
    (``_subprogram``), equal merges weighed once (``merge_parallel``)."""
    positional = _positional(expr, ())[0]
    return fingerprint(positional), positional.shape, tuple(tensor_shapes(positional).items())
