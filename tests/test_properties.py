"""Property tests of the IR, the printer/parser and the reference evaluator on random expressions.

1. printing and parsing round-trip (expressions and programs);
2. a nested scope evaluates like the tensor it instantiates;
3. ``evaluate`` agrees with a brute-force loop evaluator written here (also on the chunked path,
   on programs, and on the scalar ``L ; S <every iterator> ; body``), and has the scope's shape;
4. evaluation does not depend on iterator names, summation order, or (up to a transpose)
   traversal order.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rewriter import evaluate, parse, parse_program
from rewriter.ir import (
    Access,
    Binary,
    Index,
    IndexNeg,
    IndexOp,
    Iterator,
    Num,
    Program,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
    distinct_scopes,
    eval_index,
    nested_scopes,
    tensor_shapes,
)
from rewriter.testing.strategies import (
    ALL_FUNCTIONS,
    expressions,
    expressions_with_inputs,
    inputs_for,
    programs,
    programs_with_inputs,
    wide_constants,
)

# The module that defines evaluate() (and its CHUNK_ELEMENTS threshold), whatever its name.
evaluate_module = importlib.import_module(evaluate.__module__)


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-9, equal_nan=True)


# --------------------------------------------------------------------------------------------
# A brute-force evaluator: one Python loop iteration per point of the iteration space.


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + _exp(-x))
    e = _exp(x)
    return e / (1.0 + e)


def _divide(a: float, b: float) -> float:
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


_UNARY = {
    "neg": lambda x: -x,
    "relu": lambda x: x if x > 0 or math.isnan(x) else 0.0,
    "exp": _exp,
    "tanh": math.tanh,
    "sigmoid": _sigmoid,
    "sqrt": lambda x: math.sqrt(x) if x >= 0 else math.nan,
}
_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": _divide,
    "max": lambda a, b: math.nan if math.isnan(a) or math.isnan(b) else max(a, b),
}


class BruteForce:
    """The semantics of the notation, literally: loop over every point, read 0 out of bounds."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays
        self.memo: dict[Scope, np.ndarray] = {}

    def scope(self, scope: Scope) -> np.ndarray:
        if scope in self.memo:
            return self.memo[scope]
        out = np.zeros(scope.shape, dtype=np.float64)
        tnames = [it.name for it in scope.traversal]
        snames = [it.name for it in scope.summation]
        for point in itertools.product(*(range(it.lo, it.hi) for it in scope.traversal)):
            env = dict(zip(tnames, point))
            if not scope.summation:
                value = self.scalar(scope.body, env)
            else:
                values = [
                    self.scalar(scope.body, {**env, **dict(zip(snames, spoint))})
                    for spoint in itertools.product(*(range(it.lo, it.hi) for it in scope.summation))
                ]
                if scope.reduce == "sum":
                    value = sum(values)
                else:
                    value = math.nan if any(math.isnan(v) for v in values) else max(values)
            out[tuple(v - it.lo for v, it in zip(point, scope.traversal))] = value
        self.memo[scope] = out
        return out

    def scalar(self, body: Scalar, env: dict[str, int]) -> float:
        if isinstance(body, Num):
            return body.value
        if isinstance(body, Access):
            if isinstance(body.source, Tensor):
                array, offsets = self.arrays[body.source.name], [0] * body.source.rank
            else:
                array, offsets = self.scope(body.source), [it.lo for it in body.source.traversal]
            position = []
            for ix, offset, dim in zip(body.indices, offsets, array.shape):
                p = eval_index(ix, env) - offset
                assert isinstance(p, int)
                if not 0 <= p < dim:
                    return 0.0
                position.append(p)
            return float(array[tuple(position)])
        if isinstance(body, Unary):
            return _UNARY[body.fn](self.scalar(body.arg, env))
        if isinstance(body, Binary):
            return _BINARY[body.op](self.scalar(body.lhs, env), self.scalar(body.rhs, env))
        raise TypeError(body)


def brute_force(expr: Scope | Program, inputs: dict) -> np.ndarray | tuple:
    arrays = {name: np.asarray(value, dtype=np.float64) for name, value in inputs.items()}
    if isinstance(expr, Program):
        for name, scope in expr.definitions:
            arrays[name] = BruteForce(arrays).scope(scope)
        outs = tuple(arrays[name] for name in expr.outputs)
        return outs[0] if len(outs) == 1 else outs
    return BruteForce(arrays).scope(expr)


# --------------------------------------------------------------------------------------------
# Transformations used by the properties


