"""Kernel orchestration of a stitched program (Korch sections 4-5): which of its primitives
share a kernel.

``orchestrate(program, required)`` takes the program's kernels as the primitive graph
(``rewriter.lower.orchestrate``), compiles and measures every candidate kernel (a convex set of
eOperators with one output, fused into one TVM kernel, where a producer its reader reads once and
element-wise joins the reader's loop nest: ``codegen.tvm_kernel``, SOUFFLE's vertical
transformation), checks each against its primitives apart on random inputs, times each where the
program runs it (trial programs with candidates in the place of their primitives, in turns), and
lets the binary linear program choose. Candidates equal up to tensor names (a transformer's
repeated layers) are compiled and checked once. SIRIUS's dependence widths
(``rewriter.lower.dependence``) order the candidates compiled first and label each shared
kernel's inner edges.

``fuse_boundaries`` is the greedy baseline (OLLIE 5.4 post-processing): an eOperator that ends
one subprogram is fused into the eOperator that alone reads it, pair by pair, where that
measures faster.

Both return the new program and an ``Orchestration``: which primitives share a kernel, which are
computed more than once, and the figures (candidates, solver time, gap).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from rewriter.ir import Scope, tensor_shapes
from rewriter.lower import Kernel
from rewriter.lower.dependence import WIDTHS, relies
from rewriter.lower.orchestrate import (
    Choice,
    Primitives,
    convex_candidates,
    fused_kernel,
    internal_widths,
    solve,
    widest,
)
from rewriter.semantics import index_bounds

from .measure import MeasurementDB, Race, median_interval
from .program import (
    CompiledProgram,
    Step,
    _fastest_of,
    _form,
    _fused,
    _implemented,
    _same_results,
    compiled_in_batches,
    in_place_times,
    race_in_place,
    race_slots,
    race_whole,
    results_agree,
    runs_on,
)
from .tvm_kernel import CodegenError


@dataclass(frozen=True)
class SharedKernel:
    """A kernel of the orchestrated program that computes several primitives."""

    output: str
    primitives: tuple[str, ...]  # the outputs of the primitives it computes, its own last
    seconds: float
    apart_seconds: float  # its primitives each as a kernel of its own
    widths: tuple[tuple[str, str, str], ...] = ()  # (producer, consumer, dependence width) inside it
    form: str = ""  # its digest up to tensor names (``_form_digest``): alike kernels share it


@dataclass
class Orchestration:
    """How a program's primitives were mapped to kernels (``rewriter explain`` prints it)."""

    method: str  # "blp" or "greedy"
    shared: list[SharedKernel] = field(default_factory=list)
    recomputed: dict[str, int] = field(default_factory=dict)  # primitive -> kernels computing it (> 1)
    figures: dict = field(default_factory=dict)
    # per round, this plan's program over the one it was settled on (by that plan's method), in
    # the settling's races of the two as they stand: the end-to-end race pools them (not saved)
    evidence: dict[str, tuple[float, ...]] = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> str:
        """The plan in a few lines: figures, each shared kernel (alike ones once, the others by
        their outputs), each recomputed primitive."""
        f = self.figures
        lines = [f"orchestration: {self.method}"]
        if "primitives" in f:
            lines.append(
                f"  {f['primitives']} primitives ({f['reductions']} one-relies-on-many), dependences "
                + ", ".join(f"{n} {w}" for w, n in f["dependences"].items())
            )
            lines.append(
                f"  {f['candidates']} candidate kernels ({f.get('seeded', 0)} of them the greedy plan's;"
                f" {f['measured']} forms compiled and checked, {f['refused']} refused; each timed where"
                f" the program runs it, in {f.get('trials', 1)} trial programs) in {f['measure_s']} s"
            )
        if "variables" in f:
            lines.append(
                f"  BLP: {f['variables']} variables, {f['constraints']} constraints, {f['status']}"
                f" in {f['solve_s']} s, gap {f['gap']}" + (", started from the greedy plan" if f.get("started") else "")
            )
        if f.get("resolves"):
            lines.append(
                f"  {f['retimed']} chosen and greedy kernels timed again where their programs run,"
                f" the BLP solved again {f['resolves']} times"
            )
        if "seconds" in f:
            greedy = (
                f" (the greedy plan's kernels: {f['greedy_seconds'] * 1e3:.3f} ms)" if "greedy_seconds" in f else ""
            )
            lines.append(f"  {f['baseline_seconds'] * 1e3:.3f} ms as primitives -> {f['seconds'] * 1e3:.3f} ms{greedy}")
        if "apart_in_place" in f:
            lines.append(
                f"  raced where the program runs: {f['apart_in_place']} shared kernels taken apart,"
                f" {f.get('runners_up_in_place', 0)} derived kernels replaced by a runner-up"
            )
        for method in ("greedy", "blp"):
            if f"settled_{method}" in f:
                lines += _describe_settling(method, f[f"settled_{method}"])
        if "end_to_end_ms" in f:
            kept = "the kernels as stitched" if self.method == "none" else f"the {self.method} plan"
            pooled = "".join(
                f"; {n} pooled with its settling's races, {rounds} rounds: {median:.3f}x ({low:.3f}-{high:.3f})"
                for n, (rounds, low, median, high) in f.get("end_to_end_pooled", {}).items()
            )
            lines.append(f"  whole runs, {describe_race(f, 'end_to_end')}{pooled}; kept {kept}")
        if "layouts_ms" in f:
            lines.append(f"  layouts, whole runs {describe_race(f, 'layouts')}; kept {f['layout']}")
        for k, *alike in _alike(self.shared):
            edges = "; ".join(f"{p} -{w}-> {c}" for p, c, w in k.widths)
            lines.append(
                f"  {k.output} computes {', '.join(k.primitives)}: "
                f"{k.apart_seconds * 1e3:.3f} ms apart -> {k.seconds * 1e3:.3f} ms" + (f" ({edges})" if edges else "")
            )
            if alike:
                lines.append(f"    and {len(alike)} more alike: {', '.join(a.output for a in alike)}")
        for name, times in self.recomputed.items():
            lines.append(f"  {name} is computed by {times} kernels")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "shared": [k.__dict__ | {"primitives": list(k.primitives), "widths": list(k.widths)} for k in self.shared],
            "recomputed": self.recomputed,
            "figures": self.figures,
        }

    @staticmethod
    def from_json(data: dict) -> Orchestration:
        shared = [
            SharedKernel(**(k | {"primitives": tuple(k["primitives"]), "widths": tuple(map(tuple, k["widths"]))}))
            for k in data["shared"]
        ]
        return Orchestration(data["method"], shared, dict(data["recomputed"]), dict(data["figures"]))


