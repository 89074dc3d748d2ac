"""Kernel orchestration (Korch sections 4-5): which primitives share a kernel, chosen by a binary
linear program over measured candidate kernels.

The primitive graph is a program's kernels in execution order (each one ``output = expr``): a
primitive reads the outputs of earlier ones. A *candidate kernel* is a convex set of eOperator
primitives with one output (Korch Theorem 1: the difference of two execution states), and at
most one linear primitive whose epilogue they compute, computed as one eOperator: its members
inlined into its output primitive (``fusion.fuse``). A member may
also be computed by another kernel: a primitive computed twice (Korch Figure 4c) is the price of
not writing its result to memory.

Korch enumerates execution states by depth-first search and takes differences of nested
states; the number of states grows exponentially with the graph's width, so Korch cuts large
graphs. A single-output candidate is its output primitive plus ancestors whose results only
flow towards it, so ``convex_candidates`` grows each one directly from its output primitive,
producer by producer, up to ``max_primitives``: the same candidates up to that size, with no
cut to place and linear in the graph's length.

``solve`` is Korch's binary linear program (equations 2-4): minimise the summed measured time of
the chosen kernels such that every required tensor is produced and every input of a chosen
kernel is produced by a chosen kernel or given. It is solved by HiGHS (highspy) under a time
limit, started from the greedy plan, with a cover row per primitive (it is computed by some
chosen kernel) that every plan meets and that makes the LP relaxation tight; a plan not better
than the baseline (every primitive its own kernel) is not taken.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import highspy
import numpy as np

from rewriter.ir import tensor_shapes

from .dependence import WIDTHS, width
from .fusion import fuse, fusible_size
from .kernels import Kernel


@dataclass(frozen=True)
class Primitives:
    """The primitive graph of ``kernels`` (in execution order): who reads whose output."""

    kernels: tuple[Kernel, ...]
    producers: tuple[frozenset[int], ...]  # position -> positions of the primitives it reads
    descendants: tuple[int, ...]  # position -> bit set of the primitives that depend on it

    @staticmethod
    def of(kernels: Sequence[Kernel]) -> Primitives:
        made = {k.output: i for i, k in enumerate(kernels)}
        producers = tuple(
            frozenset(made[t] for t in tensor_shapes(k.expr) if t in made and made[t] < i)
            for i, k in enumerate(kernels)
        )
        descendants = [0] * len(kernels)
        for i in reversed(range(len(kernels))):
            for p in producers[i]:
                descendants[p] |= descendants[i] | (1 << i)
        return Primitives(tuple(kernels), producers, tuple(descendants))

    def convex(self, members: frozenset[int]) -> bool:
        """No path leaves ``members`` and comes back (Korch Definition 1: one kernel can run it)."""
        inside = sum(1 << m for m in members)
        reached = 0
        for m in members:
            reached |= self.descendants[m]
        outside = reached & ~inside
        while outside:
            low = outside & -outside
            if self.descendants[low.bit_length() - 1] & inside:
                return False
            outside ^= low
        return True


def convex_candidates(
    graph: Primitives,
    fusible: Callable[[int], bool],
    max_primitives: int = 5,
    linear: Callable[[int], bool] = lambda _: False,
) -> list[tuple[int, ...]]:
    """Every convex set of at most ``max_primitives`` primitives, two or more, whose only output
    is its last primitive: grown from a ``fusible`` primitive, one producer at a time. Members
    are ``fusible``, except at most one ``linear`` primitive (a product computed in the kernel
    with the element-wise work after it, its epilogue), which is never the output and is not
    grown from: every member is read by a member that is not linear. Each is a tuple of
    positions in execution order (the output last)."""
    found: list[tuple[int, ...]] = []
    for sink in range(len(graph.kernels)):
        if not fusible(sink):
            continue
        level, seen = {frozenset({sink})}, set()
        for _ in range(max_primitives - 1):
            grown = set()
            for members in level:
                has_linear = any(linear(m) for m in members)
                for m in members:
                    if linear(m):
                        continue
                    for p in graph.producers[m]:
                        bigger = members | {p}
                        allowed = fusible(p) or (linear(p) and not has_linear)
                        if p in members or not allowed or bigger in seen:
                            continue
                        seen.add(bigger)
                        if graph.convex(bigger):
                            grown.add(bigger)
            found += [tuple(sorted(s)) for s in grown]
            level = grown
    return found


def internal_widths(graph: Primitives, members: Sequence[int]) -> tuple[tuple[str, str, str], ...]:
    """(producer, consumer, dependence width) for each edge inside a candidate
    (``dependence.width``: how tightly the fused kernel can interleave the two)."""
    inside = set(members)
    return tuple(
        (graph.kernels[p].output, graph.kernels[c].output, width(graph.kernels[c].expr, graph.kernels[p].output))
        for c in members
        for p in sorted(graph.producers[c] & inside)
    )


def widest(widths: Sequence[tuple[str, str, str]]) -> int:
    """The rank of the widest dependence among ``widths`` (0 element-wise, 1 tile-local, 2 global)."""
    return max((WIDTHS.index(w) for _, _, w in widths), default=0)


def fused_kernel(graph: Primitives, members: Sequence[int]) -> Kernel | None:
    """The eOperator computing ``members``' last primitive with the others inlined into it;
    None where it would grow past ``fusion.MAX_TREE_SCOPES``."""
    kernel = graph.kernels[members[-1]]
    for m in reversed(members[:-1]):
        if graph.kernels[m].output in tensor_shapes(kernel.expr):
            if not fusible_size(graph.kernels[m], kernel):
                return None
            kernel = fuse(graph.kernels[m], kernel)
    return kernel


@dataclass(frozen=True)
class Choice:
    """A candidate kernel for the program: ``members`` (positions in the primitive graph, its
    output last), the tensors it reads, and its measured seconds."""

    members: tuple[int, ...]
    reads: frozenset[str]
    seconds: float


@dataclass
class Plan:
    """The solver's answer: the chosen candidates (indices into the choices given) and its figures."""

    chosen: list[int]
    seconds: float  # the chosen kernels' summed measured time
    baseline_seconds: float  # every primitive its own kernel
    figures: dict = field(default_factory=dict)  # variables, constraints, status, gap, solve_s


