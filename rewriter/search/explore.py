"""Explorative derivation (OLLIE Algorithm 2, explorative part) with exact fingerprints.

``explore(expr, max_depth)`` applies every registered explorative rule to every e-node the
search reaches, level by level (breadth first). An e-node is a scope with the scopes it reads
taken as their e-classes (``rewriter.search.classes``): a rewrite of a nested scope joins its
e-class, and every scope that reads that class shares it by congruence. So a rule is applied
once per e-node, not once per state that holds it: a rule declared ``shallow`` (it sees nested
scopes only as tensors of their box) once per e-node, any other rule once per distinct scope
(it may look inside). Each result becomes one new state, in the context where its scope was
first reached; the combinations congruence implies live in the e-graph, where extraction finds
them. Depth is counted per e-node as OLLIE counts it per state: an e-node is expanded in the
first (shallowest) state that holds it, and its results are one level deeper. Eager rules run
to a fixpoint after each step and cost no depth. States are deduplicated by their exact
fingerprint (``rewriter.search.fingerprint``). Because levels are complete before the next one
starts, what ``max_depth = d`` finds is found with any larger depth: nothing is pruned because
it was first seen near the limit (the failure OLLIE's DFS has at depth 10).

Every new state is added to the e-graph (``rewriter.egraph``) in canonical form and unioned with
the scope it was derived from, so congruence shares sub-expressions across derivations and
extraction can read the result later. egglog adds them on its own thread while the search goes
on; each level ends when egglog has caught up (its native rules run then), so nothing else runs
beside it once a level is handed over.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from rewriter.egraph import ExpressionGraph
from rewriter.ir import ExpressionError, Position, Scope, replace_at, scopes_at

from .classes import ScopeClasses
from .dsl import Rule, registered
from .fingerprint import canonical, fingerprint

# --------------------------------------------------------------------------------------------
# States and paths


@dataclass(frozen=True)
class Step:
    rule: str
    kind: str
    position: Position
    result: Scope  # the whole expression after this step

    def __str__(self) -> str:
        where = "root" if not self.position else "scope at " + ".".join(map(str, self.position))
        return f"{self.rule} ({self.kind}, {where})"


@dataclass(frozen=True)
class State:
    expr: Scope
    path: tuple[Step, ...]
    fingerprint: str = field(compare=False)

    @property
    def depth(self) -> int:
        return sum(step.kind == "explorative" for step in self.path)

    def explain(self, start: Scope | None = None) -> str:
        """The derivation like the paper's Figure 6: E1 --rule--> E2 --rule--> ..."""
        lines = [f"E1 = {start}" if start is not None else "E1 = (input)"]
        for number, step in enumerate(self.path, start=2):
            lines.append(f"  --[{step}]-->")
            lines.append(f"E{number} = {step.result}")
        return "\n".join(lines)


@dataclass
class RoundStats:
    depth: int
    new_states: int = 0
    fingerprint_hits: int = 0
    shared: int = 0  # rule applications skipped: a congruent e-node was expanded already
    applications: Counter = field(default_factory=Counter)
    rule_s: float = 0.0  # rules computing their right-hand sides (and the e-node keys)
    rebuild_s: float = 0.0  # rebuilding states: replacing the scope, eager closure, fingerprints
    egraph_s: float = 0.0  # the search waiting on the e-graph: queueing inserts, native rules, catching up
    enodes: int = 0
    eclasses: int = 0


