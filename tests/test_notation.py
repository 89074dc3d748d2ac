"""The text notation: public cases round-trip, printing is minimal, and bad input is named."""

import pytest

from rewriter import ExpressionError, Iterator, Lit, Num, Program, Scope, Tensor, Unary, Var, parse, parse_program
from rewriter.cases import PUBLIC_CASES
from rewriter.ir import IndexNeg, IndexOp


@pytest.mark.parametrize("case", PUBLIC_CASES, ids=lambda c: c.name)
def test_public_case_prints_back_identically(case):
    expr = parse(case.text, case.shapes)
    assert str(expr) == case.text
    assert parse(str(expr), case.shapes) == expr


def test_parsed_structure_of_conv3x3():
    expr = parse(PUBLIC_CASES[0].text, PUBLIC_CASES[0].shapes)
    assert [it.name for it in expr.traversal] == ["n", "h", "w", "f"]
    assert [(it.name, it.size) for it in expr.summation] == [("c", 512), ("r", 3), ("s", 3)]
    assert expr.shape == (1, 7, 7, 512)
    h, r = Var("h"), Var("r")
    assert expr.body.lhs.indices[1] == h + r - 1


def test_ranges_with_start_and_nested_scopes_round_trip():
    text = "L i:-1..3, j:2 ; S k:4 ; { L a:1..5, b:4 ; M c:2 ; max(A[a, b+c], 0) }[i+1, k] * B[j, k]"
    expr = parse(text, {"A": (5, 6), "B": (2, 4)})
    assert str(expr) == text
    inner = expr.body.lhs.source
    assert isinstance(inner, Scope) and inner.reduce == "max" and inner.traversal[0] == Iterator("a", 1, 5)


def test_division_modulo_and_negation_round_trip():
    text = "L i:8, j:3 ; -A[i/2, (i+1)%3] * (B[-j+2] - -1.5) / sqrt(exp(B[j*-1]))"
    shapes = {"A": (4, 3), "B": (3,)}
    assert str(parse(text, shapes)) == text


@pytest.mark.parametrize(
    "tree, text",
    [
        (IndexOp("-", Var("a"), IndexOp("+", Var("b"), Var("c"))), "a-(b+c)"),
        (IndexOp("*", Lit(2), IndexOp("+", Var("a"), Lit(1))), "2*(a+1)"),
        (IndexNeg(Lit(2)), "-(2)"),
        (Lit(-2), "-2"),
        (IndexOp("-", Var("a"), Lit(-2)), "a--2"),
        (IndexNeg(IndexNeg(Var("a"))), "-(-a)"),
    ],
)
def test_index_printing_keeps_trees_apart(tree, text):
    assert str(tree) == text
    expr = Scope((Iterator("a", 0, 2), Iterator("b", 0, 2), Iterator("c", 0, 2)), (), Tensor("T", (4,))[tree])
    assert parse(str(expr), {"T": (4,)}) == expr


def test_scalar_printing_keeps_trees_apart():
    a = Tensor("A", (2,))[Var("i")]
    for body in (
        Unary("neg", Num(2.0)),
        Num(-2.0),
        a - (a - a),
        -(a * a),
        (-a) * a,
        Num(1e-5) * a,
        Num(0.5) + Num(1e20),
    ):
        expr = Scope((Iterator("i", 0, 2),), (), body)
        assert parse(str(expr), {"A": (2,)}) == expr, str(expr)


