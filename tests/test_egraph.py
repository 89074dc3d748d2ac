"""The e-graph layer: the language table, insertion, unions, congruence, native rules, extraction,
and the egglog-python internals the adapter relies on."""

from __future__ import annotations

import sys
import time

import pytest
from egglog import rewrite, ruleset, vars_
from hypothesis import given, settings

from rewriter import ExpressionError, Iterator, Lit, Num, Scope, Tensor, Var, parse
from rewriter.egraph import CONSTRUCTORS, ExpressionGraph, IndexTerm, ScalarTerm, adapter, eager_rules
from rewriter.egraph import graph as graph_module
from rewriter.egraph.language import SCOPE, SHARED, Fold, text_app, text_lit
from rewriter.ir import Binary, IndexNeg, IndexOp
from rewriter.testing.strategies import expressions

SHAPES = {"A": (5, 6), "B": (2, 4), "T": (4,), "X": (8, 8)}

TEXTS = [
    "L i:4 ; T[i]",
    "L i:2, j:4 ; S k:6 ; A[i, k] * B[i, j]",
    "L i:-1..3, j:2 ; S k:4 ; { L a:1..5, b:4 ; M c:2 ; max(A[a, b+c], 0) }[i+1, k] * B[j, k]",
    "L i:8, j:3 ; -A[i/2, (i+1)%3] * (B[-j+2] - -1.5) / sqrt(exp(B[j*-1]))",
    "L i:4 ; M j:8 ; X[i*2, j] + 1e-05",
    "L i:4 ; T[i-(2-5)] * 1e+300 + 0.1 - 2.5e-20",
    "L i:4 ; { L p:4 ; { L q:4 ; relu(T[q]) * 0.5 }[p] }[i] + T[-(-i)]",
]


def scopes():
    shapes = dict(SHAPES)
    shapes["B"] = (3,)
    return [parse(text, shapes if "B[-j+2]" in text or "B[j*-1]" in text else SHAPES) for text in TEXTS]


def round_trip(expr: Scope) -> Scope:
    """IR -> egglog text (the table's writer) -> e-graph -> extracted TermDag -> IR (its reader)."""
    graph = ExpressionGraph()
    return graph.extract(graph.add(expr))


# ---------------------------------------------------------------------------------------------
# The language: one table, one writer, one reader


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_round_trip_of_parsed_scopes(index):
    expr = scopes()[index]
    assert Fold(text_app, text_lit)(SCOPE, expr).startswith("(MkScope ")
    assert round_trip(expr) == expr


def test_round_trip_of_hand_built_trees():
    t = Tensor("T", (4,))
    i = Var("i")
    bodies = [
        t[IndexNeg(Lit(-3))],  # negative constant under a negation
        t[IndexOp("/", i, IndexOp("+", Lit(1), Lit(1)))],  # constant, non-literal divisor
        t[IndexOp("%", IndexOp("-", i, Lit(-2)), Lit(3))],
        Binary("max", t[i], Num(-0.25)),
        Num(1.2345678901234567) * t[i],
        Num(5e-324) + t[i],  # smallest subnormal
        Num(1.7976931348623157e308) * t[i],
        t[Lit(2**63 - 1)] + t[Lit(-(2**63))],  # the ends of egglog's i64
    ]
    for body in bodies:
        expr = Scope((Iterator("i", -2, 2),), (), body)
        assert round_trip(expr) == expr
    rank0 = Scope((), (), Tensor("Z", ())[()] * 2)
    assert round_trip(rank0) == rank0


@settings(max_examples=40, deadline=None)
@given(expressions())
def test_round_trip_of_random_scopes(expr):
    assert round_trip(expr) == expr


def test_what_egglog_cannot_hold_is_refused():
    graph = ExpressionGraph()
    with pytest.raises(ExpressionError, match="i64"):
        graph.add(Scope((), (), Tensor("T", (4,))[Lit(2**63)]))
    with pytest.raises(ExpressionError, match="Scope"):
        graph.add("L i:4 ; T[i]")


