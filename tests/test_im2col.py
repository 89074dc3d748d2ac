"""Convolutions as im2col + one GEMM (codegen/im2col.py): equal to the reference semantics."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.im2col import im2col_call
from codegen.program import compile_candidate
from rewriter import evaluate, parse
from rewriter.lower import CONV2D, Candidate, Kernel, instantiate
from rewriter.testing.strategies import convolutions


@settings(max_examples=60, deadline=None)
@given(convolutions(), st.integers(0, 2**32 - 1))
def test_im2col_computes_the_convolution(expr, seed):
    kernel = Kernel("conv2d", "out", expr, CONV2D.match(expr))  # degenerate sizes would match matmul first
    assert kernel.match is not None, str(expr)
    call = im2col_call(kernel, "float64")
    assert call is not None, str(expr)
    rng = np.random.default_rng(seed)
    values = {"X": rng.uniform(-1, 1, expr.body.lhs.source.shape), "W": rng.uniform(-1, 1, expr.body.rhs.source.shape)}
    out = np.full(expr.shape, np.nan)
    for _ in range(2):  # buffers are reused: the second call must not see the first one's data
        call(values, out)
        np.testing.assert_allclose(out, evaluate(expr, values), rtol=1e-10, atol=1e-10)
        values = {name: v[::-1].copy() for name, v in values.items()}


def test_a_kernel_that_is_no_convolution_has_no_im2col_call():
    """A 1-D convolution is no Conv2d (its table lists two windows): an eOperator, for TVM."""
    expr = parse("L g:2, f:3, h:4 ; S c:2, r:3 ; X[g, c, h+r] * W[g, f, c, r]", {"X": (2, 2, 6), "W": (2, 3, 2, 3)})
    kernel = instantiate(expr).kernels[0]
    assert kernel.kind == "eop" and im2col_call(kernel, "float32") is None


def test_a_compiled_convolution_races_im2col_against_tvm_and_computes_the_convolution():
    expr = parse(
        "L n:1, f:8, h:6, w:6 ; S c:4, r:3, s:3 ; X[n, c, h+r-1, w+s-1] * W[f, c, r, s]",
        {"X": (1, 4, 6, 6), "W": (8, 4, 3, 3)},
    )
    program = compile_candidate(Candidate(instantiate(expr).kernels), {"X": (1, 4, 6, 6), "W": (8, 4, 3, 3)})
    assert program.steps[0].impl in ("im2col", "tvm")
    rng = np.random.default_rng(0)
    x, w = rng.uniform(-1, 1, (1, 4, 6, 6)), rng.uniform(-1, 1, (8, 4, 3, 3))
    np.testing.assert_allclose(program(X=x, W=w), evaluate(expr, {"X": x, "W": w}), rtol=1e-4, atol=1e-4)