@dataclass
class SearchStats:
    rounds: list[RoundStats] = field(default_factory=list)
    stop_reason: str = ""
    seconds: float = 0.0
    rule_errors: list[str] = field(default_factory=list)

    @property
    def states(self) -> int:
        return 1 + sum(r.new_states for r in self.rounds)

    @property
    def fingerprint_hits(self) -> int:
        return sum(r.fingerprint_hits for r in self.rounds)

    @property
    def shared(self) -> int:
        return sum(r.shared for r in self.rounds)

    @property
    def applications(self) -> Counter:
        total: Counter = Counter()
        for r in self.rounds:
            total.update(r.applications)
        return total

    def table(self) -> str:
        head = (
            f"{'depth':>5} {'new':>7} {'hits':>7} {'shared':>7} {'enodes':>8} {'eclasses':>8}"
            f" {'rule s':>8} {'rebuild s':>9} {'egraph s':>8}"
        )
        rows = [
            f"{r.depth:>5} {r.new_states:>7} {r.fingerprint_hits:>7} {r.shared:>7} {r.enodes:>8} {r.eclasses or 0:>8}"
            f" {r.rule_s:>8.3f} {r.rebuild_s:>9.3f} {r.egraph_s:>8.3f}"
            for r in self.rounds
        ]
        return "\n".join([head, *rows, f"stop: {self.stop_reason}, {self.states} states, {self.seconds:.2f} s"])


@dataclass
class Exploration:
    root: Scope
    states: list[State]
    stats: SearchStats
    graph: object | None = None
    classes: ScopeClasses | None = None  # the search's e-classes of scopes

    def find(self, expr: Scope) -> State | None:
        """The state equal to ``expr`` up to renaming and reordering, if it was reached."""
        key = fingerprint(expr)
        return next((s for s in self.states if s.fingerprint == key), None)


# --------------------------------------------------------------------------------------------
# The search


class _Budget:
    def __init__(self, max_states: int | None, time_limit: float | None, max_enodes: int | None):
        self.max_states, self.max_enodes = max_states, max_enodes
        self.deadline = None if time_limit is None else time.perf_counter() + time_limit

    def exhausted(self, states: int, enodes: int) -> str | None:
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return "time"
        if self.max_states is not None and states >= self.max_states:
            return "states"
        if self.max_enodes is not None and enodes >= self.max_enodes:
            return "nodes"
        return None


def eager_closure(
    expr: Scope, rules: Sequence[Rule], memo: dict | None = None, limit: int | None = None, unite=None
) -> tuple[Scope, list[Step]]:
    """Apply eager rules anywhere until none applies (each takes its first result). ``limit``
    bounds the steps (a guard against rules that undo each other); by default it grows with the
    number of scopes, each of which may be inlined or simplified a few times. ``unite(position,
    scope, result)`` hears of every rewrite (the search unites their e-classes)."""
    steps: list[Step] = []
    memo = {} if memo is None else memo
    if limit is None:
        limit = 64 + 4 * sum(1 for _ in scopes_at(expr))
    for _ in range(limit):
        for position, scope, eager in ((p, s, r) for p, s in scopes_at(expr) for r in rules):
            key = (eager.name, scope)
            if key not in memo:
                memo[key] = eager.apply(scope)
            results = memo[key]
            if results:
                if unite is not None:
                    unite(position, scope, results[0])
                expr = replace_at(expr, position, results[0])
                steps.append(Step(eager.name, eager.kind, position, expr))
                break
        else:
            return expr, steps
    return expr, steps


def explore(
    expr: Scope,
    max_depth: int = 4,
    *,
    rules: Sequence[Rule] | None = None,
    max_states: int | None = 200_000,
    time_limit: float | None = None,
    max_enodes: int | None = None,
    use_egraph: bool = True,
) -> Exploration:
    """Every state reachable from ``expr`` within ``max_depth`` explorative steps.

    Budgets: ``max_states`` states, ``time_limit`` seconds, ``max_enodes`` e-graph nodes; the
    first exhausted one (or Ctrl-C) stops the search, and ``stats.stop_reason`` says which.
    """
    exploration = None
    for exploration, _ in explore_levels(
        expr,
        max_depth,
        rules=rules,
        max_states=max_states,
        time_limit=time_limit,
        max_enodes=max_enodes,
        use_egraph=use_egraph,
    ):
        pass
    return exploration