def orchestrate(
    program: CompiledProgram,
    required: set[str],
    db: MeasurementDB | None = None,
    tune: int = 0,
    max_primitives: int = 5,
    time_limit: float | None = 60.0,
    solver_time_limit: float = 10.0,
    seeds: Sequence[tuple[tuple[str, ...], Step]] = (),
) -> tuple[CompiledProgram, Orchestration]:
    """Korch's orchestration of ``program``: candidate kernels of up to ``max_primitives`` eOperators
    compiled, checked and measured (until ``time_limit`` seconds have passed: the candidates not
    reached yet are left out), then every candidate and primitive timed where the program runs it
    (``_in_place``: the program with candidates in the place of their primitives, such programs in
    turns), then the BLP's choice, its kernels and the greedy plan's timed again where those
    programs run and the BLP solved again (``_retimed``). ``required``: the tensors the program
    must still produce (the model's outputs); the program's last output always is. ``seeds``: kernels already compiled and
    checked that compute several primitives (the outputs of those primitives, and the step;
    ``fused_kernels`` of the greedy plan), candidates too, of any size: the greedy plan is then one
    the BLP can choose, and its choice is at least as fast in the BLP's terms."""
    timed = program._timed()
    graph = Primitives.of([s.kernel for s in timed])
    forms: dict[tuple, Step | None] = {}  # canonical form -> its compiled step (None: refused)
    for s in timed:  # a candidate of a primitive's form is that primitive's compiled kernel
        forms.setdefault(_canonical(s.kernel)[1], s.renamed(_names(s.kernel), program.dtype))
    seeded = _seeded(seeds, timed, forms, program.dtype)
    start = time.perf_counter()
    available = set(program.inputs) | set(program.constants) | {s.kernel.output for s in program.steps}
    found = convex_candidates(
        graph,
        lambda i: timed[i].kernel.kind == "eop",
        max_primitives,
        linear=lambda i: _generated_with_epilogue(timed[i].kernel, available),
    )
    found += sorted(set(seeded) - set(found))
    # SIRIUS's widths order what is measured first (a time limit leaves out the last): a
    # candidate whose primitives depend element-wise can run as one loop nest, one with a global
    # dependence only saves a call
    widths = {members: internal_widths(graph, members) for members in found}
    found.sort(key=lambda members: (widest(widths[members]), len(members)))
    candidates = []  # (members, the fused kernel, its form)
    new_forms = {}  # a form not seen yet -> its canonical kernel, a kernel of that form, its primitives apart
    for members in found:
        kernel = seeded.get(members) or fused_kernel(graph, members)
        if kernel is None:  # it would be too large a tree to walk (``fusion.MAX_TREE_SCOPES``)
            continue
        canonical, key = _canonical(kernel)
        candidates.append((members, kernel, key))
        if key not in forms and key not in new_forms:
            new_forms[key] = (canonical, kernel, [timed[m] for m in members])
    build = lambda key: _implemented(new_forms[key][0], program.dtype, tune)  # noqa: E731
    for key, options in compiled_in_batches(list(new_forms), build):
        if time_limit is not None and time.perf_counter() - start > time_limit:
            break
        forms[key] = _checked(options, *new_forms[key][1:], program.dtype, db)
    reached = {key for _, _, key in candidates if key in forms}  # (the time limit leaves out the rest)
    measured, refused = (len({key for key in reached if (forms[key] is None) == none}) for none in (False, True))
    candidates = [c for c in candidates if c[2] in reached and forms[c[2]] is not None]
    made = list(timed) + [
        forms[key].renamed({v: k for k, v in _names(kernel).items()}, program.dtype) for _, kernel, key in candidates
    ]
    members = [(i,) for i in range(len(timed))] + [m for m, _, _ in candidates]
    left = None if time_limit is None else max(0.0, time_limit - (time.perf_counter() - start))
    forms = [_form([step]) for step in made]  # alike up to tensor names: weighed on their pooled samples
    seconds, trials = _in_place(program, graph, members, made, forms, set(required) | {program.output}, left)
    edges = internal_widths(graph, range(len(timed)))
    figures = {
        "primitives": len(timed),
        "reductions": sum(relies(s.kernel.expr) == "one-on-many" for s in timed if isinstance(s.kernel.expr, Scope)),
        "dependences": {w: sum(width == w for _, _, width in edges) for w in WIDTHS},
        "candidates": len(found),
        "seeded": len(seeded),
        "measured": measured,
        "refused": refused,
        "trials": trials,
        "measure_s": round(time.perf_counter() - start, 2),
    }
    choices = [Choice(m, frozenset(tensor_shapes(s.kernel.expr)), t) for m, s, t in zip(members, made, seconds)]
    made = [replace(s, seconds=t) for s, t in zip(made, seconds)]
    greedy = _seeds_plan(choices, seeded, len(timed)) if seeded else []
    needed = set(required) | {program.output}
    plan = solve(graph, choices, needed, solver_time_limit, start=greedy)
    plan, retimed = _retimed(program, graph, choices, made, forms, needed, plan, greedy, solver_time_limit)
    figures |= plan.figures | {"seconds": plan.seconds, "baseline_seconds": plan.baseline_seconds} | retimed
    if greedy:
        figures["greedy_seconds"] = sum(choices[i].seconds for i in greedy)
    steps, _ = _plan_steps(program, made, choices, plan.chosen)
    orchestrated = replace(program, steps=steps, constants=dict(program.constants), buffers={}).prepare()
    chosen = [choices[i] for i in plan.chosen]
    return orchestrated, _plan_report(graph, chosen, choices, widths, figures)


RESOLVES = 8  # at most: re-time the plans' kernels where they run, solve again
RESOLVE_S = 2.0  # the solver's time limit for each re-solve (it starts from the cheaper plan)


