"""``derive(expr)``: hybrid derivation (OLLIE Algorithm 2) to verified, compiled programs.

Explorative rounds (``explore``) reach states up to ``max_depth``; every state is instantiated
(``instantiate``: matched operators where the iterator mapping tables match, with layout
eOperators where a split dimension makes one match, eOperators elsewhere) into a candidate
program. The identity candidate, the whole expression as one eOperator, is always in the race.
Each kept candidate is run on random inputs and compared with ``evaluate(expr)``; a mismatch is
dropped and logged in ``rejected``, never returned. With the cpu backend the survivors are
compiled (``codegen.program``), checked again and ranked by measured time; with the reference
backend by the analytic stand-in ``Candidate.cost``. Above ``FULL_CHECK_TERMS`` the reference is
evaluated on a few boxes of the output only, and the compiled programs are checked there.

Extraction from the e-graph (``rewriter.extract``) adds the program that combines the cheapest
form of every nested scope; with the cpu backend it runs again with the measured kernel times
(lazy measurement: what it picks is compiled and measured, then it runs again).

Guided derivation (section 5.2): the guided rules (operator layout, iterator merging) are applied
to every scope that has an operator's shape but matches no table yet, up to ``guided_depth``
steps, free of ``max_depth``. The best candidates are instantiated again with operands
re-laid out for larger GEMMs, and with their summing eOperators made lighter: each replaced by
the explorative rule result that sums over fewest points (an OffsetAdd over every input
position tightened to the taps that meet the kernel), also free of ``max_depth``.
Post-processing (5.4) drops identity eOperators, fuses an eOperator into its only (eOperator)
reader (with the cpu backend: where the fused kernel measures faster), and marks weight-only
kernels.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .dsl import registered
from .errors import ExpressionError
from .extract import extract
from .fingerprint import fingerprint
from .instantiate import Candidate, Kernel, instantiate, match_operator, postprocess, rename_tensor, wants_operator
from .indexing import index_bounds
from .ir import Access, Iterator, Program, Scope, Tensor, map_accesses, nested_scopes, rename_tensors, tensor_shapes
from .reference import evaluate
from .search import SearchStats, State, Step, eager_closure, explore, replace_at, scopes_at


@dataclass
class Derivation:
    expr: Scope
    candidates: list[Candidate]
    stats: SearchStats
    rejected: list[str] = field(default_factory=list)  # candidates that failed verification

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def explain(self, candidate: Candidate) -> str:
        """The rule path that produced the candidate (Figure 6 style), then its kernels."""
        path = candidate.source.explain(self.expr) if candidate.source is not None else f"E1 = {self.expr}"
        return f"{path}\nkernels:\n" + "\n".join(f"  {k}" for k in candidate.kernels)


def derive(
    expr: Scope,
    max_depth: int = 7,
    *,
    time_limit: float | None = 300.0,
    max_states: int | None = 200_000,
    keep: int = 8,
    weights=(),
    seed: int = 0,
    rtol: float = 1e-6,
    guided_depth: int = 1,
    backend: str = "cpu",
    dtype: str = "float32",
    db=None,
    tune: int = 0,
) -> Derivation:
    """Candidate programs for ``expr``, best first, each verified against the reference.

    ``weights`` names the inputs that are model weights: kernels reading only them are marked for
    compile-time evaluation (post-processing, OLLIE 5.4). ``time_limit`` (seconds, 300 by default,
    None for no limit) bounds the whole derivation: 40% for the search, 20% for candidate
    generation, the rest for compiling and measuring (depth 7 on a convolution does not finish
    in minutes on a small machine). Past the limit only the identity and, if none agreed yet,
    one more candidate are still compiled, so a naive full-size kernel can overrun it.

    ``backend="cpu"`` (the default) compiles the verified candidates (BLAS for matched Matmuls,
    TVM for the rest, ``codegen.program``), checks each compiled program against the reference
    again, measures it (``db``: a ``codegen.measure.MeasurementDB``, default in the user cache)
    and orders them by measured time: ``best`` is the fastest. ``tune`` (off by default) races up
    to that many TVM schedules per generated kernel. ``backend="reference"`` keeps the
    reference-executed candidates ordered by the analytic stand-in (``Kernel.cost``).
    """
    if not isinstance(expr, Scope):
        raise ExpressionError(f"derive() takes a Scope, got {type(expr).__name__}")
    if backend not in ("cpu", "reference"):
        raise ExpressionError(f"derive(): unknown backend {backend!r} (use 'cpu' or 'reference')")
    started = time.perf_counter()
    # 40% of the time budget explores, guided steps and instantiation take the next 20%, and
    # compiling, measuring and extraction from the e-graph the rest (at full size a naive
    # kernel takes seconds to compile and time)
    exploration = explore(expr, max_depth, time_limit=time_limit and 0.4 * time_limit, max_states=max_states)
    deadline = None if time_limit is None else started + time_limit
    candidates_until = None if time_limit is None else started + 0.6 * time_limit
    identity = Candidate([Kernel("eop", "out", expr)])
    as_given = postprocess(instantiate(expr), weights)  # the input's own scopes, instantiated
    found = {_key(as_given): as_given, _key(identity): identity}  # equal keys: the identity stays
    guide = _Guide(registered("guided"), registered("explorative"), registered("eager"))
    seen = {state.fingerprint for state in exploration.states}
    extraction = _Extraction(exploration.graph, expr, weights) if exploration.graph is not None else None
    try:
        for state in exploration.states:
            if candidates_until is not None and time.perf_counter() > candidates_until:
                exploration.stats.stop_reason = "time"
                break
            for derived in [state, *_guided(state, guide, seen, guided_depth)]:
                candidate = _admitted(postprocess(instantiate(derived.expr), weights), identity, expr)
                if candidate is not None:
                    candidate.source = derived
                    found.setdefault(_key(candidate), candidate)
        extracted = extraction and extraction.best(deadline)
        if extracted and (candidate := _admitted(extracted, identity, expr)):
            found.setdefault(_key(candidate), candidate)
    except KeyboardInterrupt:  # Ctrl-C: what was found so far is still verified and returned
        exploration.stats.stop_reason = "interrupted"
    ranked = _diverse(sorted(found.values(), key=lambda c: c.cost))
    for candidate in ranked[:keep]:  # the best again: lighter eOperators, operands re-laid out for larger GEMMs
        source = State(expr, (), fingerprint(expr)) if candidate is as_given else candidate.source
        if source is None:
            continue
        lighter = _lightened(source, guide)
        for state, relayout in ((source, True), (lighter, False), (lighter, True)):
            again = state and _admitted(postprocess(instantiate(state.expr, relayout=relayout), weights), identity, expr)
            if again and _key(again) not in found:
                again.source = state
                found[_key(again)] = again
    ranked = _diverse(sorted(found.values(), key=lambda c: c.cost))
    rng = np.random.default_rng(seed)
    inputs = {name: rng.uniform(-1, 1, shape) for name, shape in tensor_shapes(expr).items()}
    check = _Check(expr, inputs, exploration.stats, rtol, sampled=backend == "cpu" and _terms(expr) > FULL_CHECK_TERMS, rng=rng)
    verified = []
    for candidate in ranked:
        if len(verified) >= keep and candidate is not identity:
            continue
        if check.sampled or check.reference(candidate):  # sampled: the compiled program is checked
            verified.append(candidate)
    verified.sort(key=lambda c: c.cost)
    if backend == "cpu":
        verified = _compiled(check, verified, dtype, db, tune, extraction, deadline, identity)
    return Derivation(expr, verified, exploration.stats, check.rejected)


def _admitted(candidate: Candidate, identity: Candidate, expr: Scope) -> Candidate | None:
    """``candidate`` if it is worth verifying: not the identity re-indexed with no less work
    (codegen's business), and without oversized temporaries."""
    if [k.kind for k in candidate.kernels] == ["eop"] and candidate.cost >= identity.cost:
        return None
    if _oversized(candidate.kernels, expr):
        return None
    if candidate.unfused and _oversized(candidate.unfused, expr):
        candidate.unfused = None  # only the fused form stays within memory
    return candidate


# Above this many scalar terms (iterations of the expression's scopes), the reference is
# evaluated on a few boxes of the output, not the whole: a naive full-size ConvTranspose sums
# over every input position for every output and takes hours in numpy.
FULL_CHECK_TERMS = 1e9
SAMPLE_POINTS = 256  # output points per sampled box


def _terms(expr: Scope) -> int:
    return sum(math.prod(it.size for it in s.iterators) for s in (expr, *nested_scopes(expr)))


class _Check:
    """Verification against the reference values of ``expr`` on ``inputs``; what disagrees is
    logged (its rule path) in ``rejected``. ``sampled``: the reference is evaluated on four
    boxes of the output only (the low corner, the high corner and two random ones, where
    padding and boundary errors show), and candidates are checked there."""

    def __init__(self, expr: Scope, inputs: dict, stats: SearchStats, rtol: float, sampled: bool = False, rng=None):
        self.expr, self.inputs, self.stats, self.rtol, self.sampled = expr, inputs, stats, rtol, sampled
        self.rejected: list[str] = []
        boxes = _boxes(expr, rng or np.random.default_rng(0)) if sampled else [tuple(slice(None) for _ in expr.traversal)]
        self.expected = [(box, evaluate(_restricted(expr, box), inputs)) for box in boxes]

    def reference(self, candidate: Candidate) -> bool:
        return self._agrees(candidate, candidate(**self.inputs), self.rtol, "")

    def compiled(self, candidate: Candidate, program, tolerance: float) -> bool:
        return self._agrees(candidate, program(**self.inputs), tolerance, "compiled program disagrees with the reference:\n")

    def _agrees(self, candidate: Candidate, got: np.ndarray, tolerance: float, why: str) -> bool:
        if got.shape == self.expr.shape and all(_agrees(got[box], want, tolerance) for box, want in self.expected):
            return True
        self.rejected.append(why + Derivation(self.expr, [candidate], self.stats).explain(candidate))
        return False


def _boxes(expr: Scope, rng) -> list[tuple[slice, ...]]:
    side = max(1, int(SAMPLE_POINTS ** (1 / max(1, len(expr.traversal)))))
    sizes = [min(side, it.size) for it in expr.traversal]
    starts = [[0] * len(sizes), [it.size - size for it, size in zip(expr.traversal, sizes)]]  # the two corners
    starts += [[int(rng.integers(0, it.size - size + 1)) for it, size in zip(expr.traversal, sizes)] for _ in range(2)]
    unique = dict.fromkeys(tuple(corner) for corner in starts)
    return [tuple(slice(start, start + size) for start, size in zip(corner, sizes)) for corner in unique]


def _restricted(expr: Scope, box: tuple[slice, ...]) -> Scope:
    """``expr`` over the part ``box`` (offsets from the low corner) of its output, its nested
    scopes narrowed to what that part reads of them."""
    traversal = tuple(
        Iterator(it.name, it.lo + (b.start or 0), it.lo + (b.stop if b.stop is not None else it.size)) for it, b in zip(expr.traversal, box)
    )
    return _narrowed(Scope(traversal, expr.summation, expr.body, expr.reduce))


def _narrowed(scope: Scope) -> Scope:
    """``scope`` with each nested scope it reads cut to the hull of the indices read (outside
    it, a read of a scope is 0: the values read do not change)."""
    box = {it.name: (it.lo, it.hi) for it in scope.iterators}

    def read(access: Access) -> Access:
        inner = access.source
        if not isinstance(inner, Scope):
            return access
        traversal = []
        for ix, it in zip(access.indices, inner.traversal):
            lo, hi = index_bounds(ix, box)
            lo, hi = max(lo, it.lo), min(hi + 1, it.hi)
            traversal.append(Iterator(it.name, lo, hi) if lo < hi else Iterator(it.name, it.lo, it.lo + 1))
        return Access(_narrowed(Scope(tuple(traversal), inner.summation, inner.body, inner.reduce)), access.indices)

    return Scope(scope.traversal, scope.summation, map_accesses(scope.body, read), scope.reduce)


# Rounds of lazy measurement: extract with what is measured, compile and measure what was
# chosen, extract again; stop when extraction chooses a program already measured.
EXTRACTION_ROUNDS = 3
# The fastest few compiled programs have their kernels timed again, in turns, before the
# choice: their first timings were taken at different times (``codegen.program.remeasure``).
RACE = 3


def _compiled(check: _Check, candidates: list[Candidate], dtype: str, db, tune: int, extraction, deadline, identity):
    """Each candidate compiled for this CPU, run and checked against the reference again (in
    ``dtype``), and measured; the result is ordered by measured time. A compiled program that
    disagrees is dropped and its rule path logged in ``rejected``. Past the ``deadline`` only
    the ``identity`` (the never-slower fallback) and, if none agreed yet, the next candidate
    by analytic cost are still compiled: at full size one naive kernel takes seconds to
    compile and time. Then extraction from the e-graph with the measured kernel times
    (``_Extraction``) may choose a program not yet among them: it is verified, compiled and
    measured in turn, up to ``EXTRACTION_ROUNDS`` times while the time budget lasts. Last, the
    ``RACE`` fastest have their kernels timed again in turns (``remeasure``), and their new
    timings order them."""
    from codegen.measure import MeasurementDB
    from codegen.program import compile_candidate, remeasure

    db = db if db is not None else MeasurementDB()
    shapes = {name: value.shape for name, value in check.inputs.items()}
    tolerance = 1e-6 if np.dtype(dtype) == np.float64 else 1e-3
    compiled, measured = [], set()

    def add(candidate: Candidate) -> None:
        measured.add(_key(candidate))
        program = compile_candidate(candidate, shapes, dtype, db, tune)
        if check.compiled(candidate, program, tolerance):
            program.measure(db)
            compiled.append(program)
            if extraction is not None:
                extraction.learn(program)

    for candidate in candidates:
        late = deadline is not None and time.perf_counter() > deadline
        if late and compiled and candidate is not identity:
            continue
        add(candidate)
    if not compiled:  # the identity compiles to one TVM kernel: this is a code generation bug
        raise RuntimeError(f"no compiled program for {check.expr} agrees with the reference:\n" + "\n".join(check.rejected))
    for _ in range(EXTRACTION_ROUNDS if extraction is not None else 0):
        if deadline is not None and time.perf_counter() > deadline:
            break
        candidate = extraction.best(deadline)
        if candidate is None or _key(candidate) in measured or _oversized(candidate.kernels, check.expr):
            break
        if check.sampled or check.reference(candidate):
            add(candidate)
        else:
            measured.add(_key(candidate))
    raced = []
    for _ in range(2):  # a second time if the first race let an unraced program into the front
        compiled.sort(key=lambda p: p.cost)
        front = compiled[:RACE]
        if len(front) < 2 or all(any(p is r for r in raced) for p in front):
            break
        if deadline is not None and time.perf_counter() > deadline:
            break
        remeasure(front, db, max_seconds=0.5)
        raced += front
    compiled.sort(key=lambda p: p.cost)
    return compiled


@dataclass
class _Extracted:
    """The source of a candidate extracted from the e-graph (no single search state holds it)."""

    expr: Scope

    def explain(self, root: Scope) -> str:
        return f"E1 = {root}\n  extracted from the e-graph (forms of several states combined)\nE2 = {self.expr}"


class _Extraction:
    """Extraction from the e-graph (``rewriter.extract``) by kernel costs: measured seconds
    where codegen measured the kernel, else the analytic stand-in scaled by the ratio of
    measured to analytic time of the kernels of that kind measured so far. Weight-only kernels
    run once at build time and cost nothing."""

    def __init__(self, graph, expr: Scope, weights):
        self.graph, self.expr, self.weights = graph, expr, frozenset(weights)
        self.programs: dict[tuple, Candidate] = {}
        self.seconds: dict[tuple, float] = {}  # kernel signature -> measured seconds
        self.ratios: dict[str, list[float]] = {}  # kind -> measured / analytic
        self.signatures: dict[Scope, tuple] = {}

    def cost(self, own: Scope, constants: frozenset = frozenset()) -> float:
        key = (own, constants)
        if key not in self.programs:
            self.programs[key] = postprocess(instantiate(own), self.weights | constants)
        program = self.programs[key]
        forms = [program.kernels] + ([program.unfused] if program.unfused else [])
        return min(sum(self._seconds(k) for k in kernels if not k.weight_only) for kernels in forms)

    def _signature(self, kernel: Kernel) -> tuple:
        """The kernel up to tensor names (a temporary's name is an accident of numbering)."""
        if kernel.expr not in self.signatures:
            names = {name: f"t{'x'.join(map(str, shape))}" for name, shape in tensor_shapes(kernel.expr).items()}
            self.signatures[kernel.expr] = (kernel.kind, fingerprint(rename_tensors(kernel.expr, names)))
        return self.signatures[kernel.expr]

    def _seconds(self, kernel: Kernel) -> float:
        if self.seconds:
            measured = self.seconds.get(self._signature(kernel))
            if measured is not None:
                return measured
        ratios = self.ratios.get(kernel.kind) or [r for rs in self.ratios.values() for r in rs] or [1.0]
        return kernel.cost * float(np.median(ratios))

    def learn(self, program) -> None:
        """The measured time of each kernel of a compiled ``program``."""
        for step in program.steps:
            if step.seconds is not None and not step.kernel.weight_only:
                self.seconds[self._signature(step.kernel)] = step.seconds
                self.ratios.setdefault(step.kernel.kind, []).append(step.seconds / step.kernel.cost)

    def best(self, deadline: float | None) -> Candidate | None:
        try:
            result = extract(self.graph, self.expr, self.cost, self.weights, deadline)
        except ExpressionError:
            return None
        if result is None:
            return None
        scope, _ = result
        program = postprocess(instantiate(scope), self.weights)
        return Candidate(list(program.kernels), _Extracted(scope), program.unfused)


def _scale(expected: np.ndarray) -> float:
    """The tolerance scale: the largest magnitude, NaN ignored."""
    return max(1.0, float(np.nanmax(np.abs(expected), initial=0.0)))


def _agrees(got: np.ndarray, expected: np.ndarray, tolerance: float) -> bool:
    """Equal within ``tolerance`` (relative to the scale) wherever the reference is defined: a
    NaN there (sqrt of a negative random input) is outside the expression's domain, where
    compiled code may legitimately differ (TVM's relu(NaN) is 0)."""
    if got.shape != expected.shape:
        return False
    defined = ~np.isnan(expected)
    scale = _scale(expected)
    return bool(np.allclose(got[defined], expected[defined], rtol=tolerance, atol=tolerance * scale))


# A candidate may not build a temporary more than this many times the largest tensor the
# expression reads or writes (partial sums kept per summed channel can be 64x the output).
INTERMEDIATE_FACTOR = 8


def _oversized(kernels: list[Kernel], expr: Scope) -> bool:
    """Whether a kernel's output or a stage inside it (a nested scope, materialised) is over
    ``INTERMEDIATE_FACTOR`` times the largest tensor of ``expr``."""
    largest = max([math.prod(expr.shape), *(math.prod(s) for s in tensor_shapes(expr).values())])
    scopes = [scope for k in kernels for scope in (k.expr, *nested_scopes(k.expr))]
    return any(math.prod(scope.shape) > INTERMEDIATE_FACTOR * largest for scope in scopes)


def _diverse(ranked: list[Candidate]) -> list[Candidate]:
    """The cheapest candidate of each kernel-kind sequence first, then the rest, each by cost:
    the analytic stand-in must not crowd out a structure that measurement may prefer."""
    firsts, seen = [], set()
    for candidate in ranked:
        structure = tuple(_structure(k) for k in candidate.kernels)
        if structure not in seen:
            seen.add(structure)
            firsts.append(candidate)
    return firsts + [c for c in ranked if c not in firsts]


def _structure(kernel: Kernel) -> tuple:
    """A kernel's kind and its operator's parameters (a convolution's kernel extent and
    dilation, a band matmul's dilation): a dilated and a plain convolution are different
    structures, two layouts of the same eOperator are not."""
    match = kernel.match
    if kernel.kind == "conv2d":
        sizes = {it.name: it.size for it in kernel.expr.iterators}
        return kernel.kind, tuple((sizes[r], dilation) for _, r, _, dilation in match.spatial)
    if kernel.kind in ("g2bmm", "gbmm"):
        return kernel.kind, match.dilation
    return (kernel.kind,)


def _key(candidate: Candidate) -> tuple:
    """Candidates equal up to iterator names are one candidate."""
    return tuple((k.kind, k.output, fingerprint(k.expr)) for k in candidate.kernels)


@dataclass
class _Guide:
    """What guided derivation (OLLIE 5.2) proposes for one scope, memoised (states share most
    of their scopes): the guided rules' results where the scope has an operator's shape but
    matches no operator table yet (``proposals``), and the explorative rule result that makes
    a summing eOperator sum over the fewest points (``lighter``)."""

    guided: list
    explorative: list
    eager: list
    memo: dict = field(default_factory=dict)  # eager rule results per scope
    proposed: dict = field(default_factory=dict)
    lightest: dict = field(default_factory=dict)

    def proposals(self, scope: Scope) -> list:
        if scope not in self.proposed:
            self.proposed[scope] = [(r, x) for r in self.guided for x in r.apply(scope)] if wants_operator(scope) else []
        return self.proposed[scope]

    def lighter(self, scope: Scope) -> tuple | None:
        if scope not in self.lightest:
            found = []
            if scope.summation and match_operator(scope)[0] == "eop":
                found = [(_terms(x), k, r, x) for r in self.explorative for k, x in enumerate(r.apply(scope))]
            best = min(found, default=None, key=lambda f: f[:2])
            self.lightest[scope] = best[2:] if best and best[0] < _terms(scope) else None
        return self.lightest[scope]


def _lightened(source, guide: _Guide, steps: int = 8):
    """``source`` (a search state or an extracted form) with each scope that will be a summing
    eOperator replaced, one at a time, by the explorative rule result that sums over fewest
    points, while one gets lighter (at most ``steps`` times); None when none does. A guided
    step: an OffsetAdd tightened to the taps that meet the kernel pays for itself whatever
    path reached it, so it does not wait for a depth that path has used up."""
    expr, path = source.expr, ()
    for _ in range(steps):
        found = next(((at, lighter) for at, scope in scopes_at(expr) if (lighter := guide.lighter(scope))), None)
        if found is None:
            break
        position, (rule_, result) = found
        step = replace_at(expr, position, result)
        expr, eager_steps = eager_closure(step, guide.eager, guide.memo)
        path += (Step(rule_.name, "guided", position, step), *eager_steps)
    if not path:
        return None
    return State(expr, source.path + path, fingerprint(expr)) if isinstance(source, State) else _Extracted(expr)


def _guided(state: State, guide: _Guide, seen: set, depth: int) -> list[State]:
    """Guided derivation (OLLIE 5.2): from ``state``, up to ``depth`` guided steps, each applied
    only to scopes that have an operator's shape but match no operator table yet. Guided steps
    do not count against ``max_depth``; states already seen are not walked again."""
    found, frontier = [], [state]
    for _ in range(depth):
        frontier = [s for s in _guided_steps(frontier, guide) if s.fingerprint not in seen]
        seen.update(s.fingerprint for s in frontier)
        found += frontier
    return found


def _guided_steps(states: list[State], guide: _Guide) -> list[State]:
    results = []
    for state in states:
        for position, scope in scopes_at(state.expr):
            for rule_, result in guide.proposals(scope):
                expr = replace_at(state.expr, position, result)
                closed, eager_steps = eager_closure(expr, guide.eager, guide.memo)
                path = state.path + (Step(rule_.name, "guided", position, expr), *eager_steps)
                results.append(State(closed, path, fingerprint(closed)))
    return results


@dataclass
class ProgramDerivation:
    program: Program
    candidates: list[Candidate]  # each runs the whole program; outputs come back as a tuple
    rejected: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]