def map_body(body: Scalar, access_fn) -> Scalar:
    """``body`` with every Access (not entering nested scopes) replaced by ``access_fn(access)``."""
    match body:
        case Access():
            return access_fn(body)
        case Unary(fn, arg):
            return Unary(fn, map_body(arg, access_fn))
        case Binary(op, lhs, rhs):
            return Binary(op, map_body(lhs, access_fn), map_body(rhs, access_fn))
    return body


def inline_nested(expr: Scope, inputs: dict, deep: bool) -> tuple[Scope, dict]:
    """Replace each nested scope read by a read of a fresh tensor holding ``evaluate(inner)``.

    The tensor stores the inner value at iterator value v in position v - lo, so the read
    subtracts lo from each index; reads outside the inner range stay outside the tensor (0).
    With ``deep``, nested scopes inside nested scopes are replaced first.
    """
    inputs = dict(inputs)
    names: dict[Scope, str] = {}

    def flatten(scope: Scope) -> Scope:
        return Scope(scope.traversal, scope.summation, map_body(scope.body, replace), scope.reduce)

    def replace(access: Access) -> Access:
        inner = access.source
        if isinstance(inner, Tensor):
            return access
        if inner not in names:
            names[inner] = f"N{len(names)}"
            flat = flatten(inner) if deep else inner
            inputs[names[inner]] = evaluate(flat, inputs)
        tensor = Tensor(names[inner], inner.shape)
        return Access(tensor, tuple(ix - it.lo if it.lo else ix for ix, it in zip(access.indices, inner.traversal)))

    return flatten(expr), inputs


def rename_index(ix: Index, mapping: dict[str, str]) -> Index:
    match ix:
        case Var(name):
            return Var(mapping.get(name, name))
        case IndexNeg(arg):
            return IndexNeg(rename_index(arg, mapping))
        case IndexOp(op, lhs, rhs):
            return IndexOp(op, rename_index(lhs, mapping), rename_index(rhs, mapping))
    return ix


def rename(scope: Scope, mapping: dict[str, str]) -> Scope:
    """Rename the iterators of ``scope`` and (each closed on its own) of its nested scopes."""

    def its(iterators):
        return tuple(Iterator(mapping.get(it.name, it.name), it.lo, it.hi) for it in iterators)

    def access(a: Access) -> Access:
        source = rename(a.source, mapping) if isinstance(a.source, Scope) else a.source
        return Access(source, tuple(rename_index(ix, mapping) for ix in a.indices))

    return Scope(its(scope.traversal), its(scope.summation), map_body(scope.body, access), scope.reduce)


def all_iterator_names(scope: Scope) -> set[str]:
    names = {it.name for it in scope.iterators}
    for inner in nested_scopes(scope):
        names |= {it.name for it in inner.iterators}
    return names


def test_a_scope_read_twice_is_one_of_the_distinct_scopes():
    """``distinct_scopes``: the expression, then each nested scope once, where ``nested_scopes``
    yields a scope at every read (here the exponentials, read by the sum and by the quotient)."""
    exps = "{ L a:4, b:8 ; exp(X[a, b]) }"
    expr = parse(f"L i:4, j:8 ; {exps}[i, j] / {{ L a:4 ; S b:8 ; {exps}[a, b] }}[i]", {"X": (4, 8)})
    nested = list(nested_scopes(expr))
    assert len(nested) == 3 and nested[0] == nested[1]  # the exponentials twice
    distinct = distinct_scopes(expr)
    assert distinct[0] is expr and len(distinct) == 3 and set(distinct[1:]) == set(nested)


@contextlib.contextmanager
def chunk_elements(value: int):
    """Temporarily set evaluate's chunking threshold (hypothesis forbids the monkeypatch fixture)."""
    saved = evaluate_module.CHUNK_ELEMENTS
    evaluate_module.CHUNK_ELEMENTS = value
    try:
        yield
    finally:
        evaluate_module.CHUNK_ELEMENTS = saved


# --------------------------------------------------------------------------------------------
# 1. printing / parsing


@given(
    expressions(
        constants=wide_constants(),
        nesting_probability=0.4,
        shadowing_probability=0.2,
        functions=ALL_FUNCTIONS,
        tensor_names=("A", "i", "k2", "Sx", "B"),  # tensors named like iterators are fine
    )
)
def test_expression_round_trip(expr):
    text = str(expr)
    shapes = tensor_shapes(expr)
    parsed = parse(text, shapes)
    assert parsed == expr, text
    assert str(parsed) == text


@given(programs(constants=wide_constants(), nesting_probability=0.3))
def test_program_round_trip(program):
    text = str(program)
    parsed = parse_program(text, program.inputs)
    assert parsed == program, text
    assert str(parsed) == text