def test_every_row_of_the_table_is_declared_under_its_name():
    def declared(egraph) -> set[str]:
        raw = adapter.bindings_egraph(egraph)
        (output,) = raw.run_program(*raw.parse_program("(print-size)"))
        return {name for name, _ in output.sizes}

    assert set(CONSTRUCTORS) <= ExpressionGraph().on_egglog(declared)
    assert repr(CONSTRUCTORS["IAdd"]) == "(IAdd Index Index)" and repr(CONSTRUCTORS["IxNil"]) == "(IxNil)"


# ---------------------------------------------------------------------------------------------
# The graph


def test_add_is_idempotent_and_union_makes_equivalent():
    graph = ExpressionGraph()
    a, b, c = scopes()[:3]
    ha = graph.add(a)
    assert graph.add(parse(str(a), SHAPES)) == ha  # an equal scope, another object
    hb, hc = graph.add(b), graph.add(c)
    assert len({ha, hb, hc}) == 3 and graph.handle(b) == hb
    assert not graph.equivalent(ha, hb)
    graph.union(a, hb)
    assert graph.equivalent(ha, b) and graph.equivalent(b, a)
    assert not graph.equivalent(a, c)
    assert graph.stats.terms_added == 3 and graph.stats.unions == 1 and graph.stats.commands_sent == 4


def test_a_new_scope_unioned_goes_into_the_other_ones_class():
    graph = ExpressionGraph()
    a, b, c = scopes()[:3]
    graph.union(a, b)  # two scopes, one command each
    graph.union(c, a)
    assert graph.handle(a) == graph.handle(b) == graph.handle(c)
    assert graph.equivalent(b, c) and graph.stats.commands_sent == 3
    graph.union(b, c)  # already one class: nothing to send
    assert graph.stats.commands_sent == 3


def test_a_scope_not_added_is_equivalent_to_nothing():
    graph = ExpressionGraph()
    a, b = scopes()[:2]
    graph.add(a)
    assert not graph.equivalent(a, b) and not graph.equivalent(b, b)
    assert graph.handle(b) is None and graph.lookup(b) is None


def test_congruence_through_nested_scopes():
    inner1 = parse("L p:4 ; T[p] * 2", SHAPES)
    inner2 = parse("L p:4 ; 2 * T[p]", SHAPES)
    outer1 = Scope((Iterator("i", 0, 4),), (), inner1[Var("i")] + 1)
    outer2 = Scope((Iterator("i", 0, 4),), (), inner2[Var("i")] + 1)
    graph = ExpressionGraph()
    h1, h2 = graph.add(outer1), graph.add(outer2)
    assert not graph.equivalent(h1, h2)
    graph.union(inner1, inner2)  # inner scopes are added now, after their parents
    assert graph.equivalent(h1, h2)


def test_size_counts_nodes_and_classes():
    graph = ExpressionGraph()
    assert graph.size() == (0, 0)
    graph.add(parse("L i:4 ; T[i]", SHAPES))
    # MkScope, 2 ItNil.. (shared), ItCons, It, Access, Input, IxCons, IxNil, IVar
    nodes, classes = graph.size()
    assert nodes == classes == 9
    graph.union(parse("L i:4 ; T[i]", SHAPES), parse("L j:4 ; T[j]", SHAPES))
    nodes, classes = graph.size()
    assert (nodes, classes) == (9 + 6, 9 + 5)  # new It, ItCons, Access, IxCons, IVar, MkScope; one class merged
    assert graph.size(classes=False) == (nodes, None)


def test_handles_reject_garbage():
    graph = ExpressionGraph()
    with pytest.raises(ExpressionError):
        graph.union("not a handle", 0)
    with pytest.raises(ExpressionError):
        graph.eclass(5)
    assert graph.eclass(graph.add(parse("L i:4 ; T[i]", SHAPES))) is not None


# ---------------------------------------------------------------------------------------------
# Native rules


def _read(index) -> Scope:
    """A scope that reads T at ``index`` (an Index over iterator i)."""
    return Scope((Iterator("i", 0, 4),), (), Tensor("T", (4,))[index])