def _retimed(
    program: CompiledProgram,
    graph: Primitives,
    choices: list[Choice],
    made: list[Step],
    forms: list[tuple],
    required: set[str],
    plan,
    greedy: list[int],
    solver_time_limit: float,
):
    """The BLP's plan against the optimizer's curse: of many candidates each timed a few times,
    the solver picks those timed in a lucky moment, so its plan's sum is an estimate biased low.
    The chosen kernels and the greedy plan's are timed again where their programs run them (the
    two programs in turns, ``in_place_times``), the seconds in ``choices`` and ``made`` of each
    kernel alike to one re-timed (``_in_place``'s pooling) replaced by those fresh samples (pooled
    with any earlier ones), and the BLP solved again, up to ``RESOLVES`` times, until it chooses
    no kernel not re-timed yet. BERT-base (32 tokens, a Zen 4): the plan's kernels summed 0.84
    and 0.92 of the greedy plan's as first timed, 0.98-1.02 where the two programs ran in turns;
    re-timed and solved again eight times, its estimate rose from 29.5 to 32.9 ms against the
    greedy plan's 34.2-34.8, each solve finding other candidates timed low. Returns the plan and figures: how many kernels were re-timed, how often solved."""
    samples: dict[tuple, list[float]] = {}  # form -> its fresh samples
    solves = 0
    for _ in range(RESOLVES):
        plans = [list(plan.chosen)] + ([greedy] if greedy else [])
        if all(forms[i] in samples for p in plans for i in p):
            break
        programs, placed = zip(*(_plan_steps(program, made, choices, p) for p in plans))
        shared = {i for p in plans for i in p if len(choices[i].members) > 1}  # (the rest: the program's own)
        prepared = _prepared(program, [made[i] for i in shared])
        runs = [replace(program, steps=steps, buffers={}, prepared=prepared) for steps in programs]
        for indices, times in zip(placed, in_place_times(runs, rounds=8)):
            for index, each in zip(indices, times):
                if index is not None and each:
                    samples.setdefault(forms[index], []).extend(each)
        for index, form in enumerate(forms):
            if form in samples:
                seconds = float(np.median(samples[form]))
                choices[index] = replace(choices[index], seconds=seconds)
                made[index] = replace(made[index], seconds=seconds)
        cheaper = min(plans, key=lambda p: sum(choices[i].seconds for i in p))
        plan = solve(graph, choices, required, min(solver_time_limit, RESOLVE_S), start=cheaper)
        solves += 1
    return plan, {"retimed": sum(form in samples for form in forms), "resolves": solves}


def _plan_steps(
    program: CompiledProgram, made: list[Step], choices: list[Choice], chosen: Sequence[int]
) -> tuple[list[Step], list[int | None]]:
    """The steps of ``program`` with the ``chosen`` kernels (indices into ``choices`` and
    ``made``) in the place of the primitives they output, a primitive no chosen kernel outputs
    dropped; and per step its index in ``choices`` (None for a step that is no primitive)."""
    output = {choices[i].members[-1]: i for i in chosen}  # output primitive -> its kernel
    at = {id(s): p for p, s in enumerate(program._timed())}
    steps, indices = [], []
    for s in program.steps:
        if id(s) not in at:
            steps.append(s)
            indices.append(None)
        elif at[id(s)] in output:
            steps.append(made[output[at[id(s)]]])
            indices.append(output[at[id(s)]])
    return steps, indices


def _in_place(
    program: CompiledProgram,
    graph: Primitives,
    members: list[tuple[int, ...]],
    steps: list[Step],
    forms: list[tuple],
    required: set[str],
    time_limit: float | None,
) -> tuple[list[float], int]:
    """Each kernel's seconds where a program runs it (``members``: its primitives, output last;
    ``steps``: the kernel; ``forms``: each one's ``program._form``): the program runs with
    candidate kernels in the place of their primitives (``_trials``), the trial programs in
    turns (``in_place_times``), and each kernel's median is taken over every run that ran it or
    a kernel of its form (alike up to tensor names: every layer's fusion of the same primitives,
    where the program repeats a layer), as ``race_slots`` decides alike slots together: weighed
    apart, on a few samples each, the BLP fused alike layers differently (ViT-Base on an Intel
    Xeon: its first layer's value projection apart from the attention-weighted values, its
    second's fused into them), and took whichever layer's kernel a fast moment timed low. Also
    returns the number of trials.

    Timed alone, a kernel runs again and again on inputs in cache; in a program it follows
    other kernels, on the cores and caches they leave. A 4-layer LLaMA (hidden 576, 32 tokens):
    weighing kernels timed alone, the BLP's plan summed 5.23 ms against the greedy plan's 5.40,
    yet where the programs ran them its kernels took 5.93 ms and the greedy plan's 5.87 (small
    generated kernels 1.6 to 1.9 times their time alone, products with an epilogue 1.14,
    products 1.0 to 1.1), and whole runs 5.63 and 5.54. Weighed in place, the BLP's sum is
    within 1-2% of its kernels' times where the chosen program runs them."""
    trials = _trials(graph, members, {i for i, k in enumerate(graph.kernels) if k.output in required})
    timed = program._timed()
    at = {id(s): p for p, s in enumerate(timed)}
    prepared = _prepared(program, steps[len(timed) :])
    programs, placed = [], []  # per trial: its program, and per step the kernel it times (an index into steps)
    for substitutes, dropped in trials:
        kept = [s for s in program.steps if at.get(id(s)) not in dropped]
        runs = [steps[substitutes[at[id(s)]]] if at.get(id(s)) in substitutes else s for s in kept]
        programs.append(replace(program, steps=runs, buffers={}, prepared=prepared))
        placed.append([substitutes.get(at.get(id(s)), at.get(id(s))) for s in kept])
    per_round = sum(s.seconds or 0.0 for s in timed) * len(programs)  # (the primitives' times alone)
    rounds = 6 if time_limit is None or per_round == 0 else max(3, min(6, int(time_limit / per_round)))
    samples: dict[tuple, list[float]] = {form: [] for form in forms}
    for kernels, times in zip(placed, in_place_times(programs, rounds)):
        for index, each in zip(kernels, times):
            if index is not None:
                samples[forms[index]] += each
    return [float(np.median(samples[f])) if samples[f] else math.inf for f in forms], len(programs)


def _prepared(program: CompiledProgram, steps: Sequence[Step]) -> dict:
    """``program``'s prepared weights and those ``steps`` lay out in their own layouts."""
    prepared = dict(program.prepared)
    for step in steps:
        if hasattr(step.call, "prepare"):
            prepared.update(step.call.prepare(program.constants))
    return prepared


def _trials(
    graph: Primitives, members: list[tuple[int, ...]], required: set[int]
) -> list[tuple[dict[int, int], set[int]]]:
    """Trial programs that together run every candidate kernel (``members``: each one's primitives,
    output last; the primitives alone first) where the program would run it: the first runs the
    primitives as they are; each other puts candidates whose primitives do not overlap in the place
    of their output primitive, and drops the primitives whose outputs only what it drops or replaces
    reads (the rest, and ``required`` ones, still run: a program choosing the candidate computes
    them apart). Each trial: output primitive -> the candidate computing it, and the primitives
    dropped."""
    readers: list[set[int]] = [set() for _ in graph.kernels]
    for consumer, producers in enumerate(graph.producers):
        for p in producers:
            readers[p].add(consumer)
    trials: list[tuple[dict[int, int], set[int]]] = [({}, set())]
    taken: list[set[int]] = [set()]
    for index, inside in enumerate(members):
        if len(inside) == 1:
            continue
        free = next((t for t in range(1, len(trials)) if taken[t].isdisjoint(inside)), None)
        if free is None:
            trials.append(({}, set()))
            taken.append(set())
            free = len(trials) - 1
        taken[free].update(inside)
        trials[free][0][inside[-1]] = index
        gone = {inside[-1]}  # the output, in the candidate's place; then each member only those gone read
        for m in reversed(inside[:-1]):
            if m not in required and readers[m] <= gone:
                gone.add(m)
        trials[free][1].update(gone - {inside[-1]})
    return trials