@dataclass(frozen=True)
class Constraints:
    """The BLP's rows over the choices (one binary variable each): each row a list of
    (choice, coefficient), its sum at least the row's lower bound (1 or 0)."""

    rows: tuple[tuple[tuple[int, float], ...], ...]
    lower: tuple[float, ...]

    def met_by(self, chosen: set[int]) -> bool:
        return all(sum(v for i, v in row if i in chosen) >= low for row, low in zip(self.rows, self.lower))

    def model(self, costs: Sequence[float], integral: bool = True) -> highspy.HighsLp:
        """HiGHS's model: minimise ``costs`` over the choices in [0, 1], binary if ``integral``."""
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(costs), len(self.rows)
        lp.col_cost_ = np.asarray(costs, dtype=float)
        lp.col_lower_, lp.col_upper_ = np.zeros(len(costs)), np.ones(len(costs))
        lp.row_lower_ = np.asarray(self.lower, dtype=float)
        lp.row_upper_ = np.full(len(self.rows), highspy.kHighsInf)
        matrix = lp.a_matrix_
        matrix.format_ = highspy.MatrixFormat.kRowwise
        matrix.start_ = np.cumsum([0] + [len(row) for row in self.rows])
        matrix.index_ = np.array([i for row in self.rows for i, _ in row], dtype=np.int32)
        matrix.value_ = np.array([v for row in self.rows for _, v in row], dtype=float)
        if integral:
            lp.integrality_ = [highspy.HighsVarType.kInteger] * len(costs)
        return lp


def blp_constraints(graph: Primitives, choices: Sequence[Choice], required: set[str]) -> Constraints:
    """The BLP's constraints over ``choices`` (one variable each): every ``required`` tensor
    produced (output constraints), every tensor a chosen kernel reads that a primitive makes
    produced by a chosen kernel (dependency constraints; Korch equations 3-4), and every
    primitive behind a required tensor computed by a chosen kernel (``_cover_rows``)."""
    made = {k.output: i for i, k in enumerate(graph.kernels)}
    producing: dict[int, list[int]] = {}
    for index, choice in enumerate(choices):
        producing.setdefault(choice.members[-1], []).append(index)
    rows: list[list[tuple[int, float]]] = [[(i, 1.0) for i in producing[made[t]]] for t in sorted(required & set(made))]
    for index, choice in enumerate(choices):
        for tensor in sorted(choice.reads & set(made)):
            rows.append([(i, 1.0) for i in producing[made[tensor]]] + [(index, -1.0)])
    rows += _cover_rows(graph, choices, {made[t] for t in required & set(made)})
    lower = tuple(1.0 if all(v > 0 for _, v in row) else 0.0 for row in rows)
    return Constraints(tuple(map(tuple, rows)), lower)