# --------------------------------------------------------------------------------------------
# 2. nested scopes are tensors


@given(
    expressions(require_nested=True, nesting_probability=0.4).flatmap(lambda e: st.tuples(st.just(e), inputs_for(e))),
    st.booleans(),
)
def test_nested_scope_is_its_tensor(expr_inputs, deep):
    expr, inputs = expr_inputs
    flat, flat_inputs = inline_nested(expr, inputs, deep)
    assert flat != expr
    if deep:
        assert not list(nested_scopes(flat))
    assert_close(evaluate(flat, flat_inputs), evaluate(expr, inputs))


# --------------------------------------------------------------------------------------------
# 3. evaluate against the brute-force loops


@given(expressions_with_inputs(shadowing_probability=0.1))
def test_evaluate_matches_brute_force(expr_inputs):
    expr, inputs = expr_inputs
    value = evaluate(expr, inputs)
    assert value.shape == expr.shape
    assert_close(value, brute_force(expr, inputs))


@given(expressions_with_inputs(max_probability=0))
def test_summing_every_iterator_gives_the_total(expr_inputs):
    """``L ; S <all iterators> ; body`` is a scalar: the sum of the expression's elements."""
    expr, inputs = expr_inputs
    total = Scope((), expr.traversal + expr.summation, expr.body)
    value = evaluate(total, inputs)
    assert value.shape == ()
    assert_close(value, evaluate(expr, inputs).sum())
    assert_close(value, brute_force(total, inputs))


@given(
    expressions_with_inputs(
        functions=ALL_FUNCTIONS,
        max_probability=0.5,
        division_probability=0.3,
        binary_max_probability=0.2,
        div_probability=0.4,
    )
)
def test_evaluate_matches_brute_force_nonlinear(expr_inputs):
    expr, inputs = expr_inputs
    assert_close(evaluate(expr, inputs), brute_force(expr, inputs))


@given(expressions_with_inputs(nesting_probability=0.3), st.sampled_from((1, 2, 5, 16, 100)))
def test_evaluate_chunked_matches_brute_force(expr_inputs, chunk):
    expr, inputs = expr_inputs
    with chunk_elements(chunk):
        value = evaluate(expr, inputs)
    assert value.shape == expr.shape
    assert_close(value, brute_force(expr, inputs))


@given(programs_with_inputs())
def test_program_evaluate_matches_brute_force(program_inputs):
    program, inputs = program_inputs
    actual, expected = evaluate(program, inputs), brute_force(program, inputs)
    if len(program.outputs) == 1:
        actual, expected = (actual,), (expected,)
    assert len(actual) == len(expected) == len(program.outputs)
    for name, a, e in zip(program.outputs, actual, expected):
        assert a.shape == dict(program.definitions)[name].shape
        assert_close(a, e)


# --------------------------------------------------------------------------------------------
# 4. names and orders of iterators


@given(expressions_with_inputs(nesting_probability=0.3, shadowing_probability=0.1), st.data())
def test_iterator_renaming(expr_inputs, data):
    expr, inputs = expr_inputs
    names = sorted(all_iterator_names(expr))
    universe = names + [f"q{n}" for n in range(len(names))]
    image = data.draw(st.permutations(universe))
    mapping = dict(zip(universe, image))
    renamed = rename(expr, mapping)
    assert tensor_shapes(renamed) == tensor_shapes(expr)
    assert_close(evaluate(renamed, inputs), evaluate(expr, inputs))


def _reordered(items):
    """A permutation of ``items`` other than the identity (that one would test nothing)."""
    items = list(items)
    return st.permutations(items).filter(lambda order: list(order) != items)


@given(expressions_with_inputs(min_summation=2), st.data())
def test_summation_order_is_not_semantic(expr_inputs, data):
    expr, inputs = expr_inputs
    summation = tuple(data.draw(_reordered(expr.summation)))
    permuted = Scope(expr.traversal, summation, expr.body, expr.reduce)
    assert_close(evaluate(permuted, inputs), evaluate(expr, inputs))


@given(expressions_with_inputs(min_traversal=2), st.data())
def test_traversal_order_is_the_layout(expr_inputs, data):
    expr, inputs = expr_inputs
    order = data.draw(_reordered(range(len(expr.traversal))))
    permuted = Scope(tuple(expr.traversal[k] for k in order), expr.summation, expr.body, expr.reduce)
    assert_close(evaluate(permuted, inputs), np.transpose(evaluate(expr, inputs), order))