def fused_kernels(program: CompiledProgram, plan: Orchestration) -> list[tuple[tuple[str, ...], Step]]:
    """The kernels of an orchestrated ``program`` that compute several primitives: the outputs
    of those primitives (``plan.shared``) and the kernel's step (``orchestrate``'s seeds)."""
    steps = {s.kernel.output: s for s in program.steps}
    return [(k.primitives, steps[k.output]) for k in plan.shared if k.output in steps]


def _seeded(seeds, timed: list[Step], forms: dict, dtype: str) -> dict[tuple[int, ...], Kernel]:
    """The seeds whose primitives are all in the graph (``timed``), by their members (positions,
    in execution order), each seed's form entered in ``forms`` as compiled."""
    position = {s.kernel.output: i for i, s in enumerate(timed)}
    seeded = {}
    for outputs, step in seeds:
        if len(outputs) > 1 and all(o in position for o in outputs):
            seeded[tuple(sorted(position[o] for o in outputs))] = step.kernel
            forms.setdefault(_canonical(step.kernel)[1], step.renamed(_names(step.kernel), dtype))
    return seeded


def _seeds_plan(choices: list[Choice], seeded, primitives: int) -> list[int]:
    """The seeds' plan in the BLP's terms (indices into ``choices``): each seed, and each
    primitive that no seed computes as its own kernel."""
    index = {c.members: i for i, c in enumerate(choices)}
    plan = [index[members] for members in seeded if members in index]
    covered = {m for i in plan for m in choices[i].members}
    return plan + [index[(p,)] for p in range(primitives) if p not in covered]


def _generated_with_epilogue(kernel: Kernel, available: set[str]) -> bool:
    """A matched operator (a product, a convolution) may join a candidate as a generated kernel
    with the element-wise work after it, where everything it reads is at hand at run time (a
    library call may read a weight only in its own prepared layout)."""
    return kernel.kind not in ("eop", "opaque") and set(tensor_shapes(kernel.expr)) <= available


def _plan_report(graph: Primitives, chosen: list[Choice], choices: list[Choice], widths, figures) -> Orchestration:
    """The chosen kernels that compute several primitives (their time apart: the primitives'
    own kernels, ``choices[p]``), and the primitives computed by more than one kernel."""
    computed: dict[str, int] = {}
    shared = []
    for choice in chosen:
        outputs = tuple(graph.kernels[m].output for m in choice.members)
        for name in outputs:
            computed[name] = computed.get(name, 0) + 1
        if len(outputs) > 1:
            apart = sum(choices[m].seconds for m in choice.members)
            shared.append(SharedKernel(outputs[-1], outputs, choice.seconds, apart, widths[choice.members]))
    recomputed = {name: n for name, n in computed.items() if n > 1}
    return Orchestration("blp", shared, recomputed, figures)


def _alike(shared: Sequence[SharedKernel]) -> list[list[SharedKernel]]:
    """``shared`` in groups of kernels alike up to tensor names (a repeated layer's, twelve times
    in BERT-base), in order of each group's first kernel; a kernel with no form is alone."""
    groups: dict[str, list[SharedKernel]] = {}
    for k in shared:
        groups.setdefault(k.form or f"\0{id(k)}", []).append(k)
    return list(groups.values())


def _form_digest(kernel: Kernel) -> str:
    """A short digest of ``kernel``'s form (``_canonical``): equal for kernels equal up to tensor
    names, and the same in every process (it is saved with the plan)."""
    return hashlib.sha256(repr(_canonical(kernel)[1]).encode()).hexdigest()[:16]


def _names(kernel: Kernel) -> dict[str, str]:
    """Positional tensor names for ``kernel``: its inputs ``ARG0, ARG1, ..`` in reading order,
    its output ``OUT``; forms equal up to tensor names meet under them."""
    return {t: f"ARG{k}" for k, t in enumerate(tensor_shapes(kernel.expr))} | {kernel.output: "OUT"}


def _canonical(kernel: Kernel) -> tuple[Kernel, tuple]:
    """``kernel`` over positional names (``_names``), and the key of its form: kernels equal up
    to tensor names meet under it."""
    canonical = kernel.renamed(_names(kernel))
    return canonical, (
        str(canonical.expr),
        tuple(tensor_shapes(canonical.expr).values()),
        canonical.kind,
        canonical.weight_only,
    )


def _checked(options: list[Step] | CodegenError, kernel: Kernel, apart: list[Step], dtype: str, db) -> Step | None:
    """A candidate kernel's fastest compiled implementation (``options``: over positional names),
    or None where TVM refused it or its results differ from its primitives' apart (``apart``;
    ``kernel``: the candidate over the program's names). It is timed with every other form,
    in turns, once all are checked."""
    if isinstance(options, CodegenError):
        return None
    step = _fastest_of(options, dtype, db)
    back = {v: k for k, v in _names(kernel).items()}
    return step if _same_results(step.renamed(back, dtype), apart, dtype) else None


def fuse_boundaries(
    program: CompiledProgram, boundaries: set[str], db: MeasurementDB | None = None, tune: int = 0
) -> tuple[CompiledProgram, Orchestration]:
    """The greedy baseline across the parts of a stitched program (OLLIE 5.4, Figure 9): an
    eOperator that ends one part and is read only by an eOperator of a later one is fused into
    it where the fused kernel measures faster and computes the same values. ``boundaries``: the
    tensors the parts hand over (not the model's outputs, which must stay)."""
    log = []
    steps = _fused(program.steps, program.dtype, db, tune, producers=boundaries.__contains__, check=True, log=log)
    primitives: dict[str, tuple[str, ...]] = {}
    extra: dict[str, float] = {}  # a fused kernel's primitives apart, less the kernel's own time
    shared: dict[str, SharedKernel] = {}
    for f in log:
        primitives[f.consumer] = primitives.pop(f.producer, (f.producer,)) + primitives.get(f.consumer, (f.consumer,))
        apart = f.seconds_apart + extra.pop(f.producer, 0.0) + extra.get(f.consumer, 0.0)
        extra[f.consumer] = apart - f.seconds_fused
        shared.pop(f.producer, None)
        shared[f.consumer] = SharedKernel(f.consumer, primitives[f.consumer], f.seconds_fused, apart)
    greedy = replace(program, steps=steps, constants=dict(program.constants), buffers={}).prepare()
    return greedy, Orchestration("greedy", list(shared.values()), {}, {"fusions": len(log)})


