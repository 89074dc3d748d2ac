"""Kernel orchestration (Korch): candidate kernels of a primitive graph, the binary linear
program that chooses among them, and the orchestrated program that runs the choice."""

import itertools
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import codegen.backend as backend_module
import codegen.orchestrate as orchestrate_module
import codegen.program as program_module
from codegen.backend import CpuBackend
from codegen.measure import MeasurementDB, Race, Timing
from codegen.orchestrate import Orchestration, SharedKernel, orchestrate
from codegen.program import (
    WHOLE_RACE_ROUNDS,
    CompiledProgram,
    _step,
    in_place_times,
    outside_kernels,
    plan_buffers,
    race_whole,
)
from codegen.tvm_kernel import lower_to_te
from rewriter import evaluate, parse, parse_program
from rewriter.ir import ExpressionError, Opaque, Tensor, nested_scopes, tensor_shapes
from rewriter.lower import Kernel, match_operator
from rewriter.lower.fusion import MAX_TREE_SCOPES, fuse, fusion_pairs, tree_scopes
from rewriter.lower.orchestrate import Choice, Primitives, convex_candidates, fused_kernel, lp_bound, solve
from rewriter.pipeline import optimize_program

pytestmark = pytest.mark.usefixtures("module_cache")  # kernels and timings in a fresh cache


def _graph(reads: list[list[int]], n: int = 4) -> Primitives:
    """Primitives P0, P1, ... where primitive i adds X and the outputs of ``reads[i]``."""
    kernels = []
    for i, producers in enumerate(reads):
        names = ["X", *(f"P{p}" for p in producers)]
        body = " + ".join(f"{name}[i]" for name in names)
        kernels.append(Kernel("eop", f"P{i}", parse(f"L i:{n} ; {body}", {name: (n,) for name in names})))
    return Primitives.of(kernels)


@st.composite
def dags(draw, most: int = 6):
    """Random primitive graphs: each primitive reads some of the earlier ones."""
    size = draw(st.integers(2, most))
    return [sorted(draw(st.sets(st.integers(0, i - 1), max_size=2))) if i else [] for i in range(size)]


def _paths(graph: Primitives) -> set[tuple[int, int]]:
    """(a, b) where b depends on a, by brute force."""
    reach = {(p, i) for i, producers in enumerate(graph.producers) for p in producers}
    while True:
        more = {(a, d) for a, b in reach for c, d in reach if b == c} - reach
        if not more:
            return reach
        reach |= more


@settings(max_examples=80, deadline=None)
@given(dags(), st.integers(2, 3), st.sets(st.integers(0, 5)))
def test_candidates_are_exactly_the_convex_single_output_sets(reads, most, linear):
    """``convex_candidates`` against brute force: every set of 2..most primitives that is
    convex (no path leaves it and comes back) and whose members all flow into its last one,
    read by a member that is not a linear primitive; at most one linear member, never the last."""
    graph = _graph(reads)
    reach = _paths(graph)
    want = set()
    for size in range(2, most + 1):
        for members in itertools.combinations(range(len(reads)), size):
            inside, sink = set(members), members[-1]
            convex = not any(
                (a, x) in reach and (x, b) in reach
                for a in inside
                for b in inside
                for x in range(len(reads))
                if x not in inside
            )
            flows = all(m == sink or (m, sink) in reach for m in inside)
            readers = inside - linear
            within = all(m == sink or any(m in graph.producers[c] for c in readers) for m in inside)
            if convex and flows and within and sink not in linear and len(inside & linear) <= 1:
                want.add(members)
    found = convex_candidates(graph, lambda i: i not in linear, most, linear=lambda i: i in linear)
    assert set(found) == want


def test_the_fused_kernel_computes_its_primitives():
    graph = _graph([[], [0], [0, 1]])
    kernel = fused_kernel(graph, (0, 1, 2))
    x = np.arange(4.0)
    p0 = x
    p1 = x + p0
    np.testing.assert_allclose(evaluate(kernel.expr, {"X": x}), x + p0 + p1)


def test_fusion_stops_before_a_kernel_grows_too_large_a_tree():
    """Each kernel reads its producer twice, so k of them fused hold 2^k - 1 scopes as a tree
    (a walk by position visits every copy): pairs stop being offered, and candidates being
    built, before ``MAX_TREE_SCOPES``; the kernels fused so far compute the same values."""
    kernels = [Kernel("eop", "P0", parse("L i:4 ; exp(X[i])", {"X": (4,)}))]
    for k in range(1, 14):
        square = parse(f"L i:4 ; P{k - 1}[i] * P{k - 1}[i] - 1", {f"P{k - 1}": (4,)})
        kernels.append(Kernel("eop", f"P{k}", square))
    chain = list(kernels)
    while pairs := fusion_pairs(kernels):
        producer, consumer = pairs[0]
        kernels[consumer] = fuse(kernels[producer], kernels[consumer])
        del kernels[producer]
    assert len(kernels) == 2 and all(tree_scopes(k.expr) <= MAX_TREE_SCOPES for k in kernels)
    assert fused_kernel(Primitives.of(chain), range(len(chain))) is None
    x = np.linspace(-1, 1, 4)
    want = np.exp(x)
    for _ in range(9):  # P1 .. P9
        want = want * want - 1
    assert kernels[0].output == "P9"
    np.testing.assert_allclose(evaluate(kernels[0].expr, {"X": x}), want)


def _choices(graph: Primitives, seconds: dict[tuple[int, ...], float]) -> list[Choice]:
    return [
        Choice(members, frozenset(tensor_shapes(fused_kernel(graph, members).expr)), cost)
        for members, cost in seconds.items()
    ]


