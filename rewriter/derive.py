"""``derive(expr)``: hybrid derivation (OLLIE Algorithm 2) to verified, compiled programs.

Explorative rounds (``explore``) reach states up to ``max_depth``; every state is instantiated
(``instantiate``: matched operators where the iterator mapping tables match, with layout
eOperators where a split dimension makes one match, eOperators elsewhere) into a candidate
program. The identity candidate, the whole expression as one eOperator, is always in the race.
Each kept candidate is run on random inputs and compared with ``evaluate(expr)``; a mismatch is
dropped and logged in ``rejected``, never returned. With the cpu backend the survivors are
compiled (``codegen.program``), checked again and ranked by measured time; with the reference
backend by the analytic stand-in ``Candidate.cost``.

Guided derivation (section 5.2): the guided rules (operator layout, iterator merging) are applied
to every scope that has an operator's shape but matches no table yet, up to ``guided_depth``
steps, free of ``max_depth``. Post-processing (5.4) drops identity eOperators, fuses an
eOperator into its only (eOperator) reader (with the cpu backend: where the fused kernel
measures faster), and marks weight-only kernels.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .dsl import registered
from .errors import ExpressionError
from .fingerprint import fingerprint
from .instantiate import Candidate, Kernel, instantiate, postprocess, rename_tensor, wants_operator
from .ir import Program, Scope, Tensor, nested_scopes, tensor_shapes
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
    None for no limit) bounds the search and the candidate generation (half each): depth 7 on a
    convolution does not finish in minutes on a small machine. Verification of the kept
    candidates follows.

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
    # half the time budget explores; guided steps and instantiation stop at the deadline
    exploration = explore(expr, max_depth, time_limit=time_limit and time_limit / 2, max_states=max_states)
    deadline = None if time_limit is None else started + time_limit
    identity = Candidate([Kernel("eop", "out", expr)])
    as_given = postprocess(instantiate(expr), weights)  # the input's own scopes, instantiated
    found = {_key(as_given): as_given, _key(identity): identity}  # equal keys: the identity stays
    guided = registered("guided")
    memo: dict = {}  # eager rule results per scope, shared by every guided step
    eager = registered("eager")
    seen = {state.fingerprint for state in exploration.states}
    try:
        for state in exploration.states:
            if deadline is not None and time.perf_counter() > deadline:
                exploration.stats.stop_reason = "time"
                break
            for derived in [state, *_guided(state, guided, eager, memo, seen, guided_depth)]:
                candidate = postprocess(instantiate(derived.expr), weights)
                if [k.kind for k in candidate.kernels] == ["eop"] and candidate.cost >= identity.cost:
                    continue  # the identity re-indexed, no less work: codegen's business
                if _oversized(candidate.kernels, expr):
                    continue
                if candidate.unfused and _oversized(candidate.unfused, expr):
                    candidate.unfused = None  # only the fused form stays within memory
                candidate.source = derived
                found.setdefault(_key(candidate), candidate)
    except KeyboardInterrupt:  # Ctrl-C: what was found so far is still verified and returned
        exploration.stats.stop_reason = "interrupted"
    ranked = _diverse(sorted(found.values(), key=lambda c: c.cost))
    rng = np.random.default_rng(seed)
    inputs = {name: rng.uniform(-1, 1, shape) for name, shape in tensor_shapes(expr).items()}
    expected = evaluate(expr, inputs)
    verified, rejected = [], []
    for candidate in ranked:
        if len(verified) >= keep and candidate is not identity:
            continue
        got = candidate(**inputs)
        if _agrees(got, expected, rtol):
            verified.append(candidate)
        else:
            rejected.append(Derivation(expr, [candidate], exploration.stats).explain(candidate))
    verified.sort(key=lambda c: c.cost)
    if backend == "cpu":
        verified = _compiled(expr, verified, inputs, expected, rejected, dtype, db, tune)
    return Derivation(expr, verified, exploration.stats, rejected)


def _compiled(expr: Scope, candidates: list[Candidate], inputs: dict, expected: np.ndarray, rejected: list, dtype: str, db, tune: int):
    """Each candidate compiled for this CPU, run and checked against the reference again (in
    ``dtype``), and measured; the result is ordered by measured time. A compiled program that
    disagrees is dropped and its rule path logged in ``rejected``."""
    from codegen.measure import MeasurementDB
    from codegen.program import compile_candidate

    db = db if db is not None else MeasurementDB()
    shapes = {name: value.shape for name, value in inputs.items()}
    tolerance = 1e-6 if np.dtype(dtype) == np.float64 else 1e-3
    compiled = []
    for candidate in candidates:
        program = compile_candidate(candidate, shapes, dtype, db, tune)
        got = program(**inputs)
        if _agrees(got, expected, tolerance):
            program.measure(db)
            compiled.append(program)
        else:
            rejected.append("compiled program disagrees with the reference:\n" + Derivation(expr, [candidate], None).explain(candidate))
    if not compiled:  # the identity compiles to one TVM kernel: this is a code generation bug
        raise RuntimeError(f"no compiled program for {expr} agrees with the reference:\n" + "\n".join(rejected))
    compiled.sort(key=lambda p: p.cost)
    return compiled


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


def _guided(state: State, guided, eager, memo: dict, seen: set, depth: int) -> list[State]:
    """Guided derivation (OLLIE 5.2): from ``state``, up to ``depth`` guided steps, each applied
    only to scopes that have an operator's shape but match no operator table yet. Guided steps
    do not count against ``max_depth``; states already seen are not walked again."""
    found, frontier = [], [state]
    for _ in range(depth):
        frontier = [s for s in _guided_steps(frontier, guided, eager, memo) if s.fingerprint not in seen]
        seen.update(s.fingerprint for s in frontier)
        found += frontier
    return found


def _guided_steps(states: list[State], guided, eager, memo: dict) -> list[State]:
    results = []
    for state in states:
        for position, scope in scopes_at(state.expr):
            if not wants_operator(scope):
                continue
            for rule_ in guided:
                for result in rule_.apply(scope):
                    expr = replace_at(state.expr, position, result)
                    closed, eager_steps = eager_closure(expr, eager, memo)
                    path = state.path + (Step(rule_.name, rule_.kind, position, expr), *eager_steps)
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