SETTLE_RACES = 8  # at most: groups of regions raced whole (the BLP's largest estimated savings first)
SETTLE_S = 5.0  # the longest one such race runs, once past its first rounds (``WHOLE_RACE_ROUNDS``)
# how much faster one race must find a change to take it on that race alone: the race's
# resolution. Below it, a ratio's interval lies under 1 as often by a state of the machine as
# by the change: GPT-2 (32 tokens, a Zen 4) took a group of 7 regions at 0.998 (95%:
# 0.985-0.999), and its plan then ran 1.003x the plan without them (1.000-1.007) in the race
# that followed. A change surely faster by less is raced once more (``surely_faster``).
SETTLE_MARGIN = 0.005
_SETTLING_RACE = functools.partial(race_whole, max_seconds=SETTLE_S)
# One race of every change at once, and the end-to-end race of the plans, run until their
# intervals span at most 0.4% (or 1024 rounds, or a minute), looked at first after 128
# rounds: what the BLP adds to a transformer's greedy plan is a few tenths of a percent of a
# run, below what a race that stops at 1% can tell. BERT-base (32 tokens, a Zen 3, 88th
# stop): the BLP's plan on a saved program ran 0.9967x, 0.9943x and 0.9941x it (each
# interval below 1) in three races of 90 s, where a copy of the program ran 0.9995x, 0.9995x
# and 1.0015x (each holding 1 or at its edge); in the settling's race of 5 s it had come out
# 0.9958x (0.9923-1.0019): not taken. Looked at after 32 rounds, MobileNetV2's end-to-end
# race kept the BLP's plan at 0.955x the greedy one's (0.935-0.9996, in a slow state: 6.8
# and 7.8 ms a run) whose benchmark then timed the greedy plan at 0.994x it (0.992-0.997,
# 1000 rounds; a copy of ours 1.000, 0.998-1.004).
FINE_RACE = {"min_rounds": 128, "resolution": 0.002, "max_rounds": 1024, "max_seconds": 60.0}
_FINE_RACE = functools.partial(race_whole, **FINE_RACE)


# the plans each orchestration method may keep, its own first: the BLP's plan is settled on the
# greedy one, the greedy one on the kernels as given ("none")
KEEPS = {"blp": ("blp", "greedy", "none"), "greedy": ("greedy", "none")}


def faster_end_to_end(
    plans: Mapping[str, tuple[CompiledProgram, Orchestration]],
    methods: Sequence[str] = ("blp",),
    baseline: str = "greedy",
    race: Callable[[Mapping[str, CompiledProgram], str], Race] = _FINE_RACE,
) -> dict[str, tuple[CompiledProgram, Orchestration]]:
    """For each of ``methods``, of the orchestrated programs it may keep (``KEEPS``; ``plans``
    by name), the one whose whole runs measure faster than ``baseline``'s (``race``:
    ``race_whole`` with ``FINE_RACE``, the programs in turns, each against the baseline in the
    same round; for a plan settled on the baseline's with races of the two as they stand,
    this race's rounds and those together, ``_pooled``, unless this race alone puts it surely
    slower), the fastest such; the baseline where none does (it is the plan a program would otherwise have:
    a plan one cannot tell from it is not worth its risk). One race serves every method, so
    the BLP and the greedy method decide on the same rounds. Programs with the same kernels
    are one program, raced once. The plans' own figures sum kernels timed apart, which a
    program's time is not (its kernels find each other's data in the caches, or evict it):
    this is the choice as the program runs. A kept plan's figures gain those of the plans its
    method weighed (the BLP's size and solve time where the greedy plan is kept) and, where
    programs were raced, the race's (``race_figures``)."""
    distinct: dict[str, CompiledProgram] = {}
    alias = {}
    for method, (program, _) in plans.items():
        alias[method] = next((name for name, other in distinct.items() if _same_kernels(program, other)), method)
        distinct.setdefault(alias[method], program)
    base = alias.get(baseline, next(iter(distinct)))
    raced = race(distinct, base) if len(distinct) > 1 else None
    pooled = _pooled(plans, alias, baseline, raced) if raced else {}
    ratio = lambda name: pooled[name][1:] if name in pooled else raced.ratios[alias[name]]  # noqa: E731
    kept = {}
    for method in methods:
        weighed = [name for name in KEEPS[method] if name in plans]
        # surely faster, its own race not surely slower (where its rounds pool with earlier ones)
        faster = [n for n in weighed if raced and ratio(n)[2] < 1 and raced.ratios[alias[n]][0] <= 1]
        # none surely faster: the baseline's program, under the first name it has here (its own first)
        name = min(faster, key=lambda n: ratio(n)[1]) if faster else _first(weighed, alias, base)
        program, plan = plans[name]
        figures = {key: value for n in weighed for key, value in plans[n][1].figures.items()} | plan.figures
        if raced:
            figures |= race_figures(raced, "end_to_end")
        if pooled:
            figures["end_to_end_pooled"] = {n: [p[0], *(round(r, 4) for r in p[1:])] for n, p in pooled.items()}
        kept[method] = program, replace(plan, figures=figures)
    return kept


def _pooled(
    plans: Mapping[str, tuple[CompiledProgram, Orchestration]], alias: dict[str, str], baseline: str, raced: Race
) -> dict[str, tuple[int, float, float, float]]:
    """For each plan settled on ``baseline``'s with races of the two as they stand (its
    ``evidence``), those rounds' ratios pooled with the end-to-end race's of the same two:
    how many rounds, and their median ratio and interval. One race measures the state the
    machine ran it in: ViT-Base's BLP plan (89th stop, a Zen 3) was taken at 0.992
    (0.985-0.997) and 0.991 (0.986-0.995) of the greedy plan's time, and the end-to-end race,
    on its own, then put it at 0.997 (0.991-1.002) and kept the greedy plan."""
    pooled = {}
    for name, (_, plan) in plans.items():
        earlier, own = plan.evidence.get(baseline, ()), raced.samples.get(alias[name], ())
        if baseline in alias and earlier and own and alias[name] != alias[baseline]:
            rounds = [*earlier, *own]
            pooled[name] = (len(rounds), *median_interval(rounds, raced.confidence))
    return pooled


def _first(weighed: list[str], alias: dict[str, str], program: str) -> str:
    """The first of ``weighed`` that is ``program`` (by its alias), else the first of them."""
    return next((name for name in weighed if alias[name] == program), weighed[0])