def solve(
    graph: Primitives,
    choices: Sequence[Choice],
    required: set[str],
    time_limit: float = 10.0,
    start: Sequence[int] = (),
) -> Plan:
    """Korch's BLP (equation 2) over ``choices``, which include every primitive alone (the
    baseline): minimise the chosen kernels' summed seconds under ``blp_constraints``. A primitive
    may be computed by several chosen kernels. ``start``: a plan (indices into ``choices``, the
    greedy one) that HiGHS starts from where it meets the constraints, so that a search stopped
    by ``time_limit`` returns a plan at least as cheap."""
    constraints = blp_constraints(graph, choices, required)
    costs = [choice.seconds * 1e6 for choice in choices]  # microseconds: better scaled
    highs = _highs(time_limit)
    highs.passModel(constraints.model(costs))
    started = bool(start) and constraints.met_by(set(start))
    if started:
        x = np.zeros(len(choices))
        x[list(start)] = 1.0
        solution = highspy.HighsSolution()
        solution.col_value, solution.value_valid = x, True
        highs.setSolution(solution)
    begin = time.perf_counter()
    highs.run()
    info, status = highs.getInfo(), highs.getModelStatus()
    figures = {
        "variables": len(choices),
        "constraints": len(constraints.rows),
        "status": highs.modelStatusToString(status),
        "gap": info.mip_gap if info.mip_gap < highspy.kHighsInf else None,
        "solve_s": round(time.perf_counter() - begin, 4),
        "started": started,
    }
    alone = {c.members[0]: i for i, c in enumerate(choices) if len(c.members) == 1}
    baseline = [alone[p] for p in range(len(graph.kernels))]
    baseline_seconds = sum(choices[i].seconds for i in baseline)
    found = info.primal_solution_status == highspy.kSolutionStatusFeasible
    if not found or info.objective_function_value / 1e6 >= baseline_seconds:
        return Plan(baseline, baseline_seconds, baseline_seconds, figures)
    chosen = [i for i, x in enumerate(highs.getSolution().col_value) if x > 0.5]
    return Plan(chosen, sum(choices[i].seconds for i in chosen), baseline_seconds, figures)


def lp_bound(graph: Primitives, choices: Sequence[Choice], required: set[str]) -> float:
    """The LP relaxation's optimum (seconds): the bound HiGHS prunes with, tight thanks to the
    cover rows (``_cover_rows``)."""
    highs = _highs(None)
    highs.passModel(blp_constraints(graph, choices, required).model([c.seconds for c in choices], integral=False))
    highs.run()
    return highs.getInfo().objective_function_value


def _highs(time_limit: float | None) -> highspy._Highs:
    """A silent HiGHS instance. highspy's ``Highs`` prints HiGHS's banner from its constructor,
    before an option can turn output off; its base class, the solver itself, does not."""
    highs = highspy._Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("mip_rel_gap", 1e-6)
    if time_limit is not None:
        highs.setOptionValue("time_limit", float(time_limit))
    return highs


def _cover_rows(graph: Primitives, choices: Sequence[Choice], outputs: set[int]) -> list[list[tuple[int, float]]]:
    """One row per primitive that an output depends on: the chosen kernels computing it (as a
    member, inlined or not) number at least one. Every plan meets these (a kernel reads what
    its members read outside it, so each primitive behind an output is inside some chosen
    kernel), but without them the LP relaxation is worthless: two kernels at 1/2 that make the
    same tensor from different inputs are both served by one producer at 1/2, and so on back,
    halving at every level (BERT's 187 primitives: LP bound 1.0 ms against a 31.2 ms plan, and
    HiGHS stopped at its 10 s limit with a gap of 68%; with the rows, 31.1 ms and solved to
    optimality in 0.1 s)."""
    needed, stack = set(), list(outputs)
    while stack:
        p = stack.pop()
        if p not in needed:
            needed.add(p)
            stack.extend(graph.producers[p])
    containing: dict[int, list[int]] = {}
    for index, choice in enumerate(choices):
        for m in choice.members:
            containing.setdefault(m, []).append(index)
    return [[(i, 1.0) for i in containing[p]] for p in sorted(needed)]
