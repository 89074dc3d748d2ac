"""``derive(expr)``: hybrid derivation (OLLIE Algorithm 2) to verified, measured programs.

The search runs level by level (``rewriter.search.explore_levels``): every new state, and the
states guided steps reach from it (``guide``), is instantiated (``rewriter.lower``: matched
operators where the iterator mapping tables match, layout eOperators where a split or merged
dimension makes one match, eOperators elsewhere) into a candidate program, and the best few found
so far are added again in lighter and re-laid-out forms (guided steps). Each level's ranking is
kept. After the levels, extraction from the e-graph combines the cheapest form of every nested
scope (``select``); then the best few candidates of the final ranking, and of each level's
ranking after it, are run on random inputs and compared with ``evaluate(expr)`` (``verify``), and
those that agree are compiled by the backend (``codegen.backend``), checked again and measured.
Checking waits for the search because it costs a candidate's run time: at full size a shallow
eOperator runs for seconds, and checking it before the next level is searched would spend the
budget of the product that level finds. A mismatch is dropped and logged in ``rejected``, never
returned. Without a time limit a deeper ``max_depth`` never loses what a shallower one verified:
each level's best few are checked. The identity candidate, the whole expression as one
eOperator, is always in the race.

Then extraction again with the measured kernel times; the fastest few are timed again in turns
before the choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from codegen.backend import Backend, as_backend
from rewriter.ir import ExpressionError, Scope, tensor_shapes
from rewriter.lower import Candidate, Kernel, instantiate, mark_weight_only, postprocess
from rewriter.search import SearchStats, State, explore_levels, fingerprint, registered

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
    None for no limit) bounds the whole derivation: the levels (search and candidates) stop at
    60% of it (depth 7 on a convolution does not finish in minutes on a small machine), and the
    rest goes to extraction, checking and measuring the candidates, best first by the analytic
    cost, and the final race. A candidate whose analytic cost says its check and measurement
    would end past the limit is skipped, except the identity (the expression as one kernel, the
    fallback) and, if none agreed yet, one more candidate, so a naive full-size kernel can
    overrun it (a DCGAN's transposed convolution as written: 18.5 s a run, checked and timed
    once each).

    ``backend`` (a ``codegen.backend`` object, or its name) compiles and measures the verified
    candidates: ``"cpu"`` (the default, ``CpuBackend()``: BLAS for matched operators, TVM for
    the rest, timed on this machine) orders them by measured time, so ``best`` is the fastest;
    ``"reference"`` keeps the candidates as they are, ordered by the analytic stand-in.
    """
    if not isinstance(expr, Scope):
        raise ExpressionError(f"derive() takes a Scope, got {type(expr).__name__}")
    backend = as_backend(backend)
    started = time.perf_counter()
    # the levels (search and instantiation) take 60% of the time budget at most; checking,
    # measuring and the final race the rest (at full size a naive kernel takes seconds to
    # compile and time)
    deadline = None if time_limit is None else started + time_limit
    levels_until = None if time_limit is None else started + 0.6 * time_limit
    identity = Candidate(mark_weight_only([Kernel("eop", "out", expr)], weights))  # its weights timed cold
    as_given = postprocess(instantiate(expr), weights)  # the input's own scopes, instantiated
    found = {key(as_given): as_given, key(identity): identity}  # equal keys: the identity stays
    guide = Guide(registered("guided"), registered("explorative"), registered("eager"))
    rng = np.random.default_rng(seed)
    inputs = {name: rng.uniform(-1, 1, shape) for name, shape in tensor_shapes(expr).items()}
    check = Check(expr, inputs, rtol, sampled=terms(expr) > FULL_CHECK_TERMS, rng=rng)
    measuring = _Measuring(backend, check, identity, deadline)
    seen: set = set()
    rankings: list[list[Candidate]] = []  # each level's, checked after the final one
    levels = explore_levels(expr, max_depth, time_limit=time_limit and 0.6 * time_limit, max_states=max_states)
    exploration = None
    try:
        for exploration, level in levels:
            seen.update(state.fingerprint for state in level)
            for state in level:
                if levels_until is not None and time.perf_counter() > levels_until:
                    exploration.stats.stop_reason = "time"
                    break
                for derived in [state, *guided(state, guide, seen, guided_depth)]:
                    candidate = admitted(postprocess(instantiate(derived.expr), weights), identity, expr)
                    if candidate is not None:
                        candidate.source = derived
                        found.setdefault(key(candidate), candidate)
            _add_lighter_forms(found, keep, guide, weights, identity, expr, as_given)
            rankings.append(diverse(sorted(found.values(), key=lambda c: c.cost)))
            if exploration.stats.stop_reason == "time":
                break
    except KeyboardInterrupt:  # Ctrl-C: what was found so far is still verified and returned
        if exploration is None:
            raise
        exploration.stats.stop_reason = "interrupted"
    extraction = Extraction(exploration.graph, expr, weights) if exploration.graph is not None else None
    extracted = extraction and extraction.best(deadline)
    if extracted and (candidate := admitted(extracted, identity, expr)):
        found.setdefault(key(candidate), candidate)
    _add_lighter_forms(found, keep, guide, weights, identity, expr, as_given)
    for ranking in [diverse(sorted(found.values(), key=lambda c: c.cost)), *reversed(rankings)]:
        measuring.verify(ranking, keep)
    programs = measuring.finish(extraction if backend.measures else None)
    return Derivation(expr, programs, exploration.stats, check.rejected)