def settled(
    stitched: CompiledProgram,
    ours: tuple[CompiledProgram, Orchestration],
    theirs: tuple[CompiledProgram, Orchestration],
    race: Callable[[Mapping[str, CompiledProgram], str], Race] = _SETTLING_RACE,
    race_all: Callable[[Mapping[str, CompiledProgram], str], Race] = _FINE_RACE,
) -> tuple[CompiledProgram, Orchestration]:
    """The plan ``ours`` (its program and orchestration: the BLP's) taken into ``theirs`` (the
    greedy plan's; or the kernels as stitched, "none", for the greedy plan) region by region,
    each region kept only where whole runs are faster with it (``race``: the program with it
    against the program without, in turns). A region is where the two plans differ: kernels of
    either that compute a primitive of ``stitched`` in common, transitively (ours for those
    primitives against theirs). Regions alike up to tensor names (a transformer's layers) are
    one group, raced once and taken together, largest saving in our plan's terms first, after
    one race of every region at once (``adopted_where_faster``; ``race_all``, a finer race);
    a group whose kernels would read what the program no longer makes there (another
    region's kernels fused it away) stays as theirs. The result is labelled with our method,
    its figures ``settled_METHOD``.

    Why: both plans weigh kernels by their times alone or where trial programs ran them, which
    sum to less than a whole run's change (kernels find each other's data in the caches, or
    evict it), and of many candidates the BLP takes some a lucky moment timed low. BERT-base
    (32 tokens, a Zen 4): the BLP's plan ran 1.032x the greedy one's (95%: 1.029-1.037) where
    it estimated itself 20% faster, and in another optimization the greedy plan ran 1.055x the
    kernels as stitched. Settled, a plan is the other with its changes that surely pay in
    whole runs: at least as fast, and faster where any does."""
    (ours, ours_plan), (theirs, theirs_plan) = ours, theirs
    made_at = {s.kernel.output: i for i, s in enumerate(stitched.steps)}
    position = lambda s: made_at.get(s.kernel.output, len(made_at))  # noqa: E731  (where the stitched program makes it)
    members = {
        id(s): _members(s, plan) for program, plan in ((ours, ours_plan), (theirs, theirs_plan)) for s in program.steps
    }
    key = lambda s: (s.kernel.output, s.kernel.expr, s.impl)  # noqa: E731
    in_ours, in_theirs = {key(s) for s in ours.steps}, {key(s) for s in theirs.steps}
    only = [s for s in ours.steps if key(s) not in in_theirs] + [s for s in theirs.steps if key(s) not in in_ours]
    only = [s for s in only if s.kernel.output not in stitched.constants]
    regions = _regions(only, members)
    groups: dict[tuple, list[tuple[list[Step], list[Step]]]] = {}
    for region in regions:
        mine = sorted((s for s in region if key(s) not in in_theirs), key=position)
        other = sorted((s for s in region if key(s) in in_theirs), key=position)
        groups.setdefault((_form(mine), _form(other)), []).append((mine, other))
    saving = lambda group: sum(  # noqa: E731
        sum(s.seconds or 0.0 for s in other) - sum(s.seconds or 0.0 for s in mine) for mine, other in group
    )
    order = sorted(groups.values(), key=saving, reverse=True)
    program = replace(theirs, constants=dict(theirs.constants), buffers={}, prepared=ours.prepared | theirs.prepared)

    def taking(steps: list[Step], group) -> list[Step]:  # each kernel where the stitched program makes its output
        drop = {id(s) for _, other in group for s in other}
        return sorted([s for s in steps if id(s) not in drop] + [s for mine, _ in group for s in mine], key=position)

    program, figures, evidence = adopted_where_faster(program, order, taking, race, race_all)
    settling = {"against": theirs_plan.method, "regions": len(regions), "groups": len(groups)} | figures
    figures = ours_plan.figures | {f"settled_{ours_plan.method}": settling}
    report = _program_report(program, members, ours_plan, theirs_plan, figures)
    return program.prepare(), replace(report, evidence={theirs_plan.method: evidence} if evidence else {})


def adopted_where_faster(
    program: CompiledProgram,
    groups: Sequence[list],
    taking: Callable[[list[Step], list], list[Step]],
    race: Callable[[Mapping[str, CompiledProgram], str], Race],
    race_all: Callable[[Mapping[str, CompiledProgram], str], Race],
) -> tuple[CompiledProgram, dict, tuple[float, ...]]:
    """``program`` with each of ``groups`` (changes to it, in order, at most ``SETTLE_RACES``)
    made where whole runs are faster with it (``surely_faster``: the program with the group's
    change, ``taking(steps, group)``, raced against the program as it stands). A change
    whose kernels would read what the program does not make by then is not raced. Returns
    the program; how many groups were raced, how many changes taken, how many unmixable, and
    each raced group's size and ratios; and the rounds' ratios of the races that raced the
    program returned against ``program`` as given (those that took it, where one change
    made it; none where it took several, or none).

    Where there are several groups, all of their changes at once are raced first, in
    ``race_all`` (``whole``: their number and ratios) and, surely faster, taken together:
    savings spread over several groups, each below what one race can tell, add up in a run. BERT-base (32 tokens, a Zen 3,
    87th stop): a settling had raced the BLP's groups one by one at 0.998-1.007x, none taken;
    the BLP run again on the program it left, chose a plan that ran 0.992x and 0.994x it in two
    races of 200 rounds (0.990-0.996)."""
    available = set(program.inputs) | set(program.constants)
    whole, figures = [change for group in groups for change in group], {}
    if len(groups) > 1:
        steps = taking(program.steps, whole)
        if runs_on([s for s in steps if s.kernel.output not in program.constants], available):
            candidate, rounds = replace(program, steps=steps, buffers={}), []
            faster, raced = surely_faster(program, candidate, _recorded(race_all, rounds))
            figures = {"whole": [len(whole), *(round(r, 4) for ratio in raced for r in ratio)]}
            if faster:
                taken_whole = {"raced": 0, "taken": len(whole), "unmixable": 0, "ratios": []}
                return candidate, figures | taken_whole, tuple(rounds)
    ratios, taken, unmixable, evidence = [], 0, 0, ()
    for group in groups[:SETTLE_RACES]:
        steps = taking(program.steps, group)
        if not runs_on([s for s in steps if s.kernel.output not in program.constants], available):
            unmixable += 1
            continue
        candidate, rounds = replace(program, steps=steps, buffers={}), []
        faster, raced = surely_faster(program, candidate, _recorded(race, rounds))
        ratios.append([len(group), *(round(r, 4) for ratio in raced for r in ratio)])
        if faster:
            evidence = () if taken else tuple(rounds)  # a second change: no race ran the two as they end
            program, taken = candidate, taken + len(group)
    figures |= {"raced": len(ratios), "taken": taken, "unmixable": unmixable, "ratios": ratios}
    return program, figures, evidence


def _recorded(race: Callable[[Mapping[str, CompiledProgram], str], Race], rounds: list[float]):
    """``race``, adding each race's rounds' ratios (the program "with" a change over it
    "without") to ``rounds``."""

    def recorded(programs: Mapping[str, CompiledProgram], baseline: str) -> Race:
        raced = race(programs, baseline)
        rounds.extend(raced.samples.get("with", ()))
        return raced

    return recorded