def test_korch_figure_4c_computes_the_shared_producer_three_times():
    """One producer read by three outputs: three kernels that each compute it again cost less
    than the producer's own kernel plus three (Korch Figure 4c), so the BLP recomputes it."""
    graph = _graph([[], [0], [0], [0]])
    alone = {(p,): 1.0 for p in range(4)}
    fused = {(0, 1): 1.2, (0, 2): 1.2, (0, 3): 1.2}
    choices = _choices(graph, alone | fused)
    plan = solve(graph, choices, {"P1", "P2", "P3"})
    assert sorted(choices[i].members for i in plan.chosen) == [(0, 1), (0, 2), (0, 3)]
    assert plan.seconds == pytest.approx(3.6) and plan.baseline_seconds == pytest.approx(4.0)
    # where recomputing costs more than it saves, the producer keeps its own kernel
    choices = _choices(graph, alone | {k: 1.5 for k in fused})
    plan = solve(graph, choices, {"P1", "P2", "P3"})
    assert sorted(choices[i].members for i in plan.chosen) == [(0,), (1,), (2,), (3,)]


def test_a_search_stopped_at_once_returns_the_plan_it_started_from_or_a_cheaper_one():
    """Started from a feasible plan (the greedy one), HiGHS stopped before it searches returns
    that plan or better; a start that leaves a required tensor unmade is not taken."""
    graph = _graph([[], [0], [0], [0]])
    choices = _choices(graph, {(p,): 1.0 for p in range(4)} | {(0, 1): 1.2, (0, 2): 1.2, (0, 3): 1.2})
    recomputing = [4, 5, 6]  # (0, 1), (0, 2), (0, 3): 3.6 against 4.0 alone
    plan = solve(graph, choices, {"P1", "P2", "P3"}, time_limit=0.0, start=recomputing)
    assert plan.figures["started"] and plan.seconds <= 3.6 + 1e-9
    unmade = solve(graph, choices, {"P1", "P2", "P3"}, start=[4, 5])  # P3 made by nobody
    assert not unmade.figures["started"] and unmade.seconds == pytest.approx(3.6)


def test_the_relaxation_of_a_chain_is_as_costly_as_its_best_plan():
    """A chain of twelve primitives, each alone (1.0) or fused with its producer (1.5): the
    best plan pairs them up, 9.0. The LP relaxation of the BLP's constraints costs as much, so
    the solver proves the plan at its root; without the cover rows two half kernels share one
    half producer at every level and the relaxation falls to about 3."""
    n = 12
    graph = _graph([[]] + [[p - 1] for p in range(1, n)])
    choices = _choices(graph, {(p,): 1.0 for p in range(n)} | {(p - 1, p): 1.5 for p in range(1, n)})
    plan = solve(graph, choices, {f"P{n - 1}"})
    assert plan.seconds == pytest.approx(9.0) and plan.figures["gap"] == pytest.approx(0.0)
    assert lp_bound(graph, choices, {f"P{n - 1}"}) == pytest.approx(9.0)


@settings(max_examples=40, deadline=None)
@given(dags(most=5), st.data())
def test_the_plan_is_the_cheapest_feasible_choice(reads, data):
    """The BLP's plan against brute force over every subset of candidates: each required
    tensor produced, each input of a chosen kernel produced by a chosen kernel."""
    graph = _graph(reads)
    members = [(p,) for p in range(len(reads))] + convex_candidates(graph, lambda i: True, 3)
    members = members[: len(reads) + 8]
    costs = data.draw(st.lists(st.integers(1, 20), min_size=len(members), max_size=len(members)))
    choices = _choices(graph, dict(zip(members, map(float, costs))))
    required = {f"P{len(reads) - 1}"} | {f"P{p}" for p in data.draw(st.sets(st.integers(0, len(reads) - 1)))}
    plan = solve(graph, choices, required)

    def feasible(chosen):
        made = {f"P{choices[i].members[-1]}" for i in chosen}
        return required <= made and all(t in made for i in chosen for t in choices[i].reads if t != "X")

    best = min(
        sum(choices[i].seconds for i in chosen)
        for size in range(1, len(choices) + 1)
        for chosen in itertools.combinations(range(len(choices)), size)
        if feasible(chosen)
    )
    assert feasible(plan.chosen)
    assert plan.seconds == pytest.approx(best)


def _primitives_take(seconds: float):
    """A stand-in for the orchestration's timing in place: every kernel of the trial programs
    timed where it runs, then the primitives' own kernels (no nested scope) set to take
    ``seconds``."""

    def in_place(programs, rounds=6):
        times = in_place_times(programs, rounds)
        for program, per_step in zip(programs, times):
            for i, step in enumerate(program.steps):
                if not list(nested_scopes(step.kernel.expr)):
                    per_step[i] = [seconds]
        return times

    return in_place


@given(dags(), st.data())
@settings(max_examples=60, deadline=None)
def test_each_trial_program_reads_only_what_it_makes_and_runs_each_candidate_once(reads, data):
    """The trial programs that time candidates where the program runs them: every candidate
    in exactly one trial, in its output's place; what a trial keeps reads only the graph's input
    and what the trial makes (a primitive read by one that still runs is never dropped), and
    required primitives always run."""
    graph, n = _graph(reads), len(reads)
    candidates = convex_candidates(graph, lambda _: True, max_primitives=4)
    required = {n - 1} | set(data.draw(st.sets(st.integers(0, n - 1), max_size=2)))
    members = [(i,) for i in range(n)] + candidates
    trials = orchestrate_module._trials(graph, members, required)
    assert trials[0] == ({}, set())  # the primitives as they are
    placed = sorted(index for substitutes, _ in trials for index in substitutes.values())
    assert placed == list(range(n, len(members)))
    for substitutes, dropped in trials:
        assert not dropped & required and not dropped & set(substitutes)
        made = set()
        for p in range(n):
            if p in dropped:
                continue
            inside = members[substitutes[p]] if p in substitutes else (p,)
            reads = {q for m in inside for q in graph.producers[m]} - set(inside)
            assert reads <= made, (p, inside, reads - made)
            made.add(p)


