"""``derive(expr)``: hybrid derivation (OLLIE Algorithm 2) to verified candidate programs.

Explorative rounds (``explore``) reach states up to ``max_depth``; every state is instantiated
(``instantiate``: matched operators where the iterator mapping tables match, eOperators
elsewhere) into a candidate program. The identity candidate, the whole expression as one
eOperator, is always in the race. Candidates are ranked by ``Candidate.cost`` (the analytic
stand-in until measured costs land), and each one returned has been run on random inputs and
compared with ``evaluate(expr)``; a mismatch is dropped and counted, never returned.

Guided derivation (section 5.2), one step deep so far: every guided rule is applied to every scope
of every state that no operator matches yet (iterator merging, operator layout, layout
transformation), and the results are instantiated too. Post-processing (5.4) then drops identity
eOperators, fuses an eOperator into its only (eOperator) reader, and marks weight-only kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ExpressionError
from .instantiate import Candidate, Kernel, instantiate, postprocess
from .ir import Scope, tensor_shapes
from .reference import evaluate
from .dsl import registered
from .fingerprint import fingerprint
from .instantiate import match_gemm
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
    time_limit: float | None = None,
    max_states: int | None = 200_000,
    keep: int = 8,
    weights=(),
    seed: int = 0,
    rtol: float = 1e-6,
) -> Derivation:
    """Candidate programs for ``expr``, best first, each verified against the reference.

    ``weights`` names the inputs that are model weights: kernels reading only them are marked for
    compile-time evaluation (post-processing, OLLIE 5.4).
    """
    if not isinstance(expr, Scope):
        raise ExpressionError(f"derive() takes a Scope, got {type(expr).__name__}")
    exploration = explore(expr, max_depth, time_limit=time_limit, max_states=max_states)
    identity = Candidate([Kernel("eop", "out", expr)])
    found: dict[str, Candidate] = {str(identity): identity}
    guided = registered("guided")
    memo: dict = {}  # eager rule results per scope, shared by every guided step
    eager = registered("eager")
    for state in exploration.states:
        for derived in [state, *_guided_steps(state, guided, eager, memo)]:
            candidate = postprocess(instantiate(derived.expr), weights)
            candidate.source = derived
            found.setdefault(str(candidate), candidate)
    ranked = sorted(found.values(), key=lambda c: c.cost)
    rng = np.random.default_rng(seed)
    inputs = {name: rng.uniform(-1, 1, shape) for name, shape in tensor_shapes(expr).items()}
    expected = evaluate(expr, inputs)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    verified, rejected = [], []
    for candidate in ranked:
        if len(verified) >= keep and candidate is not identity:
            continue
        got = candidate(**inputs)
        if got.shape == expected.shape and np.allclose(got, expected, rtol=rtol, atol=rtol * scale):
            verified.append(candidate)
        else:
            rejected.append(Derivation(expr, [candidate], exploration.stats).explain(candidate))
    verified.sort(key=lambda c: c.cost)
    return Derivation(expr, verified, exploration.stats, rejected)


def _guided_steps(state: State, guided, eager, memo: dict) -> list[State]:
    """One guided rule application on each scope no operator matches (guided steps are free)."""
    results = []
    for position, scope in scopes_at(state.expr):
        if match_gemm(scope) is not None:
            continue
        for rule_ in guided:
            for result in rule_.apply(scope):
                expr = replace_at(state.expr, position, result)
                closed, eager_steps = eager_closure(expr, eager, memo)
                path = state.path + (Step(rule_.name, rule_.kind, position, expr), *eager_steps)
                results.append(State(closed, path, fingerprint(closed)))
    return results
