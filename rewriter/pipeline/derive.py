"""``derive(expr)``: hybrid derivation (OLLIE Algorithm 2) to verified, measured programs.

Explorative rounds (``rewriter.search.explore``) reach states up to ``max_depth``; every state,
and the states guided steps reach from it (``guide``), is instantiated (``rewriter.lower``:
matched operators where the iterator mapping tables match, layout eOperators where a split or
merged dimension makes one match, eOperators elsewhere) into a candidate program. The identity
candidate, the whole expression as one eOperator, is always in the race. Extraction from the
e-graph adds the program that combines the cheapest form of every nested scope (``select``).

Each kept candidate is run on random inputs and compared with ``evaluate(expr)`` (``verify``);
a mismatch is dropped and logged in ``rejected``, never returned. The survivors are compiled by
the backend (``codegen.backend``), checked again, and measured; with a measuring backend,
extraction runs again with the measured kernel times, and the fastest few are timed again in
turns before the choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from codegen.backend import Backend, as_backend
from rewriter.ir import ExpressionError, Scope, tensor_shapes
from rewriter.lower import Candidate, Kernel, instantiate, postprocess
from rewriter.search import SearchStats, State, explore, fingerprint, registered

from .guide import Guide, guided, lightened
from .select import Extraction, admitted, diverse, key, oversized
from .verify import FULL_CHECK_TERMS, Check, explain, terms


@dataclass
class Derivation:
    expr: Scope
    candidates: list  # the backend's programs, best first
    stats: SearchStats
    rejected: list[str] = field(default_factory=list)  # candidates that failed verification

    @property
    def best(self):
        return self.candidates[0]

    def explain(self, candidate) -> str:
        """The rule path that produced the candidate (Figure 6 style), then its kernels."""
        return explain(self.expr, candidate)


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
    backend: str | Backend = "cpu",
) -> Derivation:
    """Candidate programs for ``expr``, best first, each verified against the reference.

    ``weights`` names the inputs that are model weights: kernels reading only them are marked for
    compile-time evaluation (post-processing, OLLIE 5.4). ``time_limit`` (seconds, 300 by default,
    None for no limit) bounds the whole derivation: 40% for the search, 20% for candidate
    generation, the rest for compiling and measuring (depth 7 on a convolution does not finish
    in minutes on a small machine). Past the limit only the identity and, if none agreed yet,
    one more candidate are still compiled, so a naive full-size kernel can overrun it.

    ``backend`` (a ``codegen.backend`` object, or its name) compiles and measures the verified
    candidates: ``"cpu"`` (the default, ``CpuBackend()``: BLAS for matched operators, TVM for
    the rest, timed on this machine) orders them by measured time, so ``best`` is the fastest;
    ``"reference"`` keeps the candidates as they are, ordered by the analytic stand-in.
    """
    if not isinstance(expr, Scope):
        raise ExpressionError(f"derive() takes a Scope, got {type(expr).__name__}")
    backend = as_backend(backend)
    started = time.perf_counter()
    # 40% of the time budget explores, guided steps and instantiation take the next 20%, and
    # compiling, measuring and extraction from the e-graph the rest (at full size a naive
    # kernel takes seconds to compile and time)
    exploration = explore(expr, max_depth, time_limit=time_limit and 0.4 * time_limit, max_states=max_states)
    deadline = None if time_limit is None else started + time_limit
    candidates_until = None if time_limit is None else started + 0.6 * time_limit
    identity = Candidate([Kernel("eop", "out", expr)])
    as_given = postprocess(instantiate(expr), weights)  # the input's own scopes, instantiated
    found = {key(as_given): as_given, key(identity): identity}  # equal keys: the identity stays
    guide = Guide(registered("guided"), registered("explorative"), registered("eager"))
    seen = {state.fingerprint for state in exploration.states}
    extraction = Extraction(exploration.graph, expr, weights) if exploration.graph is not None else None
    try:
        for state in exploration.states:
            if candidates_until is not None and time.perf_counter() > candidates_until:
                exploration.stats.stop_reason = "time"
                break
            for derived in [state, *guided(state, guide, seen, guided_depth)]:
                candidate = admitted(postprocess(instantiate(derived.expr), weights), identity, expr)
                if candidate is not None:
                    candidate.source = derived
                    found.setdefault(key(candidate), candidate)
        extracted = extraction and extraction.best(deadline)
        if extracted and (candidate := admitted(extracted, identity, expr)):
            found.setdefault(key(candidate), candidate)
    except KeyboardInterrupt:  # Ctrl-C: what was found so far is still verified and returned
        exploration.stats.stop_reason = "interrupted"
    ranked = diverse(sorted(found.values(), key=lambda c: c.cost))
    for candidate in ranked[:keep]:  # the best again: lighter eOperators, operands re-laid out for larger GEMMs
        source = State(expr, (), fingerprint(expr)) if candidate is as_given else candidate.source
        if source is None:
            continue
        lighter = lightened(source, guide)
        for state, relayout in ((source, True), (lighter, False), (lighter, True)):
            again = state and admitted(postprocess(instantiate(state.expr, relayout=relayout), weights), identity, expr)
            if again and key(again) not in found:
                again.source = state
                found[key(again)] = again
    ranked = diverse(sorted(found.values(), key=lambda c: c.cost))
    rng = np.random.default_rng(seed)
    inputs = {name: rng.uniform(-1, 1, shape) for name, shape in tensor_shapes(expr).items()}
    check = Check(expr, inputs, rtol, sampled=terms(expr) > FULL_CHECK_TERMS, rng=rng)
    verified = []
    for candidate in ranked:
        if len(verified) >= keep and candidate is not identity:
            continue
        if check.sampled or check.reference(candidate):  # sampled: the compiled program is checked
            verified.append(candidate)
    verified.sort(key=lambda c: c.cost)
    programs = _measured(backend, check, verified, extraction if backend.measures else None, deadline, identity)
    return Derivation(expr, programs, exploration.stats, check.rejected)


# Rounds of lazy measurement: extract with what is measured, compile and measure what was
# chosen, extract again; stop when extraction chooses a program already measured.
EXTRACTION_ROUNDS = 3
# The fastest few compiled programs have their kernels timed again, in turns, before the
# choice: their first timings were taken at different times (``Backend.remeasure``).
RACE = 3


def _measured(backend: Backend, check: Check, candidates: list[Candidate], extraction, deadline, identity) -> list:
    """Each candidate compiled by ``backend``, run and checked against the reference again, and
    measured; the result is ordered by cost. A compiled program that disagrees is dropped and
    its rule path logged in ``rejected``. Past the ``deadline`` a measuring backend compiles only
    the ``identity`` (the never-slower fallback) and, if none agreed yet, the next candidate by
    analytic cost: at full size one naive kernel takes seconds to compile and time. Then
    extraction from the e-graph with the measured kernel times (``Extraction``; None: the
    backend measures nothing) may choose a program not yet among them: it is verified, compiled
    and measured in turn, up to ``EXTRACTION_ROUNDS`` times while the time budget lasts. Last,
    the ``RACE`` fastest have their kernels timed again in turns, and their new timings order
    them."""
    shapes = {name: value.shape for name, value in check.inputs.items()}
    compiled, measured = [], set()

    def add(candidate: Candidate) -> None:
        measured.add(key(candidate))
        program = backend.compile(candidate, shapes)
        if check.compiled(candidate, program, backend.tolerance):
            backend.measure(program)
            compiled.append(program)
            if extraction is not None:
                extraction.learn(program)

    for candidate in candidates:
        late = backend.measures and deadline is not None and time.perf_counter() > deadline
        if late and compiled and candidate is not identity:
            continue
        add(candidate)
    if not compiled:  # the identity compiles to one generated kernel: this is a code generation bug
        raise RuntimeError(
            f"no compiled program for {check.expr} agrees with the reference:\n" + "\n".join(check.rejected)
        )
    for _ in range(EXTRACTION_ROUNDS if extraction is not None else 0):
        if deadline is not None and time.perf_counter() > deadline:
            break
        candidate = extraction.best(deadline)
        if candidate is None or key(candidate) in measured or oversized(candidate.kernels, check.expr):
            break
        if check.sampled or check.reference(candidate):
            add(candidate)
        else:
            measured.add(key(candidate))
    raced = []
    for _ in range(2):  # a second time if the first race let an unraced program into the front
        compiled.sort(key=lambda p: p.cost)
        front = compiled[:RACE]
        if len(front) < 2 or all(any(p is r for r in raced) for p in front):
            break
        if deadline is not None and time.perf_counter() > deadline:
            break
        backend.remeasure(front)
        raced += front
    compiled.sort(key=lambda p: p.cost)
    return compiled