def _program(db) -> CompiledProgram:
    """A = exp(X); B = 2 A; C = A + 1 (B and C the outputs), each its own TVM kernel."""
    n = (16, 16)
    texts = [("A", "exp(X[i, j])", "X"), ("B", "2 * A[i, j]", "A"), ("C", "A[i, j] + 1", "A")]
    steps = [
        _step(Kernel("eop", out, parse(f"L i:16, j:16 ; {body}", {read: n})), "tvm", "float32")
        for out, body, read in texts
    ]
    program = CompiledProgram(steps, {"X": n})
    program.measure(db)
    return program


@pytest.mark.parametrize("alone_s, kernels", [(1.0, 2), (1e-12, 3)])
def test_orchestrated_program_recomputes_where_it_measures_faster(tmp_path, monkeypatch, alone_s, kernels):
    """The primitives of a real compiled program: when their own kernels are slow (here: their
    times in place set so), the BLP takes the two candidate kernels (A, B) and (A, C),
    computing A twice; when they are fast, it keeps them. The program computes the same values
    either way."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    monkeypatch.setattr(orchestrate_module, "in_place_times", _primitives_take(alone_s))
    orchestrated, plan = orchestrate(program, {"B", "C"}, db)
    assert plan.figures["trials"] == 3  # the primitives; (A, B) in B's place; (A, C), which overlaps it, in C's
    assert len(orchestrated.steps) == kernels
    assert plan.figures["candidates"] == 2 and plan.figures["measured"] == 2
    if kernels == 2:
        assert [k.primitives for k in plan.shared] == [("A", "B"), ("A", "C")]
        assert plan.recomputed == {"A": 2}
        assert [k.widths for k in plan.shared] == [(("A", "B", "element-wise"),), (("A", "C", "element-wise"),)]
        # vertical transformation in the lowering: each pair is one loop nest, no stage for A
        assert all(len(lower_to_te(step.kernel.expr, "float32", pad=False).stages) == 1 for step in orchestrated.steps)
    else:
        assert plan.shared == [] and plan.recomputed == {}
    x = np.random.default_rng(0).uniform(-1, 1, (16, 16)).astype(np.float32)
    values = orchestrated.run({"X": x}, outputs=("B",))
    np.testing.assert_allclose(values["B"], 2 * np.exp(x), rtol=1e-5)
    np.testing.assert_allclose(values["C"], np.exp(x) + 1, rtol=1e-5)
    assert "BLP" in plan.describe() and "2 element-wise" in plan.describe()
    assert plan.figures["dependences"] == {"element-wise": 2, "tile-local": 0, "global": 0}


def test_a_plan_of_kernels_timed_in_a_lucky_moment_is_timed_again_and_given_up(tmp_path, monkeypatch):
    """The optimizer's curse: the candidates (A, B) and (A, C) first time far below the
    primitives (a lucky moment, set so), and the BLP takes them; timed again where that plan's
    program runs them they are slower than the primitives, so the BLP, solved again, keeps the
    primitives, which it then times again too. The program computes the same values."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    calls = []

    def in_place(programs, rounds=6):
        times = in_place_times(programs, rounds)
        shared = 1e-3 if not calls else 10.0  # seconds of a kernel that computes several primitives
        calls.append(len(programs))
        for program, per_step in zip(programs, times):
            for i, step in enumerate(program.steps):
                per_step[i] = [shared if list(nested_scopes(step.kernel.expr)) else 1.0]
        return times

    monkeypatch.setattr(orchestrate_module, "in_place_times", in_place)
    orchestrated, plan = orchestrate(program, {"B", "C"}, db)
    assert calls == [3, 1, 1]  # the trials; the first plan's program; the second's (the primitives)
    assert plan.figures["retimed"] == 5 and plan.figures["resolves"] == 2
    assert plan.shared == [] and len(orchestrated.steps) == 3
    assert plan.figures["seconds"] == pytest.approx(3.0)
    assert "5 chosen and greedy kernels timed again" in plan.describe()
    x = np.random.default_rng(0).uniform(-1, 1, (16, 16)).astype(np.float32)
    values = orchestrated.run({"X": x}, outputs=("B",))
    np.testing.assert_allclose(values["B"], 2 * np.exp(x), rtol=1e-5)
    np.testing.assert_allclose(values["C"], np.exp(x) + 1, rtol=1e-5)


def _two_layers(db: MeasurementDB) -> CompiledProgram:
    """A1 = exp(X), B1 = 2 A1; A2 = exp(B1), B2 = 2 A2: two layers alike up to tensor names."""
    texts = [("A1", "exp(X[i, j])", "X"), ("B1", "2 * A1[i, j]", "A1"), ("A2", "exp(B1[i, j])", "B1")]
    texts.append(("B2", "2 * A2[i, j]", "A2"))
    steps = [
        _step(Kernel("eop", out, parse(f"L i:16, j:16 ; {body}", {read: (16, 16)})), "tvm", "float32")
        for out, body, read in texts
    ]
    program = CompiledProgram(steps, {"X": (16, 16)})
    program.measure(db)
    return program


