"""Guided derivation (OLLIE 5.2): steps toward operators, free of the depth budget.

From a search state, the guided rules are applied to the scopes that have an operator's shape but
match no operator table yet (``guided``), each rule that takes a target once toward every
operator record (OLLIE Algorithm 2, GUIDEDDERIVE(E, T) for T in the operators: the rule is given
T's iterator mapping table). And the best candidates' summing eOperators are made
lighter: each replaced by the explorative rule result that sums over the fewest points
(``lightened``: an OffsetAdd over every input position tightened to the taps that meet each
output point).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rewriter.ir import Scope, replace_at, scopes_at
from rewriter.lower import OPERATORS, match_operator, wants_operator
from rewriter.search import State, Step, eager_closure, fingerprint

from .select import Extracted
from .verify import terms


@dataclass
class Guide:
    """What guided derivation proposes for one scope, memoised (states share most of their
    scopes): the guided rules' results where the scope has an operator's shape but matches no
    operator table yet (``proposals``), and the explorative rule result that makes a summing
    eOperator sum over the fewest points (``lighter``). ``targets``: the iterator mapping
    tables of the operators guided rules derive toward."""

    guided: list
    explorative: list
    eager: list
    targets: tuple = tuple(operator.table for operator in OPERATORS)
    memo: dict = field(default_factory=dict)  # eager rule results per scope
    proposed: dict = field(default_factory=dict)
    lightest: dict = field(default_factory=dict)

    def proposals(self, scope: Scope) -> list:
        """(rule, result) for each distinct result of a guided rule on ``scope``."""
        if scope not in self.proposed:
            found = {}
            for rule_ in self.guided if wants_operator(scope) else ():
                for target in self.targets if rule_.targets else (None,):
                    for result in rule_.apply(scope, target=target):
                        found.setdefault(result, rule_)  # two targets often ask for one layout
            self.proposed[scope] = [(r, x) for x, r in found.items()]
        return self.proposed[scope]

    def lighter(self, scope: Scope) -> tuple | None:
        if scope not in self.lightest:
            found = []
            if scope.summation and match_operator(scope)[0] == "eop":
                found = [(terms(x), k, r, x) for r in self.explorative for k, x in enumerate(r.apply(scope))]
            best = min(found, default=None, key=lambda f: f[:2])
            self.lightest[scope] = best[2:] if best and best[0] < terms(scope) else None
        return self.lightest[scope]


def lightened(source, guide: Guide, steps: int = 8):
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
    return State(expr, source.path + path, fingerprint(expr)) if isinstance(source, State) else Extracted(expr)


def guided(state: State, guide: Guide, seen: set, depth: int) -> list[State]:
    """From ``state``, up to ``depth`` guided steps, each applied only to scopes that have an
    operator's shape but match no operator table yet. Guided steps do not count against
    ``max_depth``; states already seen are not walked again."""
    found, frontier = [], [state]
    for _ in range(depth):
        frontier = [s for s in _guided_steps(frontier, guide) if s.fingerprint not in seen]
        seen.update(s.fingerprint for s in frontier)
        found += frontier
    return found


def _guided_steps(states: list[State], guide: Guide) -> list[State]:
    results = []
    for state in states:
        for position, scope in scopes_at(state.expr):
            for rule_, result in guide.proposals(scope):
                expr = replace_at(state.expr, position, result)
                closed, eager_steps = eager_closure(expr, guide.eager, guide.memo)
                path = state.path + (Step(rule_.name, "guided", position, expr), *eager_steps)
                results.append(State(closed, path, fingerprint(closed)))
    return results