def derive_program(program: Program, max_depth: int = 2, *, time_limit: float | None = None, seed: int = 0) -> ProgramDerivation:
    """OLLIE Algorithm 1 in small: apply the inter-expression rules (merging, fusion) to the
    program, derive every definition of every variant, stitch the best pieces, verify.
    """
    if not isinstance(program, Program):
        raise ExpressionError(f"derive_program() takes a Program, got {type(program).__name__}")
    variants = {str(program): program}
    for rule_ in registered("inter"):
        for variant in rule_.apply(program):
            variants.setdefault(str(variant), variant)
    rng = np.random.default_rng(seed)
    inputs = {name: rng.uniform(-1, 1, shape) for name, shape in program.inputs.items()}
    expected = _as_tuple(evaluate(program, inputs))
    verified, rejected = [], []
    for variant in variants.values():
        kernels = []
        for name, scope in variant.definitions:
            best = derive(scope, max_depth, time_limit=time_limit, keep=1, backend="reference").best
            kernels.extend(_renamed(best.kernels, name))
        candidate = ProgramCandidate(kernels, variant.outputs)
        got = _as_tuple(candidate(**inputs))
        if all(_agrees(g, e, 1e-6) for g, e in zip(got, expected)):
            verified.append(candidate)
        else:
            rejected.append(str(variant))
    verified.sort(key=lambda c: c.cost)
    return ProgramDerivation(program, verified, rejected)


class ProgramCandidate(Candidate):
    """A candidate for a whole program: kernels named after the definitions they compute."""

    def __init__(self, kernels, outputs):
        super().__init__(kernels)
        self.outputs = tuple(outputs)

    def __call__(self, **inputs):
        values = dict(inputs)
        for kernel in self.kernels:
            values[kernel.output] = Candidate([kernel])(**{n: values[n] for n in tensor_shapes(kernel.expr)})
        outs = tuple(values[name] for name in self.outputs)
        return outs[0] if len(outs) == 1 else outs


def _renamed(kernels: list[Kernel], name: str) -> list[Kernel]:
    """A definition's kernels with its temporaries prefixed and its result named ``name``."""
    mapping = {k.output: (name if k.output == "out" else f"{name}_{k.output}") for k in kernels}
    result = []
    for kernel in kernels:
        expr = kernel.expr
        for old, new in mapping.items():
            if old in tensor_shapes(expr):
                expr = rename_tensor(expr, old, Tensor(new, tensor_shapes(expr)[old]))
        renamed = kernel.with_expr(expr)
        result.append(Kernel(renamed.kind, mapping[kernel.output], expr, renamed.match, renamed.weight_only))
    return result


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