def explore_levels(
    expr: Scope,
    max_depth: int = 4,
    *,
    rules: Sequence[Rule] | None = None,
    max_states: int | None = 200_000,
    time_limit: float | None = None,
    max_enodes: int | None = None,
    use_egraph: bool = True,
) -> Iterator[tuple[Exploration, list[State]]]:
    """``explore`` one level at a time: yields ``(exploration so far, the level's new states)``,
    first ``[root]`` at depth 0, then after each level. Whoever consumes the levels can use a
    level's states (instantiate, verify, measure them) before the next level is searched, and
    stop early: what a deeper ``max_depth`` yields starts with exactly what a shallower one does
    (an anytime search). Same budgets as ``explore``; the last yield carries the stop reason."""
    if not isinstance(expr, Scope):
        raise ExpressionError(f"explore() takes a Scope, got {type(expr).__name__}")
    if max_depth < 0:
        raise ExpressionError(f"max_depth must be >= 0, got {max_depth}")
    rules = list(registered() if rules is None else rules)
    explorative = [r for r in rules if r.kind == "explorative"]
    eager = [r for r in rules if r.kind == "eager"]
    started = time.perf_counter()
    budget = _Budget(max_states, time_limit, max_enodes)
    stats = SearchStats()
    graph = ExpressionGraph() if use_egraph else None

    native = [rewrite for r in rules for rewrite in r.rewrites]  # pattern rules run inside egglog
    if graph is not None and native:
        graph.register(*native)
    search = _Search(explorative, eager, graph, budget, stats)
    start, steps = eager_closure(expr, eager, search.memo, unite=search.unite)
    root = State(start, tuple(steps), fingerprint(start))
    states = {root.fingerprint: root}
    if graph is not None:
        graph.union(expr, canonical(expr))  # the root as given, for extraction to start from
        graph.union(canonical(expr), canonical(start))
    exploration = Exploration(expr, [root], stats, graph, search.classes)
    frontier = [root]
    if max_depth == 0:
        stats.stop_reason = "depth"
    yield exploration, [root]
    with _collector_skips_the_search() as search.freeze:
        yield from _levels(search, exploration, frontier, states, max_depth, started, native)


def _levels(search, exploration, frontier, states, max_depth, started, native):
    stats, graph = exploration.stats, exploration.graph
    for depth in range(1, max_depth + 1):
        if not frontier and not stats.stop_reason:
            stats.stop_reason = "saturated"
        if stats.stop_reason:
            stats.seconds = time.perf_counter() - started
            return
        current = RoundStats(depth)
        stats.rounds.append(current)
        level: list[State] = []  # filled as states are found: a Ctrl-C keeps what was found
        try:
            with graph.alongside() if graph is not None else nullcontext():
                search.expand(frontier, level, states, current)
            if graph is not None:
                tick = time.perf_counter()
                graph.run()  # the e-graph's native eager rewrites (index arithmetic)
                if native:
                    graph.run("")  # the registered pattern rules
                current.enodes, current.eclasses = graph.size()
                current.egraph_s += time.perf_counter() - tick
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
            if graph is not None:
                graph.wait()  # egglog's thread ends its inserts before anything else is timed
        if not stats.stop_reason and depth == max_depth:
            stats.stop_reason = "depth"
        exploration.states = list(states.values())
        stats.seconds = time.perf_counter() - started
        frontier = level
        yield exploration, level


@contextmanager
def _collector_skips_the_search():
    """Python's cyclic collector scans every live object when it collects the oldest generation,
    and a search keeps most of what it builds (states, e-nodes, memos): at Conv5x5 depth 4 nine
    such collections took a quarter of the search. What is alive after each state's expansion is
    frozen (the ``freeze`` this yields: ``gc.freeze``, a list splice) so the collector skips it;
    garbage is still freed by reference counting, and cycles wait until the search ends, when
    everything is handed back. A process that froze objects itself (a server before it forks)
    keeps its freeze: the search then freezes nothing, since unfreezing is all or nothing."""
    if gc.get_freeze_count():
        yield lambda: None
        return
    gc.freeze()
    try:
        yield gc.freeze
    finally:
        gc.unfreeze()