def surely_faster(
    program: CompiledProgram, candidate: CompiledProgram, race: Callable[[Mapping[str, CompiledProgram], str], Race]
) -> tuple[bool, list[tuple[float, float, float]]]:
    """Whether whole runs of ``candidate`` are faster than ``program``'s, and the ratios
    (candidate over program: low, median, high) of the races that said so: faster where the
    race's interval lies below 1 by more than ``SETTLE_MARGIN``, or below 1 and again below
    1 in a second race. Calibrated on GPT-2, BERT-base (32 tokens) and MobileNetV2 programs
    (a Zen 4; bench/race_calibration.py, programs raced in one pool of buffers): copies of
    the program taken in none of 38 trials; savings of 0.3% of a run in 10 of 22, of 0.6% in
    14 of 22, of 1% in 21 of 22, where the margin alone took 2, 3 and 12.

    A first race that ends undecided (its interval reaching past 1: the race ran out of time
    in a noisy spell) with its median below 1 by more than the margin is raced once more, and
    that race decides as a first one would, a ratio below 1 by less than the margin taken:
    GPT-2's BLP (32 tokens, the Zen 4, 81st stop) offered a group of 12 regions at 0.9815
    (0.973-1.003) that no race looked at again. Of the calibration's 82 first races above,
    none ended so; of 40 copies raced before the races shared one pool of buffers, 6 did. On
    a GPT-2 program with this rule: no copy taken in 12 trials (one raced again), savings of
    0.3% in 1 of 6 and of 1% in 6 of 6, three of those seven through a second race after an
    undecided first."""
    ratios = []
    for _ in range(2):
        ratios.append(race({"without": program, "with": candidate}, "without").ratios["with"])
        _, median, high = ratios[-1]
        if high < 1 - SETTLE_MARGIN:
            return True, ratios
        if high >= 1 and (len(ratios) > 1 or median >= 1 - SETTLE_MARGIN):
            return False, ratios
    return True, ratios


def _members(step: Step, plan: Orchestration) -> tuple[str, ...]:
    """The primitives ``step`` computes in ``plan`` (their outputs): a shared kernel's, else its own output."""
    return next((k.primitives for k in plan.shared if k.output == step.kernel.output), (step.kernel.output,))