def test_eager_rules_fold_index_identities():
    graph = ExpressionGraph()
    messy, clean = _read(IndexOp("+", Var("i"), Lit(0))), _read(Var("i"))
    graph.add(messy)
    assert not graph.equivalent(messy, clean)
    graph.run(eager_rules)
    assert graph.equivalent(messy, clean)


@pytest.mark.parametrize(
    "index, value",
    [
        (IndexOp("*", Lit(3), IndexOp("-", Lit(7), IndexNeg(Lit(2)))), 27),
        (IndexOp("/", Lit(-7), Lit(2)), -4),  # floor division
        (IndexOp("%", Lit(-7), Lit(2)), 1),  # floor remainder
        (IndexOp("%", Lit(7), Lit(3)), 1),
        (IndexOp("*", Lit(0), Var("i")), 0),
    ],
)
def test_eager_rules_fold_constants_with_floor_semantics(index, value):
    graph = ExpressionGraph()
    graph.add(_read(index))
    graph.run(eager_rules, 4)
    assert graph.equivalent(_read(index), _read(Lit(value)))


def test_eager_rules_simplify_scopes_and_extraction_picks_the_simplest():
    graph = ExpressionGraph()
    messy = parse("L i:4 ; T[i*1+0] * 1 + 0", SHAPES)
    clean = parse("L i:4 ; T[i]", SHAPES)
    handle = graph.add(messy)
    assert graph.extract(handle) == messy
    graph.run(eager_rules.saturate())
    assert graph.equivalent(messy, clean)
    assert graph.extract(handle) == clean
    scope, cost = graph.extract(messy, include_cost=True)
    assert scope == clean and cost > 0


def test_no_associativity_or_commutativity_in_eager_rules():
    graph = ExpressionGraph()
    graph.add(parse("L i:4, j:4, k:4 ; X[i+j+k, k+j+i]", SHAPES))
    before = graph.size()
    graph.run(eager_rules, 10)
    assert graph.size() == before
    assert not graph.equivalent(
        parse("L i:4, j:4, k:4 ; X[i+j+k, k+j+i]", SHAPES), parse("L i:4, j:4, k:4 ; X[j+i+k, k+j+i]", SHAPES)
    )


def test_python_written_rules_run_on_text_inserted_terms():
    graph = ExpressionGraph()
    x, y = vars_("x y", IndexTerm)
    commute = ruleset(rewrite(IndexTerm.add(x, y)).to(IndexTerm.add(y, x)), name="commute_test")
    a = parse("L i:4, j:2 ; X[i+j, j]", SHAPES)
    b = parse("L i:4, j:2 ; X[j+i, j]", SHAPES)
    graph.add(a)
    graph.add(b)
    assert not graph.equivalent(a, b)
    graph.run(commute)
    assert graph.equivalent(a, b)


def test_rules_registered_without_a_ruleset_run_as_the_default_ruleset():
    graph = ExpressionGraph()
    (s,) = vars_("s", ScalarTerm)
    graph.register(rewrite(ScalarTerm.unary("relu", ScalarTerm.unary("relu", s))).to(ScalarTerm.unary("relu", s)))
    messy, clean = parse("L i:4 ; relu(relu(T[i]))", SHAPES), parse("L i:4 ; relu(T[i])", SHAPES)
    graph.add(messy)
    graph.run("")
    assert graph.equivalent(messy, clean)


def test_lookup_finds_rule_built_scopes_without_adding():
    graph = ExpressionGraph()
    messy = parse("L i:4 ; { L p:4 ; T[p+0] }[i*1]", SHAPES)
    clean = parse("L i:4 ; { L p:4 ; T[p] }[i]", SHAPES)
    graph.add(messy)
    assert graph.lookup(clean) is None
    graph.run(eager_rules, 3)
    before = graph.size()
    assert graph.lookup(clean) == graph.eclass(messy) is not None
    assert graph.handle(clean) is None and graph.size() == before  # looked up, not added


# ---------------------------------------------------------------------------------------------
# Extraction (egglog's default costs; by kernel costs: tests/test_extract.py)


