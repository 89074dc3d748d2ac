"""The e-graph layer: lossless egglog text, insertion, unions, congruence, native rules, extraction."""

from __future__ import annotations

import pytest
from egglog import default_cost_model, eq, get_callable_fn, rewrite, ruleset, vars_
from hypothesis import given, settings
from strategies import expressions

from rewriter import ExpressionError, Iterator, Lit, Num, Scope, Tensor, Var, parse
from rewriter.egraph import (
    ExpressionGraph,
    IndexTerm,
    ScalarTerm,
    ScopeTerm,
    eager_rules,
    from_egglog,
    from_termdag,
    to_egglog,
    to_term,
)
from rewriter.ir import Access, Binary, IndexNeg, IndexOp

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
    out = []
    for text in TEXTS:
        out.append(parse(text, shapes if "B[-j+2]" in text or "B[j*-1]" in text else SHAPES))
    return out


# ---------------------------------------------------------------------------------------------
# Text round trip


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_round_trip_of_parsed_scopes(index):
    expr = scopes()[index]
    text = to_egglog(expr)
    assert text.startswith("(MkScope ")
    assert from_egglog(text) == expr


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
    ]
    for body in bodies:
        expr = Scope((Iterator("i", -2, 2),), (), body)
        assert from_egglog(to_egglog(expr)) == expr, to_egglog(expr)
    rank0 = Scope((), (), Tensor("Z", ())[()] * 2)
    assert from_egglog(to_egglog(rank0)) == rank0


@settings(max_examples=40, deadline=None)
@given(expressions())
def test_round_trip_of_random_scopes(expr):
    assert from_egglog(to_egglog(expr)) == expr


def test_from_egglog_rejects_malformed_text():
    for text in ['(MkScope (ItNil) (ItNil) (Num 1.0) "sum"', "(Foo 1)", '(MkScope (ItNil) (ItNil) (Num 1.0) "sum") x']:
        with pytest.raises(ExpressionError):
            from_egglog(text)


def test_egglog_prints_what_from_egglog_reads():
    """egglog prints floats in plain decimal (1e+300 as 1000...0, without a point)."""
    graph = ExpressionGraph()
    for expr in scopes():
        (output,) = graph.send(f"(extract {to_egglog(expr)})")
        printed = output.termdag.to_string(output.term)
        assert from_egglog(printed) == expr
        assert from_termdag(output.termdag, output.term) == expr


# ---------------------------------------------------------------------------------------------
# The graph


def test_add_is_idempotent_and_union_makes_equivalent():
    graph = ExpressionGraph()
    a, b, c = scopes()[:3]
    ha = graph.add(a)
    assert graph.add(parse(str(a), SHAPES)) == ha  # an equal scope, another object
    hb, hc = graph.add(b), graph.add(c)
    assert len({ha, hb, hc}) == 3 and len(graph) == 3
    assert graph.scope_of(hb) == b
    assert not graph.equivalent(ha, hb)
    graph.union(a, hb)
    assert graph.equivalent(ha, b) and graph.equivalent(b, a)
    assert not graph.equivalent(a, c)
    assert graph.stats.terms_added == 3 and graph.stats.unions == 1 and graph.stats.commands_sent == 4


def test_a_scope_not_added_is_equivalent_to_nothing():
    graph = ExpressionGraph()
    a, b = scopes()[:2]
    graph.add(a)
    assert not graph.equivalent(a, b)
    assert graph.handle(b) is None and len(graph) == 1


def test_congruence_through_nested_scopes():
    inner1 = parse("L p:4 ; T[p] * 2", SHAPES)
    inner2 = parse("L p:4 ; 2 * T[p]", SHAPES)
    outer1 = Scope((Iterator("i", 0, 4),), (), Access(inner1, (Var("i"),)) + 1)
    outer2 = Scope((Iterator("i", 0, 4),), (), Access(inner2, (Var("i"),)) + 1)
    graph = ExpressionGraph(batch_size=4)
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


def test_raw_text_and_handles_mix():
    graph = ExpressionGraph()
    a = parse("L i:4 ; T[i] + 0", SHAPES)
    ha = graph.add(a)
    graph.union(
        ha, '(MkScope (ItCons (It "i" 0 4) (ItNil)) (ItNil) (Access (Input "T" "4") (IxCons (IVar "i") (IxNil))) "sum")'
    )
    assert graph.equivalent(a, parse("L i:4 ; T[i]", SHAPES))
    assert graph.extract(ha) == parse("L i:4 ; T[i]", SHAPES)


# ---------------------------------------------------------------------------------------------
# Native rules