def test_alike_layers_are_weighed_on_their_pooled_samples_and_fused_alike(tmp_path, monkeypatch):
    """Two layers alike up to tensor names (A1 = exp(X), B1 = 2 A1; A2 = exp(B1), B2 = 2 A2),
    each primitive 1 s in place. The first layer's fused kernel times 0.5 s where it runs, the
    second's 3 s (set so: one fast moment, one slow); weighed apart, the BLP would fuse the
    first layer only. Weighed on the samples of both, each is 1.75 s against 2 apart, and both
    layers are fused."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _two_layers(db)
    fused = {"B1": 0.5, "B2": 3.0, "A2": 10.0}  # (A1, B1), (A2, B2); (B1, A2) slow

    def in_place(programs, rounds=6):
        times = in_place_times(programs, rounds)
        for run, per_step in zip(programs, times):
            for i, step in enumerate(run.steps):
                per_step[i] = [fused[step.kernel.output] if list(nested_scopes(step.kernel.expr)) else 1.0]
        return times

    monkeypatch.setattr(orchestrate_module, "in_place_times", in_place)
    orchestrated, plan = orchestrate(program, {"B2"}, db, max_primitives=2)
    assert [k.primitives for k in plan.shared] == [("A1", "B1"), ("A2", "B2")]
    assert [k.seconds for k in plan.shared] == [pytest.approx(1.75)] * 2
    x = np.random.default_rng(0).uniform(-1, 1, (16, 16)).astype(np.float32)
    np.testing.assert_allclose(orchestrated.run({"X": x})["B2"], 2 * np.exp(2 * np.exp(x)), rtol=1e-5)


@pytest.mark.parametrize("faster", [True, False])
def test_the_blp_plan_is_taken_into_the_greedy_one_where_whole_runs_say_so(tmp_path, monkeypatch, faster):
    """Two layers alike up to tensor names, the BLP fusing each (A1, B1), (A2, B2), the greedy
    plan none: two regions where the plans differ, alike, so one group raced once (a race set to
    find the program with them faster or not) and taken together, or left as the greedy plan
    has them. Either program computes the same values."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _two_layers(db)

    def in_place(programs, rounds=6):
        times = in_place_times(programs, rounds)
        for run, per_step in zip(programs, times):
            for i, step in enumerate(run.steps):
                per_step[i] = [0.5 if list(nested_scopes(step.kernel.expr)) else 1.0]
        return times

    monkeypatch.setattr(orchestrate_module, "in_place_times", in_place)
    blp = orchestrate(program, {"B2"}, db, max_primitives=2)
    assert [k.primitives for k in blp[1].shared] == [("A1", "B1"), ("A2", "B2")]
    races = []

    def race(programs, baseline):
        races.append([len(p.steps) for p in programs.values()])
        ratio = (0.9, 0.95, 0.99) if faster else (0.99, 1.0, 1.01)
        return Race(baseline, {name: 1.0 for name in programs}, {"with": ratio}, 8, 0.95, {"with": (ratio[1],) * 8})

    settled, plan = orchestrate_module.settled(program, blp, (program, Orchestration("greedy")), race, race)
    assert races == [[4, 2]]  # the greedy program, then the one with both layers fused
    # the rounds of that race, which compared the result with the greedy program, where it took the group
    assert plan.evidence == ({"greedy": (0.95,) * 8} if faster else {})
    ratio = [2, *((0.9, 0.95, 0.99) if faster else (0.99, 1.0, 1.01))]
    settling = {"regions": 2, "groups": 1, "raced": 1, "taken": 2 if faster else 0, "unmixable": 0, "ratios": [ratio]}
    assert plan.figures["settled_blp"] == {"against": "greedy"} | settling
    assert len(settled.steps) == (2 if faster else 4)
    assert [k.primitives for k in plan.shared] == ([("A1", "B1"), ("A2", "B2")] if faster else [])
    assert "the blp plan settled against the greedy plan: 2 regions where they differ" in plan.describe()
    x = np.random.default_rng(0).uniform(-1, 1, (16, 16)).astype(np.float32)
    np.testing.assert_allclose(settled.run({"X": x})["B2"], 2 * np.exp(2 * np.exp(x)), rtol=1e-5)


@pytest.mark.parametrize(
    "races, taken",
    [
        ([(0.98, 0.99, 0.994)], True),  # below 1 by more than the margin: one race is enough
        ([(0.99, 1.0, 1.01)], False),  # not below 1: not taken, not raced again
        ([(0.99, 0.997, 0.999), (0.99, 0.996, 0.998)], True),  # below 1 by less, twice
        ([(0.99, 0.997, 0.999), (0.995, 1.0, 1.005)], False),  # below 1 by less, then not
        ([(0.99, 0.997, 1.002)], False),  # undecided, its median within the margin: not raced again
        ([(0.97, 0.98, 1.003), (0.98, 0.99, 0.998)], True),  # undecided, its median beyond: again, below 1
        ([(0.97, 0.98, 1.003), (0.97, 0.98, 1.001)], False),  # undecided twice: not taken
    ],
)
def test_a_change_surely_faster_by_less_than_the_margin_is_raced_again(races, taken):
    """``surely_faster`` takes a change whose race puts it below 1 by more than
    ``SETTLE_MARGIN``; below 1 by less, only where a second race puts it below 1 too. A change
    not below 1 is not raced again, unless the race's median lay below 1 by more than the
    margin (the race ended undecided): then a second race decides. Returns the ratios of the
    races it ran."""
    program = parse_program("Y = L i:4 ; 2 * X[i]\nreturn Y", {"X": (4,)})
    asked = iter(races)

    def race(programs, baseline):
        assert baseline == "without" and set(programs) == {"without", "with"}
        return Race(baseline, {"without": 1.0, "with": 1.0}, {"with": next(asked)}, 8, 0.95)

    assert orchestrate_module.surely_faster(program, program, race) == (taken, races)
    assert next(asked, None) is None  # no race beyond those