def test_extraction_returns_an_inserted_scope():
    graph = ExpressionGraph()
    exprs = scopes()
    for expr in exprs:
        assert graph.extract(graph.add(expr)) == expr
    graph.union(exprs[0], exprs[1])
    assert graph.extract(exprs[1]) == exprs[0]  # the smaller of the two
    assert graph.stats.extract_seconds > 0


# ---------------------------------------------------------------------------------------------
# egglog-python internals (rewriter.egraph.adapter)


@pytest.mark.parametrize("internal", sorted(adapter.INTERNALS))
def test_the_egglog_internals_the_adapter_relies_on_are_there(internal):
    """Fails with adapter.EgglogChanged, naming the internal, when an egglog upgrade moves it."""
    adapter.INTERNALS[internal]()


def test_a_missing_internal_is_named():
    class Changed:  # what EGraph would be if egglog-python renamed _egraph
        pass

    with pytest.raises(adapter.EgglogChanged, match=r"EGraph\._egraph"):
        adapter.bindings_egraph(Changed())  # type: ignore[arg-type]


def test_lists_are_written_once_and_then_by_handle():
    shapes = {"T": (4, 3), "U": (3, 4)}
    a, b = parse("L i:4, j:3 ; T[i, j] * U[j, i]", shapes), parse("L i:4, j:3 ; T[i, j] + U[j, i]", shapes)
    writer = Fold(text_app, text_lit, shared=SHARED)
    writer(SCOPE, a)
    assert [d[1] for d in writer.take_definitions()] == [a.traversal, a.body.lhs.indices, a.body.rhs.indices]
    text = writer(SCOPE, b)
    assert writer.take_definitions() == [] and "ItCons" not in text and "(IxRef 1)" in text
    graph = ExpressionGraph()
    graph.add(a)
    graph.add(b)
    assert graph.lookup(b) is not None and not graph.equivalent(a, b)
    assert graph.extract(a) == a and graph.extract(b) == b
    assert graph.size() == (20, 20)  # b adds its MkScope and Binary only; handles are no terms


def test_inserts_are_queued_and_a_refused_one_is_raised_by_the_next_query():
    graph = ExpressionGraph()
    a = scopes()[0]
    graph.add(a)
    graph._insert("(union (Ref 0) (NoSuchConstructor))", 0.0)  # what a writer bug would send
    with pytest.raises(ExpressionError, match="egglog refused"):
        graph.wait()
    assert graph.extract(a) == a  # the error is raised once; the graph answers again
    assert graph.on_egglog(lambda egraph: type(egraph).__name__) == "EGraph"


def test_a_search_ahead_of_egglog_waits_when_the_queue_is_full(monkeypatch):
    """At most BACKLOG inserts wait in the queue (a search stopped by its time limit is not
    held long by egglog catching up): here egglog is kept busy while 40 scopes are added."""
    monkeypatch.setattr(graph_module, "BACKLOG", 2)
    graph = ExpressionGraph()
    depths: list[int] = []
    monkeypatch.setattr(graph._egglog, "_jobs", _Watched(graph._egglog._jobs, depths))
    graph._egglog._jobs.put((graph._egglog, lambda: time.sleep(0.2), None))  # egglog busy for a while
    added = [parse(f"L i:4 ; T[i] * {k}", {"T": (4,)}) for k in range(1, 41)]
    for scope in added:
        graph.add(scope)
    assert max(depths) <= 3 and all(graph.extract(scope) == scope for scope in added)


class _Watched:
    """A job queue that records its length before each insert."""

    def __init__(self, jobs, depths):
        self.jobs, self.depths = jobs, depths

    def qsize(self):
        return self.jobs.qsize()

    def put(self, job):
        if isinstance(job[1], str):
            self.depths.append(self.jobs.qsize())
        self.jobs.put(job)


def test_a_search_alongside_egglog_hands_the_interpreter_over_often_and_restores_it():
    graph = ExpressionGraph()
    before = sys.getswitchinterval()
    with pytest.raises(KeyboardInterrupt):
        with graph.alongside():
            assert sys.getswitchinterval() == pytest.approx(graph_module.SWITCH_INTERVAL)
            raise KeyboardInterrupt  # Ctrl-C in the middle of a level
    assert sys.getswitchinterval() == before
