"""The scalar functions of the notation, one property each: the text round-trips, the reference
semantics computes the function (numpy, or math for erf), and the TVM kernel agrees with it."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from codegen import compile_scope
from rewriter import evaluate, parse
from rewriter.ir import BINARY_FUNCTIONS, UNARY_FUNCTIONS

# function -> (its meaning, the domain sampled)
UNARY = {
    "neg": (np.negative, (-4, 4)),
    "relu": (lambda x: np.maximum(x, 0), (-4, 4)),
    "exp": (np.exp, (-4, 4)),
    "log": (np.log, (0.125, 8)),
    "tanh": (np.tanh, (-4, 4)),
    "sin": (np.sin, (-8, 8)),
    "cos": (np.cos, (-8, 8)),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), (-4, 4)),
    "erf": (np.vectorize(math.erf), (-4, 4)),
    "sqrt": (np.sqrt, (0, 8)),
    "rsqrt": (lambda x: 1 / np.sqrt(x), (0.125, 8)),
    "abs": (np.abs, (-4, 4)),
    "floor": (np.floor, (-4, 4)),
    "ceil": (np.ceil, (-4, 4)),
}
BINARY = {
    "max": (np.maximum, (-4, 4)),
    "min": (np.minimum, (-4, 4)),
    "pow": (np.power, (0.125, 4)),
    "less": (lambda a, b: (a < b) * 1.0, (-2, 2)),
    "less_equal": (lambda a, b: (a <= b) * 1.0, (-2, 2)),
    "greater": (lambda a, b: (a > b) * 1.0, (-2, 2)),
    "greater_equal": (lambda a, b: (a >= b) * 1.0, (-2, 2)),
    "equal": (lambda a, b: (a == b) * 1.0, (-2, 2)),
    "select": (lambda c, x: np.where(c != 0, x, 0.0), (-2, 2)),
}


def test_every_function_of_the_notation_is_covered_here():
    assert set(UNARY) == set(UNARY_FUNCTIONS) and set(BINARY) == set(BINARY_FUNCTIONS)


def values(domain, size=12):
    lo, hi = domain
    # a few whole numbers: floor, ceil and equal meet their edge cases
    element = st.one_of(st.floats(lo, hi, width=32), st.integers(math.ceil(lo), math.floor(hi)).map(float))
    return arrays(np.float32, (size,), elements=element)


@pytest.mark.parametrize("fn", sorted(UNARY))
@settings(max_examples=15)
@given(data=st.data())
def test_unary_function(fn, data):
    meaning, domain = UNARY[fn]
    x = data.draw(values(domain))
    text = f"L i:12 ; {fn}(A[i])" if fn != "neg" else "L i:12 ; -A[i]"
    expr = parse(text, {"A": (12,)})
    assert str(expr) == text and parse(str(expr), {"A": (12,)}) == expr
    want = meaning(x.astype(np.float64))
    np.testing.assert_allclose(evaluate(expr, {"A": x}), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(compile_scope(expr)(A=x), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("fn", sorted(BINARY))
@settings(max_examples=15)
@given(data=st.data())
def test_binary_function(fn, data):
    meaning, domain = BINARY[fn]
    a, b = data.draw(values(domain)), data.draw(values(domain))
    if fn == "equal":
        b[::2] = a[::2]  # half of the pairs equal
    if fn == "select":
        a[::3] = 0.0  # a third not chosen
    text = f"L i:12 ; {fn}(A[i], B[i])"
    expr = parse(text, {"A": (12,), "B": (12,)})
    assert str(expr) == text and parse(str(expr), {"A": (12,), "B": (12,)}) == expr
    want = meaning(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(evaluate(expr, {"A": a, "B": b}), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(compile_scope(expr)(A=a, B=b), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("exponent", [2, 3, 4, 2.5])
def test_a_constant_power_compiles_to_the_reference_values(exponent):
    """Small integer exponents are products in generated code (negative bases included)."""
    x = np.linspace(-3, 3, 12).astype(np.float32)
    x = np.abs(x) if exponent == 2.5 else x
    expr = parse(f"L i:12 ; pow(A[i], {exponent})", {"A": (12,)})
    np.testing.assert_allclose(compile_scope(expr)(A=x), np.power(x.astype(np.float64), exponent), rtol=2e-6)


@pytest.mark.parametrize("fn", ["exp", "tanh", "erf"])
def test_float32_exp_tanh_and_erf_match_the_reference_across_their_range(fn):
    """Generated code computes these with polynomials (tanh and erf: a ratio of two): relative
    error near 1e-7 from float32's smallest normal result of exp to its largest, around 0 and at
    the formulas' seams."""
    seams = [-87.2, 88.7, 9.0, -8.99999, 4.0, -3.99999, 1e-6, 0.0]  # exp's range, tanh's and erf's clamps
    x = np.concatenate([np.linspace(-87.2, 88.7, 3001), np.linspace(-3, 3, 3001), seams]).astype(np.float32)
    if fn != "exp":
        x = np.clip(x, -20, 20)
    meaning, _ = UNARY[fn]
    expr = parse(f"L i:{len(x)} ; {fn}(A[i])", {"A": (len(x),)})
    np.testing.assert_allclose(compile_scope(expr)(A=x), meaning(x.astype(np.float64)), rtol=1e-6, atol=1e-37)