@pytest.mark.parametrize("whole_faster", [True, False])
def test_several_groups_of_changes_are_raced_all_at_once_first(whole_faster):
    """A = exp(X), B = A + 1, and two unlike changes (A and B each by a kernel computing the
    same): all of them at once are raced first, in the finer race, and, whole runs surely
    faster with them, taken in that one race; else each group is raced on its own, in the
    settling's race (here the first surely faster, the second not), as before. The program
    computes the same values either way."""
    n = (16, 16)
    a = _step(Kernel("eop", "A", parse("L i:16, j:16 ; exp(X[i, j])", {"X": n})), "tvm", "float32")
    b = _step(Kernel("eop", "B", parse("L i:16, j:16 ; A[i, j] + 1", {"A": n})), "tvm", "float32")
    a2 = _step(Kernel("eop", "A", parse("L i:16, j:16 ; exp(X[i, j]) * 1", {"X": n})), "tvm", "float32")
    b2 = _step(Kernel("eop", "B", parse("L i:16, j:16 ; 1 + A[i, j]", {"A": n})), "tvm", "float32")
    program = CompiledProgram([a, b], {"X": n})
    groups = [[([a2], [a])], [([b2], [b])]]
    verdicts = iter([(0.99, 1.0, 1.01)] if not whole_faster else [(0.9, 0.95, 0.99)])
    asked = []

    def race(programs, baseline):
        asked.append([s.kernel.expr for s in programs["with"].steps])
        ratio = next(verdicts, (0.9, 0.95, 0.99) if len(asked) == 2 else (0.99, 1.0, 1.01))
        return Race(baseline, {name: 1.0 for name in programs}, {"with": ratio}, 8, 0.95, {"with": (len(asked),)})

    finer = []

    def race_all(programs, baseline):
        finer.append(len(asked))
        return race(programs, baseline)

    adopted, figures, evidence = orchestrate_module.adopted_where_faster(
        program, groups, orchestrate_module._spliced, race, race_all
    )
    # the rounds of the race that compared the program returned with the program as given
    assert evidence == ((1,) if whole_faster else (2,))
    assert asked[0] == [a2.kernel.expr, b2.kernel.expr]  # both changes at once, first
    assert finer == [0]  # that race, and only that one, the finer one
    assert figures["whole"] == [2, *((0.9, 0.95, 0.99) if whole_faster else (0.99, 1.0, 1.01))]
    if whole_faster:
        assert len(asked) == 1 and (figures["taken"], figures["raced"]) == (2, 0)
    else:
        assert asked[1:] == [[a2.kernel.expr, b.kernel.expr], [a2.kernel.expr, b2.kernel.expr]]
        assert (figures["taken"], figures["raced"]) == (1, 2)
    assert [s.kernel.expr for s in adopted.steps] == [a2.kernel.expr, b2.kernel.expr if whole_faster else b.kernel.expr]
    x = np.random.default_rng(0).uniform(-1, 1, n).astype(np.float32)
    np.testing.assert_allclose(adopted(X=x), np.exp(x) + 1, rtol=1e-5)


def test_an_unknown_orchestration_is_refused_by_name():
    program = parse_program("Y = L i:4 ; 2 * X[i]\nreturn Y", {"X": (4,)})
    with pytest.raises(ExpressionError, match="unknown orchestration 'fastest'; known: blp, greedy, none"):
        optimize_program(program, {}, orchestration="fastest")


@pytest.mark.parametrize("seeded", [False, True])
def test_the_greedy_plans_kernels_are_candidates_of_any_size(tmp_path, monkeypatch, seeded):
    """A chain of four element-wise primitives with candidates of at most two: the BLP alone
    fuses it in pairs (two kernels); seeded with a kernel that computes all four (as the greedy
    plan's fusions across subprograms do), it takes that one kernel when the primitives' own
    kernels are slow (their times in place set so). The program computes the same values either way."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    n = (16, 16)
    texts = [
        ("A", "exp(X[i, j])", "X"),
        ("B", "2 * A[i, j]", "A"),
        ("C", "B[i, j] + 1", "B"),
        ("D", "3 * C[i, j]", "C"),
    ]
    steps = [
        _step(Kernel("eop", out, parse(f"L i:16, j:16 ; {body}", {read: n})), "tvm", "float32")
        for out, body, read in texts
    ]
    program = CompiledProgram(steps, {"X": n})
    program.measure(db)
    whole = _step(fused_kernel(Primitives.of([s.kernel for s in steps]), range(4)), "tvm", "float32")
    seeds = [(("A", "B", "C", "D"), whole)] if seeded else []
    monkeypatch.setattr(orchestrate_module, "in_place_times", _primitives_take(1.0))
    orchestrated, plan = orchestrate(program, {"D"}, db, max_primitives=2, seeds=seeds)
    if seeded:
        assert [k.primitives for k in plan.shared] == [("A", "B", "C", "D")] and len(orchestrated.steps) == 1
        assert plan.figures["seeded"] == 1 and "1 of them the greedy plan's" in plan.describe()
        assert plan.figures["greedy_seconds"] == plan.figures["seconds"] < 1.0  # the seed, timed in place
    else:
        assert [k.primitives for k in plan.shared] == [("A", "B"), ("C", "D")] and plan.figures["seeded"] == 0
        assert "greedy_seconds" not in plan.figures
    x = np.random.default_rng(0).uniform(-1, 1, n).astype(np.float32)
    np.testing.assert_allclose(orchestrated(X=x), 3 * (2 * np.exp(x) + 1), rtol=1e-5)


def test_a_product_and_its_epilogue_share_a_generated_kernel(tmp_path, monkeypatch):
    """A matched product (here a BLAS call) and the bias and activation after it are one
    candidate, generated as one kernel that runs the activation on each tile of sums; the BLP
    takes it when the two kernels apart are slower (their times in place set so). The program
    computes the same values."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    product = parse("L i:32, j:48 ; S k:64 ; X[i, k] * W[k, j]", {"X": (32, 64), "W": (64, 48)})
    kind, match = match_operator(product)
    epilogue = parse("L i:32, j:48 ; max(Y[i, j] + B[j], 0)", {"Y": (32, 48), "B": (48,)})
    steps = [
        _step(Kernel(kind, "Y", product, match), "blas", "float32"),
        _step(Kernel("eop", "Z", epilogue), "tvm", "float32"),
    ]
    program = CompiledProgram(steps, {"X": (32, 64), "W": (64, 48), "B": (48,)})
    program.measure(db)
    monkeypatch.setattr(orchestrate_module, "in_place_times", _primitives_take(1.0))
    orchestrated, plan = orchestrate(program, {"Z"}, db)
    assert kind == "matmul" and [k.primitives for k in plan.shared] == [("Y", "Z")]
    assert [s.kernel.kind for s in orchestrated.steps] == ["eop"]
    rng = np.random.default_rng(0)
    x, w, b = (rng.uniform(-1, 1, s).astype(np.float32) for s in ((32, 64), (64, 48), (48,)))
    np.testing.assert_allclose(orchestrated(X=x, W=w, B=b), np.maximum(x @ w + b, 0), rtol=1e-4, atol=1e-5)


