"""Extraction from the e-graph (rewriter.egraph.extract): per e-class choices, combined bottom up."""

import numpy as np
from hypothesis import given, settings

from rewriter import evaluate, parse
from rewriter.egraph import ExpressionGraph, extract
from rewriter.lower import instantiate, postprocess
from rewriter.search import canonical, explore, fingerprint
from rewriter.testing import random_inputs
from rewriter.testing.strategies import expressions


def _text_length(scope, constants=frozenset()) -> float:
    return float(len(str(scope)))


def test_extraction_combines_forms_no_single_state_holds():
    """Each nested scope has a shorter equal form, asserted separately; no term holds both, yet
    extraction by text length returns the root with both."""
    shapes = {"A": (4, 4), "B": (4, 4)}
    s1, s1_short = "L a:4, b:4 ; A[a, b] + A[a, b]", "L a:4, b:4 ; 2 * A[a, b]"
    s2, s2_short = "L a:4, b:4 ; B[b, a] + B[b, a]", "L a:4, b:4 ; 2 * B[b, a]"
    root = parse(f"L i:4, j:4 ; {{ {s1} }}[i, j] * {{ {s2} }}[i, j]", shapes)
    graph = ExpressionGraph()
    graph.add(root)
    graph.union(parse(s1, shapes), parse(s1_short, shapes))
    graph.union(parse(s2, shapes), parse(s2_short, shapes))
    scope, cost = extract(graph, root, _text_length)
    want = parse(f"L i:4, j:4 ; {{ {s1_short} }}[i, j] * {{ {s2_short} }}[i, j]", shapes)
    assert fingerprint(scope) == fingerprint(want)
    assert cost < _text_length(root)
    inputs = random_inputs(root)
    np.testing.assert_allclose(evaluate(scope, inputs), evaluate(root, inputs))


def test_extraction_gives_up_cleanly_at_its_deadline():
    shapes = {"A": (4, 4)}
    root = parse("L i:4, j:4 ; { L a:4, b:4 ; A[a, b] + 1 }[j, i]", shapes)
    graph = ExpressionGraph()
    graph.add(root)
    assert extract(graph, root, _text_length, deadline=0.0) is None


@settings(deadline=None)
@given(expressions())
def test_extraction_is_sound_and_no_worse_than_any_search_state(expr):
    """After a depth-1 search, the extracted program evaluates like the expression and costs no
    more than the best single state as the e-graph holds it (canonical). The cost is the
    analytic stand-in of the kernels before fusion, which adds up over nested scopes."""
    exploration = explore(expr, 1, max_states=200)

    def cost(scope, constants=frozenset()):
        return instantiate(scope).cost

    scope, extracted = extract(exploration.graph, expr, cost)
    best_state = min(cost(canonical(state.expr)) for state in exploration.states)
    assert extracted <= best_state * (1 + 1e-9)
    assert abs(cost(scope) - extracted) <= 1e-9 * extracted
    inputs = random_inputs(expr)
    np.testing.assert_allclose(evaluate(scope, inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)


def test_derive_extraction_costs_measured_kernels_at_their_measured_time(tmp_path):
    """Lazy measurement: a kernel codegen measured costs its measured seconds in extraction
    (whatever its tensors are named); one not measured costs the analytic stand-in scaled by
    the measured/analytic ratio of its kind."""
    from codegen.measure import MeasurementDB
    from codegen.program import compile_candidate
    from rewriter import matmul
    from rewriter.ir import rename_tensors
    from rewriter.pipeline.select import Extraction

    expr = matmul((32, 16), (16, 48))
    exploration = explore(expr, 0)
    extraction = Extraction(exploration.graph, expr, ())
    own = canonical(expr)
    analytic = postprocess(instantiate(own)).cost
    assert extraction.cost(own) == analytic
    program = compile_candidate(
        postprocess(instantiate(expr)), {"A": (32, 16), "B": (16, 48)}, db=MeasurementDB(tmp_path / "m.sqlite")
    )
    program.measure()
    extraction.learn(program)
    (step,) = program.steps
    assert extraction.cost(rename_tensors(own, {"A": "X", "B": "Y"})) == step.seconds
    other = canonical(matmul((64, 16), (16, 48)))
    assert abs(extraction.cost(other) - postprocess(instantiate(other)).cost * step.seconds / step.kernel.cost) < 1e-12
