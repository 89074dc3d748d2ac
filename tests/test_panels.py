"""Convolutions directly over the weight laid out in panels (codegen/panels.py): equal to the
reference semantics, in any iterator order and weight layout; refused where they do not apply."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from codegen.panels import LINE, panels_call
from codegen.tvm_kernel import aligned_copy, aligned_empty, native_lanes, tile_vectors
from rewriter import evaluate, parse
from rewriter.ir import accesses, index_vars, tensor_shapes
from rewriter.lower import CONV2D, Kernel, match_operator
from rewriter.testing import random_inputs
from rewriter.testing.strategies import convolutions

pytestmark = pytest.mark.usefixtures("module_cache")  # kernels in a fresh cache


def _conv_kernel(expr, weights=frozenset({"W"})) -> Kernel:
    return Kernel("conv2d", "out", expr, CONV2D.match(expr), weights=weights)


def _check(call, expr, seed, prepared: bool):
    values = {name: aligned_copy(value, "float32") for name, value in random_inputs(expr, seed).items()}
    if prepared:
        values.update(call.prepare(values))
    out = aligned_empty(expr.shape, "float32")
    out[...] = np.nan
    call(values, out)
    np.testing.assert_allclose(out, evaluate(expr, values), rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(convolutions(max_filters=2 * LINE + 3, offset_outputs=False), st.integers(0, 2**32 - 1), st.booleans())
def test_panels_compute_the_convolution(expr, seed, prepared):
    kernel = _conv_kernel(expr)
    assert kernel.match is not None, str(expr)
    call = panels_call(kernel, "float32")
    assert call is not None, str(expr)
    _check(call, expr, seed, prepared)  # with the panels bound, and laid out on the call


def test_panels_apply_to_a_weight_without_groups_only():
    shapes = {"X": (1, 4, 6, 6), "W": (8, 4, 3, 3)}
    conv = parse("L n:1, f:8, h:6, w:6 ; S c:4, r:3, s:3 ; X[n, c, h+r-1, w+s-1] * W[f, c, r, s]", shapes)
    assert panels_call(_conv_kernel(conv), "float32") is not None
    assert panels_call(_conv_kernel(conv, weights=frozenset()), "float32") is None  # W is computed
    depthwise = parse(
        "L n:1, f:4, h:6, w:6 ; S c:1, r:3, s:3 ; X[n, c+f, h+r-1, w+s-1] * W[f, c, r, s]",
        {"X": (1, 4, 6, 6), "W": (4, 1, 3, 3)},
    )
    assert panels_call(_conv_kernel(depthwise), "float32") is None  # f reads the input: a group


@settings(max_examples=10, deadline=None)
@given(convolutions(max_filters=2 * LINE + 3, offset_outputs=False), st.integers(0, 2**32 - 1))
def test_panels_compute_a_convolution_with_its_epilogue_where_they_lay_it_out(expr, seed):
    """An eOperator with a convolution inside it (a bias and a ReLU around it, read at a shifted
    channel): the epilogue is computed by the pass that lays the product out, no pass of its own."""
    assume(match_operator(expr)[0] == "conv2d")  # (a degenerate one, 1x1 outputs, matches a matmul first)
    (weight,) = [a for a in accesses(expr.body) if a.source.name == "W"]
    channel = next(it for it in expr.traversal if any(it.name in index_vars(ix) for ix in weight.indices))
    shapes = {**tensor_shapes(expr), "B": (channel.size + 1,)}
    body = f"{{{expr}}}[{', '.join(it.name for it in expr.traversal)}] + B[{channel.name} + 1]"
    fused = parse(f"L {', '.join(map(str, expr.traversal))} ; relu({body})", shapes)
    kernel = Kernel("eop", "out", fused, None, weights=frozenset({"W", "B"}))
    call = panels_call(kernel, "float32")
    assert call is not None, str(fused)
    assert len(call.native) == 2  # the product, and the pass laying it out with the epilogue
    _check(call, fused, seed, prepared=True)


@pytest.mark.parametrize("columns", [7, 14, 28])
def test_a_panel_is_as_wide_as_the_register_tiles_rows(columns):
    """Each tile loads every line of the weight it reads whole: with AVX2's 8 lanes, 7 or 14
    output columns tile as rows of one vector, and the panels are one vector wide; where the
    rows are a whole line wide, panels are a line wide. Where a vector is a line (AVX-512's 16
    lanes) a panel is one vector, and a tile's row may span two panels' worth of channels
    (``tvm_kernel._columns``), each line still read whole."""
    shapes = {"X": (1, 8, columns + 2, columns + 2), "W": (32, 8, 3, 3)}
    conv = parse(f"L n:1, f:32, h:{columns}, w:{columns} ; S c:8, r:3, s:3 ; X[n, c, h+r, w+s] * W[f, c, r, s]", shapes)
    call = panels_call(_conv_kernel(conv), "float32")
    rows = tile_vectors(call.product.scope) * native_lanes()
    assert call.width in (LINE, native_lanes())
    if native_lanes() < LINE:
        assert rows == call.width  # the tile's row is the panel, no wider, no narrower
    else:
        assert call.width == LINE and rows % LINE == 0  # whole panels, each a line
    _check(call, conv, seed=0, prepared=True)