def test_plans_are_compared_on_indices_in_range_even_into_an_axis_of_one():
    """The inputs plans are compared on are zeros and ones, but an index into an axis of one
    element can only be 0 (LeViT's attention-bias gather under torch.compile, where its index
    table is a graph input): 1 there raised instead of comparing."""
    table, ids = Tensor("T", (3, 1)), Tensor("I", (1, 8))
    steps = [
        _step(Kernel("opaque", "G", Opaque("gather", (table, ids), (("axis", 1),))), "opaque", "float32"),
        _step(Kernel("eop", "Y", parse("L i:3, j:1, k:8 ; 2 * G[i, j, k]", {"G": (3, 1, 8)})), "tvm", "float32"),
    ]
    program = CompiledProgram(steps, {"T": (3, 1), "I": (1, 8)})
    plans = {"greedy": (program, orchestrate_module.Orchestration("greedy"))}
    assert list(orchestrate_module.agreeing(plans, program, {"Y"})) == ["greedy"]


def test_a_plan_that_computes_something_else_than_its_kernels_apart_is_left_out(tmp_path):
    """Each plan's program is run against the stitched one on the same inputs before the race:
    a plan whose B comes out wrong (its kernel bound to a call that writes zeros, as a fault
    between verified kernels would) is left out, with a warning naming B; where no plan is
    left, none is returned (``CpuBackend.orchestrate`` then keeps the stitched program)."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)

    def zeros(values, out):
        out[...] = 0

    broken = replace(
        program,
        steps=[replace(s, call=zeros) if s.kernel.output == "B" else s for s in program.steps],
        buffers={},
    )
    plans = {
        "blp": (broken, orchestrate_module.Orchestration("blp")),
        "greedy": (program, orchestrate_module.Orchestration("greedy")),
    }
    with pytest.warns(RuntimeWarning, match="the blp program computes B unlike the kernels it fuses"):
        assert list(orchestrate_module.agreeing(plans, program, {"B", "C"})) == ["greedy"]
    with pytest.warns(RuntimeWarning, match="computes B"):
        assert orchestrate_module.agreeing({"blp": plans["blp"]}, program, {"B", "C"}) == {}


def _paused(step, seconds: float = 0.002):
    def run(values, out):
        time.sleep(seconds)
        step.call(values, out)

    return replace(step, call=run)


def test_kernels_that_recompute_a_primitive_taken_apart_make_it_once(tmp_path, monkeypatch):
    """The BLP computes A twice, inside B's kernel and C's; where the program runs them both
    are slower than their primitives apart (a pause added to each), so the race in place takes
    both apart, and A, a primitive of each, is made once: made twice, it was one name for two
    planned buffers, and what read the first read the second's (wrong only with buffers
    planned: BERT-base's BLP plan was twice left out by the check before the race so)."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    monkeypatch.setattr(orchestrate_module, "in_place_times", _primitives_take(1.0))
    orchestrated, plan = orchestrate(program, {"B", "C"}, db)
    assert plan.recomputed == {"A": 2}
    slow = replace(orchestrated, steps=[_paused(s) for s in orchestrated.steps], buffers={})
    raced, plan = orchestrate_module.race_shared_in_place(program, slow, plan)
    assert [s.kernel.output for s in raced.steps] == ["A", "B", "C"] and plan.figures["apart_in_place"] == 2
    x = np.random.default_rng(0).uniform(-1, 1, (16, 16)).astype(np.float32)
    np.testing.assert_allclose(raced(X=x), np.exp(x) + 1, rtol=1e-5)
    np.testing.assert_allclose(raced.run({"X": x}, outputs=("B",))["B"], 2 * np.exp(x), rtol=1e-5)


def test_a_program_that_makes_a_tensor_twice_is_refused():
    steps = [_step(Kernel("eop", "A", parse("L i:4 ; exp(X[i])", {"X": (4,)})), "tvm", "float32")] * 2
    with pytest.raises(RuntimeError, match="a program makes A more than once"):
        plan_buffers(steps, set())


def _raced(seconds: dict, asked: list):
    """A whole-run race that times nothing: each program's seconds as given, its ratio to the
    baseline's an interval of +-5% around their quotient; ``asked`` records each race."""

    def race(programs, baseline):
        asked.append((list(programs), baseline))
        ratios = {m: tuple(seconds[m] / seconds[baseline] * f for f in (0.95, 1.0, 1.05)) for m in programs}
        return Race(baseline, {m: seconds[m] for m in programs}, ratios, rounds=8, confidence=0.95)

    return race