def test_operator_sugar_builds_readable_indices():
    h, r = Var("h"), Var("r")
    assert str(2 * h + r - 1) == "2*h+r-1"
    assert str(h + (-3)) == "h-3"
    assert str((h + 1) // 2) == "(h+1)/2"


def test_programs_round_trip():
    text = "B = L i:4, j:4 ; S k:4 ; A[i, k] * W[k, j]\nC = L i:4, j:4 ; relu(B[i, j])\nreturn C"
    program = parse_program(text, {"A": (4, 4), "W": (4, 4)})
    assert str(program) == text
    assert program.inputs == {"A": (4, 4), "W": (4, 4)}
    assert parse_program(str(program), program.inputs) == program


# ---------------------------------------------------------------------------------------------
# Validation: every malformed input names its culprit

SHAPES = {"A": (4, 4), "B": (4,)}


@pytest.mark.parametrize(
    "text, message",
    [
        ("L i:4 ; C[i]", "line 1, column 9: unknown tensor 'C'"),
        ("L i:4 ; A[i]", "tensor A has 2 dimension(s) but is read with 1 index(es)"),
        ("L i:4 ; A[i, j]", "line 1, column 14: unbound iterator 'j'"),
        ("L i:4, i:2 ; B[i]", "duplicate iterator 'i'"),
        ("L i:4 ; S i:2 ; B[i]", "duplicate iterator 'i'"),
        ("L i:0 ; B[i]", "iterator i has an empty range 0..0"),
        ("L i:3..1 ; B[i]", "iterator i has an empty range 3..1 (negative size)"),
        ("L i:4 ; B[1.5]", "non-integer index constant 1.5"),
        ("L i:4, j:4 ; B[i*j]", "non-affine index i*j"),
        ("L i:4 ; B[i/0]", "division by zero in index i/0"),
        ("L i:4 ; B[i%-3]", "non-positive divisor -3 in index i%-3"),
        ("L i:4 ; B[i/j]", "unbound iterator 'j'"),
        ("L i:4 ; B[i/(i+1)]", "the divisor must be a constant"),
        ("L i:4 ; B[i] +", "line 1, column 15: expected an expression, found end of input"),
        ("L i:4 ;\n  B[i] * * B[i]", "line 2, column 10: expected an expression, found '*'"),
        ("L i:4 ; B[i] $", "line 1, column 14: unexpected character '$'"),
        ("L i:4 ; frob(B[i])", "unknown function 'frob'"),
        ("L i:4 ; max(B[i])", "max takes 2 arguments, got 1"),
        ("L i:4 ; B[i] % 2", "'%' is only allowed in indices"),
        ("L i:4 ; { L j:4 ; B[i] }[i]", "unbound iterator 'i'"),
        ("L i:4 ; { L j:4 ; B[j] }[i, i]", "nested scope has 1 dimension(s) but is read with 2 index(es)"),
        ("i:4 ; B[i]", "expected a scope starting with 'L'"),
        ("L i:4 ; B[i] ; B[i]", "line 1, column 14: expected end of input after the expression, found ';'"),
    ],
)
def test_malformed_text_is_refused_with_a_named_culprit(text, message):
    with pytest.raises(ExpressionError) as info:
        parse(text, SHAPES)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Tensor("A", (3, 0)), "tensor A: dimension 1 has size 0"),
        (lambda: Tensor("A", (3, 2.5)), "tensor A: a dimension must be an integer"),
        (lambda: Tensor("L", (3,)), "reserved word"),
        (lambda: Tensor("A", (3,))[Var("i"), Var("j")], "tensor A has 1 dimension(s) but is read with 2"),
        (lambda: Tensor("A", (3,))[0.5], "must be an integer"),
        (lambda: Var("i") * Var("j"), "non-affine index i*j"),
        (lambda: Var("i") // 0, "division by zero"),
        (lambda: Iterator("i", 2, 2), "empty range"),
        (lambda: Num(float("nan")), "not finite"),
        (lambda: Unary("cosh", Num(1.0)), "unknown function 'cosh'"),
        (
            lambda: Scope((Iterator("i", 0, 2),), (), Tensor("A", (2,))[Var("k")]),
            "unbound iterator 'k' in index 0 (k) of tensor A",
        ),
        (
            lambda: Scope((Iterator("i", 0, 2),), (), Tensor("A", (2,))[Var("i")] * Tensor("A", (3,))[Var("i")]),
            "tensor A is used with two shapes",
        ),
    ],
)
def test_malformed_objects_are_refused_with_a_named_culprit(make, message):
    with pytest.raises(ExpressionError, match=None) as info:
        make()
    assert message in str(info.value)


def test_unknown_tensor_lists_the_known_ones():
    with pytest.raises(ExpressionError, match=r"shapes given for: A, B"):
        parse("L i:4 ; Z[i]", SHAPES)


@pytest.mark.parametrize(
    "text, message",
    [
        ("B = L i:4 ; A[i, 0]\nB = L i:4 ; A[i, 1]", "tensor B is defined twice"),
        ("B = L i:4 ; A[i, 0]\nreturn C", "output 'C' is not defined"),
        ("B = L i:4 ; A[i, 0]\nC = L i:4, j:2 ; B[i, j]", "tensor B has 1 dimension(s) but is read with 2"),
    ],
)
def test_malformed_programs_are_refused(text, message):
    with pytest.raises(ExpressionError) as info:
        parse_program(text, {"A": (4, 4)})
    assert message in str(info.value)


def test_program_refuses_mismatched_shapes_of_a_defined_tensor():
    producer = Scope((Iterator("i", 0, 4),), (), Tensor("A", (4,))[Var("i")])
    consumer = Scope((Iterator("i", 0, 5),), (), Tensor("B", (5,))[Var("i")])
    with pytest.raises(ExpressionError, match=r"C reads B with shape \(5,\), but B has shape \(4,\)"):
        Program((("B", producer), ("C", consumer)), ("C",))