def _add_lighter_forms(found: dict, keep: int, guide: Guide, weights, identity, expr: Scope, as_given) -> None:
    """The best ``keep`` of ``found`` again, added to it: with lighter eOperators, and with
    their operands re-laid out for larger GEMMs. After every level, so that a deeper search
    starts with every form a shallower one found."""
    for candidate in diverse(sorted(found.values(), key=lambda c: c.cost))[:keep]:
        source = State(expr, (), fingerprint(expr)) if candidate is as_given else candidate.source
        if source is None:
            continue
        lighter = lightened(source, guide)
        for state, relayout in ((source, True), (lighter, False), (lighter, True)):
            again = state and admitted(postprocess(instantiate(state.expr, relayout=relayout), weights), identity, expr)
            if again and key(again) not in found:
                again.source = state
                found[key(again)] = again


# Rounds of lazy measurement: extract with what is measured, compile and measure what was
# chosen, extract again; stop when extraction chooses a program already measured.
EXTRACTION_ROUNDS = 3
# The fastest few compiled programs have their kernels timed again, in turns, before the
# choice: their first timings were taken at different times (``Backend.remeasure``).
RACE = 3
# Runs of a candidate that checking and measuring it take at least: the compiled check, two
# warm-up runs and a timed one.
RUNS_TO_VERIFY = 4


class _Measuring:
    """The candidates of a derivation checked, compiled and measured: the final ranking's best
    few, then each level's (so without a time limit a deeper search keeps what a shallower one
    verified and measured).

    ``verify`` checks the first ``keep`` candidates of a ranking that are not checked yet
    against the reference (the identity always, besides them) and compiles each that agrees with the
    ``backend``, checks the compiled program again and measures it. A measuring backend skips a
    candidate whose analytic cost says its runs would end past the ``deadline`` (at full size
    one naive kernel runs for seconds), except the ``identity`` (the never-slower fallback) and,
    if none agreed yet, the next candidate. A candidate or compiled program that disagrees is
    dropped and its rule path logged in ``check.rejected``."""

    def __init__(self, backend: Backend, check: Check, identity: Candidate, deadline: float | None):
        self.backend, self.check, self.identity, self.deadline = backend, check, identity, deadline
        self.compiled: list = []
        self.checked: dict[tuple, bool] = {}  # candidate key -> agreed with the reference
        self.shapes = {name: value.shape for name, value in check.inputs.items()}

    def verify(self, ranked: list[Candidate], keep: int) -> None:
        agreed = 0
        for candidate in ranked:
            if agreed >= keep and candidate is not self.identity:
                continue
            if key(candidate) not in self.checked:
                if self._overruns(candidate):
                    continue
                self.checked[key(candidate)] = self.check.sampled or self.check.reference(candidate)
                if self.checked[key(candidate)]:  # sampled: the compiled program is checked
                    self.add(candidate)
            agreed += self.checked[key(candidate)] and candidate is not self.identity

    def _overruns(self, candidate: Candidate) -> bool:
        if not self.backend.measures or self.deadline is None or candidate is self.identity or not self.compiled:
            return False
        return time.perf_counter() + RUNS_TO_VERIFY * candidate.cost > self.deadline

    def add(self, candidate: Candidate) -> None:
        program = self.backend.compile(candidate, self.shapes)
        if self.check.compiled(candidate, program, self.backend.tolerance):
            self.backend.measure(program)
            self.compiled.append(program)

    def finish(self, extraction) -> list:
        """The compiled programs ordered by cost, after extraction from the e-graph with the
        measured kernel times (``extraction``; None: the backend measures nothing) had up to
        ``EXTRACTION_ROUNDS`` chances to choose a program not yet measured, and the ``RACE``
        fastest had their kernels timed again in turns (their new timings order them)."""
        if not self.compiled:  # the identity compiles to one generated kernel: this is a code generation bug
            raise RuntimeError(
                f"no compiled program for {self.check.expr} agrees with the reference:\n"
                + "\n".join(self.check.rejected)
            )
        for program in self.compiled if extraction is not None else ():
            extraction.learn(program)
        for _ in range(EXTRACTION_ROUNDS if extraction is not None else 0):
            if self.deadline is not None and time.perf_counter() > self.deadline:
                break
            candidate = extraction.best(self.deadline)
            if candidate is None or key(candidate) in self.checked or oversized(candidate.kernels, self.check.expr):
                break
            before = len(self.compiled)
            self.verify([candidate], 1)
            for program in self.compiled[before:]:
                extraction.learn(program)
        self._race()
        return self.compiled

    def _race(self) -> None:
        raced: list = []
        for _ in range(2):  # a second time if the first race let an unraced program into the front
            self.compiled.sort(key=lambda p: p.cost)
            front = self.compiled[:RACE]
            if len(front) < 2 or all(any(p is r for r in raced) for p in front):
                break
            if self.deadline is not None and time.perf_counter() > self.deadline:
                break
            self.backend.remeasure(front)
            raced += front
        self.compiled.sort(key=lambda p: p.cost)