@pytest.mark.parametrize("blp_s", [0.0005, 0.00099, 0.002])
def test_the_blp_plan_is_kept_where_its_whole_runs_are_surely_faster_than_the_greedy_ones(tmp_path, blp_s):
    """The BLP's plan (A computed twice, inside B's and C's kernels) and the greedy one (three
    kernels) raced end to end, the greedy plan the baseline: the BLP's is kept only where its
    time over the greedy one's, round by round, lies below 1 across its interval (half the
    greedy plan's time), not where it is faster by less than the race can tell (1%) or
    slower; the kept plan's figures hold every plan's and the race's. Two plans with the same
    kernels are one program and are not raced."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(orchestrate_module, "in_place_times", _primitives_take(1.0))  # the BLP fuses
        blp = orchestrate(program, {"B", "C"}, db)
    greedy = (program, orchestrate_module.Orchestration("greedy", figures={"fusions": 0}))
    asked = []
    race = _raced({"blp": blp_s, "greedy": 0.001}, asked)
    kept = orchestrate_module.faster_end_to_end({"blp": blp, "greedy": greedy}, ("blp", "greedy"), race=race)
    assert kept["greedy"][0] is program and kept["greedy"][1].method == "greedy"  # its own: nothing it weighs is faster
    kept, plan = kept["blp"]
    faster = "blp" if blp_s == 0.0005 else "greedy"
    assert asked == [(["blp", "greedy"], "greedy")]  # one race for both methods
    assert kept is {"blp": blp, "greedy": greedy}[faster][0] and plan.method == faster
    assert plan.figures["end_to_end_ms"] == {"blp": round(blp_s * 1e3, 3), "greedy": 1.0}
    assert plan.figures["end_to_end_vs"]["blp"][1] == round(blp_s / 0.001, 4)
    assert plan.figures["end_to_end_baseline"] == "greedy" and plan.figures["end_to_end_rounds"] == 8
    assert plan.figures["variables"] == blp[1].figures["variables"] and plan.figures["fusions"] == 0
    assert f"kept the {faster} plan" in plan.describe() and "8 rounds in turns" in plan.describe()
    same = (replace(program), orchestrate_module.Orchestration("greedy"))
    kept = orchestrate_module.faster_end_to_end(
        {"blp": (program, blp[1]), "greedy": same}, ("blp", "greedy"), race=None
    )
    assert [(kept[m][0], kept[m][1].method) for m in kept] == [(program, "blp"), (same[0], "greedy")]
    assert "end_to_end_ms" not in kept["blp"][1].figures


@pytest.mark.parametrize(
    "last, kept",
    [
        ((0.99, 1.0, 1.01), "blp"),  # undecided alone, faster with the settling's rounds
        ((1.01, 1.01, 1.01), "greedy"),  # its own race surely slower: not kept, whatever came before
    ],
)
def test_the_end_to_end_race_pools_its_rounds_with_the_settlings_races_of_the_same_two(tmp_path, last, kept):
    """The BLP's plan settled on the greedy one with races of the two as they stand (its
    ``evidence``: 60 rounds at 0.99): the end-to-end race's own rounds (20, spread around 1 or
    all above it) join them, and the pooled interval decides, unless that race alone puts the
    plan surely slower. The figures say what was pooled."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    other = replace(program, steps=[program.steps[0], program.steps[2], program.steps[1]], buffers={})
    blp = (other, orchestrate_module.Orchestration("blp", evidence={"greedy": (0.99,) * 60}))
    greedy = (program, orchestrate_module.Orchestration("greedy"))
    own = (0.99, 1.0, 1.01) * 6 + (1.0, 1.0) if last[0] < 1 else (1.01,) * 20

    def race(programs, baseline):
        ratios = {"blp": last, "greedy": (1.0, 1.0, 1.0)}
        return Race(baseline, {m: 0.001 for m in programs}, ratios, 20, 0.95, {"blp": own, "greedy": (1.0,) * 20})

    plan = orchestrate_module.faster_end_to_end({"blp": blp, "greedy": greedy}, ("blp",), race=race)["blp"][1]
    assert plan.method == kept
    rounds, low, median, high = plan.figures["end_to_end_pooled"]["blp"]
    assert rounds == 80 and high < 1 and median == 0.99
    assert "blp pooled with its settling's races, 80 rounds: 0.990x" in plan.describe()


def test_whole_runs_are_raced_on_zeros_each_against_the_baseline(tmp_path):
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    blp = orchestrate(program, {"B", "C"}, db)[0]
    raced = race_whole({"blp": blp, "greedy": program}, "greedy", min_rounds=6, max_rounds=6)
    assert raced.rounds == 6 and set(raced.seconds) == {"blp", "greedy"}
    assert raced.ratios["greedy"] == (1.0, 1.0, 1.0) and all(t > 0 for t in raced.seconds.values())
    low, median, high = raced.ratios["blp"]
    assert 0 < low <= median <= high