def _regions(steps: list[Step], members: dict[int, tuple[str, ...]]) -> list[list[Step]]:
    """``steps`` in groups that compute a primitive in common, transitively."""
    parent = list(range(len(steps)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, step in enumerate(steps):
        for name in members[id(step)]:
            parent[root(i)] = root(first.setdefault(name, i))
    regions: dict[int, list[Step]] = {}
    for i, step in enumerate(steps):
        regions.setdefault(root(i), []).append(step)
    return list(regions.values())


def _program_report(program: CompiledProgram, members, *plans_and_figures) -> Orchestration:
    """The settled program's orchestration: the shared kernels it runs (from whichever plan
    each came, each with its form, so ``describe`` prints alike ones once), the primitives it
    computes more than once, and ``figures``."""
    *plans, figures = plans_and_figures
    shared = {k.output: k for plan in reversed(plans) for k in plan.shared}
    computed: dict[str, int] = {}
    kept = []
    for step in program.steps:
        names = members.get(id(step), (step.kernel.output,))
        for name in names:
            computed[name] = computed.get(name, 0) + 1
        if len(names) > 1 and step.kernel.output in shared:
            kept.append(replace(shared[step.kernel.output], form=_form_digest(step.kernel)))
    return Orchestration(plans[0].method, kept, {n: c for n, c in computed.items() if c > 1}, figures)


def _describe_settling(method: str, t: dict) -> list[str]:
    """``settled``'s figures for the ``method`` plan in a few lines: each raced group's ratio."""
    against = "the kernels as stitched" if t["against"] == "none" else f"the {t['against']} plan"
    lines = [
        f"  the {method} plan settled against {against}: {t['regions']} regions where they differ"
        f" ({t['groups']} alike groups), {t['raced']} groups raced whole, {t['taken']} regions taken"
        f" (surely faster: by {SETTLE_MARGIN:.1%} in one race, or in two), {t['unmixable']} groups reading what another fused away"
    ]
    raced = lambda ratios: ", then ".join(  # noqa: E731
        f"{median:.3f}x ({low:.3f}-{high:.3f})" for low, median, high in zip(*[iter(ratios)] * 3)
    )
    if "whole" in t:
        size, *ratios = t["whole"]
        lines.append(f"    all {size} regions at once: whole runs {raced(ratios)} without them")
    for size, *ratios in t.get("ratios", ()):
        lines.append(f"    {size} regions: whole runs {raced(ratios)} without them")
    return lines


def race_figures(raced: Race, name: str) -> dict:
    """A whole-run race as figures: ``NAME_ms`` each program's median run, ``NAME_vs`` its time
    over the baseline's in the same round (low, median, high: the median and the interval that
    holds the true one at the race's confidence), ``NAME_rounds`` and ``NAME_baseline``."""
    return {
        f"{name}_ms": {method: round(s * 1e3, 3) for method, s in raced.seconds.items()},
        f"{name}_vs": {method: [round(r, 4) for r in ratio] for method, ratio in raced.ratios.items()},
        f"{name}_rounds": raced.rounds,
        f"{name}_baseline": raced.baseline,
    }


def describe_race(figures: dict, name: str) -> str:
    """``race_figures`` in a line: each program's median run and, where there is one, its time
    over the baseline's with the interval."""
    vs = figures.get(f"{name}_vs", {})
    baseline = figures.get(f"{name}_baseline")

    def one(method, ms):
        if method == baseline or method not in vs:
            return f"{method} {ms:.3f} ms"
        low, median, high = vs[method]
        return f"{method} {ms:.3f} ms ({median:.3f}x {baseline}'s, {low:.3f}-{high:.3f})"

    rounds = f"{figures[name + '_rounds']} rounds " if f"{name}_rounds" in figures else ""
    return f"{rounds}in turns: " + ", ".join(one(m, ms) for m, ms in figures[f"{name}_ms"].items())


def agreeing(
    plans: Mapping[str, tuple[CompiledProgram, Orchestration]],
    reference: CompiledProgram,
    outputs: set[str],
    unlike: str = "the kernels it fuses",
) -> dict[str, tuple[CompiledProgram, Orchestration]]:
    """The plans whose programs give ``reference``'s ``outputs`` (the stitched program: each of
    its kernels verified, none fused across subprograms; or the program optimized in another
    layout, ``unlike`` saying which) on the same inputs, zeros and ones drawn at random (valid
    token ids and masks too; zeros only where a gather indexes an axis of one). A plan that
    disagrees is left out with a warning naming its first output that differs: its kernels were
    checked alone and fused ones against their parts, which a fault between kernels (a buffer
    planned over a value still to be read, a call bound to the wrong buffer) passes."""
    rng = np.random.default_rng(0)
    below = index_bounds((kernel.output, kernel.expr) for kernel in reference.kernels)  # an axis of one: 0 only
    given = {
        n: rng.integers(0, min(2, below.get(n, 2)), s).astype(reference.dtype) for n, s in reference.inputs.items()
    }
    given = {n: v for n, v in given.items() if n not in reference.constants}
    names = sorted(outputs | {reference.output})
    want = reference.run(given, outputs=names)
    kept = {}
    for method, (program, plan) in plans.items():
        got = program.run(given, outputs=names)
        wrong = next((n for n in names if not results_agree(got[n], want[n])), None)
        if wrong is None:
            kept[method] = (program, plan)
        else:
            warnings.warn(
                f"the {method} program computes {wrong} unlike {unlike}; left out",
                RuntimeWarning,
                stacklevel=2,
            )
    return kept


def _same_kernels(a: CompiledProgram, b: CompiledProgram) -> bool:
    return [(s.kernel.output, s.kernel.expr, s.impl) for s in a.steps] == [
        (s.kernel.output, s.kernel.expr, s.impl) for s in b.steps
    ]


def race_runners_up(
    stitched: CompiledProgram,
    runners_up: Mapping[str, Sequence[CompiledProgram]],
    ends: set[str],
    race: Callable[[Mapping[str, CompiledProgram], str], Race] = _SETTLING_RACE,
    race_all: Callable[[Mapping[str, CompiledProgram], str], Race] = _FINE_RACE,
) -> tuple[CompiledProgram, int]:
    """The stitched program with each subprogram raced where it runs against its runners-up
    (``runners_up``: subprogram output -> programs over the stitched program's names, the
    derivation's next cheapest candidates of other kernel structures: timed alone they lost,
    where the program runs them they may not). A subprogram is its stitched kernels up to its
    output (``ends``: every subprogram's output); each runner-up runs whole in their place
    (``race_slots``), and the one whose kernels take least there is taken where whole runs
    are faster with it (``adopted_where_faster``: alike subprograms taking alike runners-up
    raced once, together), with its bound constants, the others' dropped. Raced before
    orchestration, each subprogram is still whole (fused across a boundary, its last kernel
    would no longer be one a runner-up replaces). Returns the program and how many
    subprograms took a runner-up.

    Why whole runs: the kernels' times in place sum to less than a run's change. BERT-base
    (32 tokens, a Zen 4): 36 subprograms took a runner-up that way, and the program ran 1.009x
    the stitched one's time (95%: 1.007-1.012); in another optimization, the greedy plan built
    on such a program ran 1.055x the stitched program's."""
    constants = dict(stitched.constants)
    for programs in runners_up.values():
        for other in programs:
            constants.update(other.constants)
    program = replace(stitched, constants=constants, buffers={})
    groups, available = [], set(stitched.inputs) | set(constants)
    for steps in _subprograms(stitched.steps, ends):
        found = [steps]
        for other in runners_up.get(steps[-1].kernel.output, ()):
            timed = [s for s in other.steps if s.kernel.output not in constants]
            if timed and runs_on(timed, available):
                found.append(other.steps)
        groups.append(found)
        available |= {s.kernel.output for s in steps}
    if all(len(found) == 1 for found in groups):  # nothing to race: the program as stitched
        return stitched, 0
    slots = [[[s for s in steps if s.kernel.output not in constants] for steps in found] for found in groups]
    base, changes = [], {}
    for found, (k, seconds) in zip(groups, race_slots(program, slots, rounds=6)):
        times = dict(zip((s.kernel.output for s in found[k] if s.kernel.output not in constants), seconds))
        chosen = [replace(s, seconds=times[s.kernel.output]) if times.get(s.kernel.output) else s for s in found[k]]
        base += chosen if k == 0 else found[0]
        if k > 0:  # alike subprograms (every layer's) taking alike runners-up: one change
            changes.setdefault((_form(chosen), _form(found[0])), []).append((chosen, found[0]))
    order = sorted(changes.values(), key=len, reverse=True)
    # the runners-up's weights laid out beforehand, as the program's are: a packed kernel lays
    # out a weight missing from ``prepared`` on every call, which its whole runs would time
    laid_out = _prepared(program, [s for group in order for new, _ in group for s in new])
    program, figures, _ = adopted_where_faster(
        replace(program, steps=base, prepared=laid_out), order, _spliced, race, race_all
    )
    used = {n for s in program.steps for n in tensor_shapes(s.kernel.expr)} | {s.kernel.output for s in program.steps}
    kept = {n: v for n, v in constants.items() if n in used}
    return replace(program, constants=kept, buffers={}).prepare(), figures["taken"]


def _spliced(steps: list[Step], group) -> list[Step]:
    """``steps`` with each ``(new, old)`` pair of ``group`` made: the new steps where the first
    old one stood, the old ones gone."""
    steps = list(steps)
    for new, old in group:
        gone = {id(s) for s in old}
        at = next(i for i, s in enumerate(steps) if id(s) in gone)
        steps = steps[:at] + list(new) + [s for s in steps[at:] if id(s) not in gone]
    return steps


def _subprograms(steps: Sequence[Step], ends: set[str]) -> list[list[Step]]:
    """``steps`` (a stitched program's) cut after each subprogram's output (``ends``)."""
    cut, current = [], []
    for step in steps:
        current.append(step)
        if step.kernel.output in ends:
            cut.append(current)
            current = []
    return cut + ([current] if current else [])


def race_shared_in_place(
    stitched: CompiledProgram, orchestrated: CompiledProgram, plan: Orchestration
) -> tuple[CompiledProgram, Orchestration]:
    """The orchestrated program checked where it runs (``race_in_place``): each kernel that
    computes several primitives against those primitives' own kernels (from ``stitched``), then
    every kernel's implementations. The plan loses the shared kernels taken apart; ``figures``
    counts them (``apart_in_place``)."""
    apart = {
        k.output: [
            [s for s in stitched.steps if s.kernel.output in k.primitives and s.kernel.output not in stitched.constants]
        ]
        for k in plan.shared
    }
    orchestrated = replace(orchestrated, constants=dict(orchestrated.constants), buffers={})
    raced = race_in_place(race_in_place(orchestrated, apart))  # then the put-back kernels' implementations
    before = {s.kernel.output: s.kernel.expr for s in orchestrated.steps}
    after = {s.kernel.output: s.kernel.expr for s in raced.steps}
    separated = {n for n in before if after.get(n, before[n]) != before[n]} & set(apart)
    plan = replace(plan, shared=[k for k in plan.shared if k.output not in separated])
    plan.figures["apart_in_place"] = len(separated)
    return raced.prepare(), plan