class _Search:
    """The search's expansion, level after level: every explorative rule on every e-node of the
    frontier's states, once over the whole search. A shallow rule is keyed by the scope's e-node (nested scopes as their e-classes), any
    other rule by the whole scope; a key seen before, in this state or another, is shared by
    congruence and skipped. Each result becomes one new state, in the context where its scope
    was found (eager rules closed, fingerprinted, unioned in both e-graphs)."""

    def __init__(self, explorative, eager, graph, budget, stats):
        self.explorative, self.eager, self.graph, self.budget, self.stats = explorative, eager, graph, budget, stats
        self.classes = ScopeClasses()
        self.applied: set = set()  # (rule, e-node or scope) keys already expanded
        self.memo: dict = {}  # eager rule results per scope
        self.freeze = lambda: None  # set while levels are searched (_collector_skips_the_search)

    def unite(self, position, scope: Scope, result: Scope) -> None:
        if position:  # a root's class is never read as a nested one: only nested classes are kept
            self.classes.union(canonical(scope), canonical(result))

    def expand(self, frontier, new_frontier, states, current) -> None:
        for state in frontier:
            self.freeze()
            for position, scope in list(scopes_at(state.expr)):
                enode = None
                for rule_ in self.explorative:
                    reason = self.budget.exhausted(len(states), current.enodes)
                    if reason:
                        self.stats.stop_reason = reason
                        return
                    tick = time.perf_counter()
                    if rule_.shallow:
                        enode = enode or self.classes.enode(scope)
                    key = (rule_.name, enode if rule_.shallow else canonical(scope))
                    if key in self.applied:  # a congruent scope was expanded: the e-graph shares its results
                        current.shared += 1
                        current.rule_s += time.perf_counter() - tick
                        continue
                    self.applied.add(key)
                    try:
                        results = rule_.apply(scope)
                    except ExpressionError as err:  # a broken rule is reported, never unioned
                        self.stats.rule_errors.append(str(err))
                        results = []
                    tock = time.perf_counter()
                    current.rule_s += tock - tick
                    egraph_before = current.egraph_s
                    for result in results:
                        if self.budget.max_states is not None and len(states) >= self.budget.max_states:
                            self.stats.stop_reason = "states"  # a rule with many results stops mid-way
                            return
                        current.applications[rule_.name] += 1
                        child = self.derive(state, position, scope, result, rule_, current)
                        if child.fingerprint in states:
                            current.fingerprint_hits += 1
                            continue
                        states[child.fingerprint] = child
                        current.new_states += 1
                        new_frontier.append(child)
                    # e-graph insertion inside derive is counted in egraph_s, not here
                    current.rebuild_s += time.perf_counter() - tock - (current.egraph_s - egraph_before)

    def derive(self, state: State, position, scope, result, rule_, current) -> State:
        self.unite(position, scope, result)
        expr = replace_at(state.expr, position, result)
        steps = [Step(rule_.name, rule_.kind, position, expr)]
        closed, eager_steps = eager_closure(expr, self.eager, self.memo, unite=self.unite)
        child = State(closed, state.path + tuple(steps + eager_steps), fingerprint(closed))
        if self.graph is not None:
            tick = time.perf_counter()
            if position:  # the rewritten sub-scope: every state that holds it shares it by congruence
                self.graph.union(canonical(scope), canonical(result))
            if eager_steps or not position:  # else the new state is in the e-graph by congruence already
                self.graph.union(canonical(state.expr), canonical(closed))  # at the root, the result after eager rules
            current.egraph_s += time.perf_counter() - tick
        return child