def test_eager_rules_fold_index_identities():
    graph = ExpressionGraph()
    graph.send('(IAdd (IVar "h") (ILit 0))')
    assert not graph.equivalent('(IAdd (IVar "h") (ILit 0))', '(IVar "h")')
    graph.run(eager_rules)
    assert graph.equivalent('(IAdd (IVar "h") (ILit 0))', '(IVar "h")')


@pytest.mark.parametrize(
    "term, value",
    [
        ("(IMul (ILit 3) (ISub (ILit 7) (INeg (ILit 2))))", 27),
        ("(IDiv (ILit -7) (ILit 2))", -4),  # floor division
        ("(IMod (ILit -7) (ILit 2))", 1),  # floor remainder
        ("(IMod (ILit 7) (ILit 3))", 1),
        ('(IMul (ILit 0) (IVar "x"))', 0),
    ],
)
def test_eager_rules_fold_constants_with_floor_semantics(term, value):
    graph = ExpressionGraph()
    graph.send(term)
    graph.run(eager_rules, 4)
    assert graph.equivalent(term, f"(ILit {value})")


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
    graph.add(parse("L i:4, j:4, k:4 ; T[i+j+k] * T[k+j+i]", SHAPES))
    before = graph.size()
    graph.run(eager_rules, 10)
    assert graph.size() == before
    assert not graph.equivalent('(IAdd (IVar "i") (IVar "j"))', '(IAdd (IVar "j") (IVar "i"))')


def test_python_registered_rewrites_run_on_text_inserted_terms():
    graph = ExpressionGraph()
    x, y = vars_("x y", IndexTerm)
    commute = ruleset(rewrite(IndexTerm.add(x, y)).to(IndexTerm.add(y, x)), name="commute_test")
    a = parse("L i:4, j:2 ; X[i+j, j]", SHAPES)
    b = parse("L i:4, j:2 ; X[j+i, j]", SHAPES)
    ha = graph.add(a)
    graph.add(b)
    assert not graph.equivalent(a, b)
    graph.run(commute)
    assert graph.equivalent(a, b)
    graph.egraph.check(eq(graph.expr(a)).to(graph.expr(b)))
    graph.egraph.check(eq(graph.expr(ha)).to(to_term(b)))


# ---------------------------------------------------------------------------------------------
# Extraction


def test_extraction_returns_an_inserted_scope():
    graph = ExpressionGraph()
    exprs = scopes()
    for expr in exprs:
        assert graph.extract(graph.add(expr)) == expr
    graph.union(exprs[0], exprs[1])
    assert graph.extract(exprs[0]) in (exprs[0], exprs[1])
    assert graph.extract(exprs[0]) == exprs[0]  # the smaller of the two
    assert graph.stats.extract_seconds > 0


def test_extraction_with_a_python_cost_model():
    graph = ExpressionGraph()
    small = parse("L i:4 ; T[i]", SHAPES)
    big = parse("L i:4 ; T[i] * 2 + T[i] * 3", SHAPES)
    graph.union(small, big)

    def prefer_binary(egraph, expr, children_costs):  # a Binary node pays -10: the big one wins
        return (-10 if get_callable_fn(expr) == ScalarTerm.binary else 1) + sum(children_costs)

    assert graph.extract(small) == small
    assert graph.extract(small, cost_model=prefer_binary) == big
    default_cost = graph.extract(small, include_cost=True)[1]
    assert graph.extract(small, cost_model=default_cost_model, include_cost=True) == (small, default_cost)


def test_handles_reject_garbage():
    graph = ExpressionGraph()
    with pytest.raises(ExpressionError):
        graph.union("not a handle", "(Ref 0)")
    with pytest.raises(ExpressionError):
        graph.scope_of("(Ref 5)")
    assert isinstance(graph.expr(parse("L i:4 ; T[i]", SHAPES)), ScopeTerm)


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


def test_extract_many_matches_extract():
    graph = ExpressionGraph()
    exprs = scopes()
    handles = graph.add_all(exprs)
    graph.union(exprs[0], exprs[1])
    one_by_one = [graph.extract(h, include_cost=True) for h in handles]
    assert graph.extract_many(handles, include_cost=True) == one_by_one
    assert graph.extract_many(exprs) == [scope for scope, _ in one_by_one]


def test_rules_registered_without_a_ruleset_run_as_the_default_ruleset():
    graph = ExpressionGraph()
    (x,) = vars_("x", IndexTerm)
    graph.register(rewrite(IndexTerm.neg(IndexTerm.neg(x))).to(x))
    graph.send('(INeg (INeg (IVar "q")))')
    graph.run("")
    assert graph.equivalent('(INeg (INeg (IVar "q")))', '(IVar "q")')