def test_a_race_of_whole_runs_looks_at_its_clock_only_after_its_first_rounds(tmp_path):
    """A long program's race (ViT-Base: 210 ms a run) would otherwise stop on its seconds
    after a dozen rounds, a median too loose to tell 2% apart: out of time from the start, the
    race still runs ``WHOLE_RACE_ROUNDS`` rounds, where a race of kernels stops at 8."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    blp = orchestrate(program, {"B", "C"}, db)[0]
    assert race_whole({"blp": blp, "greedy": program}, "greedy", max_seconds=0).rounds == WHOLE_RACE_ROUNDS
    assert race_whole({"blp": blp, "greedy": program}, "greedy", max_seconds=0, min_rounds=8).rounds == 8


def test_a_whole_run_is_set_over_its_kernels_summed_in_the_run_after_it(tmp_path, monkeypatch):
    """On a clock that ticks once per reading, a plain run reads it twice (one tick); a
    watched run times a kernel called from Python over two readings (one tick) and one the
    native loop calls by that loop's clock (here one tick a call): a program of three kernels
    comes out a third, in every round, so the interval is that too."""
    program = _program(MeasurementDB(tmp_path / "m.sqlite"))
    ticks = itertools.count()
    monkeypatch.setattr(program_module, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    monkeypatch.setattr(program_module.NativeRun, "seconds", lambda self: [1.0] * len(self.labels))
    assert outside_kernels(program, rounds=12) == (1 / 3, 1 / 3, 1 / 3)


@pytest.mark.parametrize("faster", ["blp", "none"])
def test_the_kernels_as_stitched_are_kept_where_every_plan_runs_slower_whole(tmp_path, monkeypatch, faster):
    """A = exp(X), B = 2 A across a subprogram boundary: the BLP (its primitives' own kernels
    timed slow here) and the greedy pass (the fused kernel's stored time fast) both fuse A into
    B, one program; the stitched program, two kernels, races them end to end too, and is
    kept where its whole run measures faster (the measured seconds set here, both ways). The
    values are the same either way."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    program = _program(db)
    program = replace(program, steps=program.steps[:2], buffers={}).prepare()
    a, b = program.kernels
    db.put(_step(fuse(a, b), "tvm", "float32").signature("float32"), Timing(1e-9, 0.0, 1, False))
    monkeypatch.setattr(orchestrate_module, "in_place_times", _primitives_take(1.0))
    monkeypatch.setattr(backend_module, "race_shared_in_place", lambda stitched, fused, plan: (fused, plan))
    monkeypatch.setattr(backend_module, "settled", _settled_as_faster)
    asked = []
    race = _raced({method: 0.001 if method == faster else 0.002 for method in ("blp", "none")}, asked)
    monkeypatch.setattr(
        backend_module,
        "faster_end_to_end",
        lambda plans, methods: orchestrate_module.faster_end_to_end(plans, methods, race=race),
    )
    kept, plan = CpuBackend(db=db).orchestrations(program, {"B"}, {"A"}, ("blp",))["blp"]
    assert asked == [(["blp", "none"], "blp")]  # the greedy program is the BLP's: raced once, as the baseline
    assert plan.method == faster and len(kept.steps) == {"blp": 1, "none": 2}[faster]
    assert plan.figures["end_to_end_ms"] == {
        "blp": 2.0 if faster == "none" else 1.0,
        "none": 1.0 if faster == "none" else 2.0,
    }
    assert plan.figures["variables"] > 0  # the BLP's figures, whichever program is kept
    assert ("kept the kernels as stitched" in plan.describe()) == (faster == "none")
    x = np.random.default_rng(0).uniform(-1, 1, (16, 16))
    np.testing.assert_allclose(kept(X=x), 2 * np.exp(x), rtol=1e-5)


def _settled_as_faster(stitched, ours, theirs):
    """``settled`` with every region's whole runs faster (a race set so)."""

    def race(programs, baseline):
        return Race(baseline, {name: 1.0 for name in programs}, {"with": (0.9, 0.95, 0.99)}, 8, 0.95)

    return orchestrate_module.settled(stitched, ours, theirs, race, race)


@pytest.mark.parametrize("slow, whole", [("derived", True), ("runner-up", True), ("derived", False)])
def test_a_subprogram_that_runs_slower_than_its_runner_up_where_the_program_runs_it_is_replaced(slow, whole):
    """Subprogram A derived as a weight-only kernel and a product (A = exp(X) * W2, W2 = 2 W),
    its runner-up one kernel (A = exp(X) * 2 W); B = A + 1 reads it. Whichever is slower where
    the program runs (a pause added to its kernel) loses the race, the runner-up replacing the
    derived kernels whole, the derived one's weight-only output dropped with them, where whole
    runs with it are faster too (``whole``: else a race set to find them not faster keeps the
    derived kernels); the program computes the same values either way."""
    n = (16, 16)

    def step(output, body, reads, weight_only=False):
        kernel = Kernel("eop", output, parse(f"L i:16, j:16 ; {body}", {r: n for r in reads}), weight_only=weight_only)
        return _step(kernel, "tvm", "float32")

    derived = [step("A_w2", "2 * W[i, j]", ["W"], True), step("A", "exp(X[i, j]) * A_w2[i, j]", ["X", "A_w2"])]
    other = [step("A", "exp(X[i, j]) * (2 * W[i, j])", ["X", "W"])]
    after = [step("B", "A[i, j] + 1", ["A"])]
    if slow == "derived":
        derived[1] = _paused(derived[1])
    else:
        other[0] = _paused(other[0])
    w = np.random.default_rng(1).uniform(-1, 1, n).astype(np.float32)
    stitched = CompiledProgram([*derived, *after], {"X": n}).bind({"W": w})
    runner_up = CompiledProgram(other, {"X": n}).bind({"W": w})
    races = []

    def race(programs, baseline):  # whole runs with the runner-up: surely faster, or not (set so)
        races.append(list(programs))
        ratio = (0.9, 0.95, 0.99) if whole else (0.99, 1.0, 1.01)
        return Race(baseline, {name: 1.0 for name in programs}, {"with": ratio}, 8, 0.95)

    raced, taken = orchestrate_module.race_runners_up(stitched, {"A": [runner_up]}, {"A", "B"}, race, race)
    outputs = [s.kernel.output for s in raced.steps]
    replaced = slow == "derived" and whole
    assert (taken, outputs) == ((1, ["A", "B"]) if replaced else (0, ["A_w2", "A", "B"]))
    assert ("A_w2" in raced.constants) == (not replaced)
    assert races == ([["without", "with"]] if slow == "derived" else [])  # raced whole only where it won in place
    x = np.random.default_rng(0).uniform(-1, 1, n).astype(np.float32)
    np.testing.assert_allclose(raced(X=x), np.exp(x) * 2 * w + 1, rtol=1e-5)


def test_describe_prints_kernels_alike_up_to_tensor_names_once():
    """A repeated layer's fused kernels (twelve in BERT-base) are one line and their outputs:
    alike by the digest of their form, which equal kernels over other tensors share."""
    shapes = {name: (4,) for name in "XYUV"}
    kernels = [
        Kernel("eop", "A2", parse("L i:4 ; exp(X[i]) + Y[i]", shapes)),
        Kernel("eop", "B2", parse("L i:4 ; exp(U[i]) + V[i]", shapes)),
        Kernel("eop", "C2", parse("L i:4 ; exp(U[i]) * V[i]", shapes)),
    ]
    forms = [orchestrate_module._form_digest(k) for k in kernels]
    assert forms[0] == forms[1] != forms[2]
    shared = [SharedKernel(k.output, ("P", k.output), 1e-3, 2e-3, form=f) for k, f in zip(kernels, forms)]
    text = Orchestration("blp", shared).describe()
    assert "A2 computes P, A2" in text and "and 1 more alike: B2" in text and "B2 computes" not in text
    assert "C2 computes P, C2" in text and "more alike: C2" not in text
    # a plan saved before forms were recorded prints each kernel
    assert "B2 computes" in Orchestration("blp", [replace(k, form="") for k in shared]).describe()
    assert Orchestration.from_json(Orchestration("blp", shared).to_json()).describe() == text
