"""Operator records (rewriter/lower/operators.py): matched by their iterator mapping tables, run
by the implementations they list (codegen: im2col, band, BLAS), equal to the reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.band import band_call
from codegen.im2col import im2col_call
from codegen.program import _step, compile_candidate, implementations, load
from rewriter import conv2d, evaluate, parse
from rewriter.ir import ExpressionError
from rewriter.lower import (
    BATCH_MATMUL,
    CONV2D,
    G2BMM,
    GBMM,
    MATMUL,
    OPERATORS,
    BandMatch,
    Candidate,
    ConvMatch,
    Group,
    IteratorTable,
    Kernel,
    Operator,
    Window,
    conv_constraints,
    inner_product,
    instantiate,
    match_operator,
)
from rewriter.pipeline.select import _structure
from rewriter.search import registered
from rewriter.testing import random_inputs

# A new operator, defined here and registered nowhere: a 1-D convolution is one window less.
CONV1D = Operator(
    "conv1d",
    IteratorTable(
        (
            Group("g", input=True, weight=True, output=True),
            Group("nw", input=True, weight=False, output=True),
            Group("f", input=False, weight=True, output=True),
            Group("cs", input=True, weight=True, output=False),
        ),
        (Window("input", "nw", "cs"),),
    ),
    conv_constraints,
    {"cpu": ("im2col", "tvm")},
)

CONV1D_TEXT = "L n:2, f:3, w:7 ; S c:4, s:3 ; X[n, c, 2*w+s-1] * W[f, c, s]"
CONV1D_SHAPES = {"X": (2, 4, 14), "W": (3, 4, 3)}


pytestmark = pytest.mark.usefixtures("module_cache")  # kernels and timings in a fresh cache


def _run(call, expr, seed):
    """``call`` on random float64 inputs, twice (buffers are reused: the second call must not
    see the first one's data), each against the reference semantics."""
    values = random_inputs(expr, seed)
    out = np.full(expr.shape, np.nan)
    for _ in range(2):
        call(values, out)
        np.testing.assert_allclose(out, evaluate(expr, values), rtol=1e-10, atol=1e-10)
        values = {name: -2 * v for name, v in values.items()}


# --------------------------------------------------------------------------------------------
# Adding an operator is adding a record


def test_a_record_defined_outside_the_registry_is_matched_compiled_and_verified(tmp_path):
    expr = parse(CONV1D_TEXT, CONV1D_SHAPES)
    assert match_operator(expr) == ("eop", None)  # no registered operator reads one window
    candidate = instantiate(expr, operators=(*OPERATORS, CONV1D))
    (kernel,) = candidate.kernels
    assert kernel.kind == "conv1d" and kernel.operator is CONV1D
    assert kernel.match.spatial == (("w", "s", 2, 1),) and kernel.match.structure == (((3, 1),),)
    assert implementations(kernel) == ("im2col", "tvm")
    inputs = random_inputs(expr, 0)
    np.testing.assert_allclose(candidate(**inputs), evaluate(expr, inputs), rtol=1e-12)
    program = compile_candidate(candidate, CONV1D_SHAPES)
    assert program.steps[0].impl in ("im2col", "tvm")
    np.testing.assert_allclose(program(**inputs), evaluate(expr, inputs), rtol=1e-4, atol=1e-4)
    im2col = compile_candidate(Candidate([kernel]), CONV1D_SHAPES, dtype="float64")
    im2col.steps[0] = _step(kernel, "im2col", "float64")
    np.testing.assert_allclose(im2col(**inputs), evaluate(expr, inputs), rtol=1e-10)
    program.save(tmp_path / "conv1d")
    np.testing.assert_allclose(load(tmp_path / "conv1d", operators=(CONV1D,))(**inputs), program(**inputs))


@pytest.mark.parametrize("impl", ["band", "tvm"])
def test_saved_programs_keep_their_implementation(tmp_path, impl):
    from rewriter import g2bmm

    expr = g2bmm((2, 12, 4), (2, 12, 4), width=2, dilation=2)
    candidate = instantiate(expr)
    shapes = {"Q": (2, 12, 4), "K": (2, 12, 4)}
    program = compile_candidate(candidate, shapes)
    program.steps[0] = _step(candidate.kernels[0], impl, "float32")
    program.save(tmp_path / impl)
    loaded = load(tmp_path / impl)
    assert [s.impl for s in loaded.steps] == [impl] and loaded.kernels == program.kernels
    inputs = random_inputs(expr, 2)
    np.testing.assert_allclose(loaded(**inputs), evaluate(expr, inputs), rtol=1e-4, atol=1e-4)


def test_an_operator_record_that_lists_one_implementation_gets_it():
    only_im2col = Operator("conv1d", CONV1D.table, conv_constraints, {"cpu": ("im2col",)})
    expr = parse(CONV1D_TEXT, CONV1D_SHAPES)
    program = compile_candidate(instantiate(expr, operators=(only_im2col,)), CONV1D_SHAPES)
    assert [s.impl for s in program.steps] == ["im2col"]


def test_a_malformed_table_is_a_clear_error():
    with pytest.raises(ExpressionError, match="index the same tensors"):
        IteratorTable((Group("a", True, False, True), Group("b", True, False, True)))
    with pytest.raises(ExpressionError, match="unknown operand or group"):
        IteratorTable((Group("a", True, False, True),), (Window("input", "a", "zz"),))


def test_an_unknown_implementation_name_is_a_clear_error():
    expr = parse(CONV1D_TEXT, CONV1D_SHAPES)
    (kernel,) = instantiate(expr, operators=(CONV1D,)).kernels
    with pytest.raises(ExpressionError, match="unknown implementation"):
        _step(kernel, "winograd", "float32")
    with pytest.raises(ExpressionError, match="does not apply"):
        _step(kernel, "band", "float32")


# --------------------------------------------------------------------------------------------
# Convolutions: grouped, depthwise, strided, dilated, padded, any layout; im2col computes them


@st.composite
def grouped_convolutions(draw):
    """A convolution with channel groups g (read by input, weight and output), random sizes,
    stride, dilation, padding, iterator orders and input and weight layouts."""
    n, g, c, f = (draw(st.integers(1, 2)) for _ in range(4))
    r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride, dilation, pad = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(0, 2))
    height, width = draw(st.integers(r * dilation, 8)), draw(st.integers(s * dilation, 8))
    out_h = (height + 2 * pad - dilation * (r - 1) - 1) // stride + 1
    out_w = (width + 2 * pad - dilation * (s - 1) - 1) // stride + 1
    sizes = {"n": n, "g": g, "f": f, "h": out_h, "w": out_w, "c": c, "r": r, "s": s}
    x_dims = {
        "n": "n",
        "g": "g",
        "c": "c",
        "H": f"{stride}*h+{dilation}*r-{pad}",
        "W": f"{stride}*w+{dilation}*s-{pad}",
    }
    x_extent = {"n": n, "g": g, "c": c, "H": height, "W": width}
    x_order = draw(st.permutations(list(x_dims)))
    w_order = draw(st.permutations(["g", "f", "c", "r", "s"]))
    traversal = draw(st.permutations(["n", "g", "f", "h", "w"]))
    summed = draw(st.permutations(["c", "r", "s"]))
    x_read = f"X[{', '.join(x_dims[d] for d in x_order)}]"
    w_read = f"W[{', '.join(w_order)}]"
    product = f"{x_read} * {w_read}" if draw(st.booleans()) else f"{w_read} * {x_read}"
    text = (
        f"L {', '.join(f'{i}:{sizes[i]}' for i in traversal)} ; S {', '.join(f'{i}:{sizes[i]}' for i in summed)} ; "
        + product
    )
    shapes = {"X": tuple(x_extent[d] for d in x_order), "W": tuple(sizes[d] for d in w_order)}
    return parse(text, shapes), stride, dilation


@settings(max_examples=60, deadline=None)
@given(grouped_convolutions(), st.integers(0, 2**32 - 1))
def test_grouped_convolutions_match_the_conv2d_table_and_im2col_computes_them(drawn, seed):
    expr, stride, dilation = drawn
    match = CONV2D.match(expr)
    assert isinstance(match, ConvMatch), str(expr)
    assert {(a, b) for _, _, a, b in match.spatial} == {(stride, dilation)}
    call = im2col_call(Kernel("conv2d", "out", expr, match), "float64")
    assert call is not None, str(expr)
    _run(call, expr, seed % 1000)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(0, 1),
    st.sampled_from(["NCHW", "NHWC"]),
    st.integers(0, 2**32 - 1),
)
def test_depthwise_convolutions_are_convolutions_with_a_channel_group(channels, stride, dilation, pad, layout, seed):
    """PyTorch's depthwise conv (groups = channels): ``A[n, f+c, ..] * K[f, c, ..]`` with c of
    extent 1; f indexes input, weight and output, a group of the convolution."""
    x_shape = (1, channels, 7, 6) if layout == "NCHW" else (1, 7, 6, channels)
    w_shape = (channels, 1, 3, 2) if layout == "NCHW" else (3, 2, channels, 1)
    expr = conv2d(x_shape, w_shape, stride=stride, dilation=dilation, padding=pad, groups=channels, layout=layout)
    (kernel,) = instantiate(expr).kernels
    assert kernel.kind == "conv2d", str(expr)
    _run(im2col_call(Kernel("conv2d", "out", expr, CONV2D.match(expr)), "float64"), expr, seed % 1000)


def test_reads_a_convolution_cannot_take_do_not_match():
    shapes = {"X": (1, 2, 8), "W": (3, 2, 3)}
    assert CONV2D.match(parse("L n:1, f:3, h:4, w:2 ; S c:2, r:3 ; X[n, c, h+r] * W[f, c, r+1]", shapes)) is None
    assert CONV2D.match(parse("L f:3, h:6 ; S c:2, r:3 ; X[0, c, h+r] * W[f, c, r]", shapes)) is None  # one window
    assert CONV2D.match(parse("L f:3, h:6 ; S c:2 ; X[0, c, h] * W[f, c, 0]", shapes)) is None


# --------------------------------------------------------------------------------------------
# Band matmuls: G2BMM and GBMM, dilated, any layout; the blocked band kernel computes them


@st.composite
def band_matmuls(draw):
    """A G2BMM (the band is an output dimension) or a GBMM (the band is summed) with random
    sizes, dilation, offset, iterator orders and operand layouts."""
    summed = draw(st.booleans())
    b, rows, width, features = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 4)), 3
    dilation = draw(st.integers(1, 3))
    offset = draw(st.integers(-dilation * width, 1))
    y_rows = draw(st.integers(max(1, rows - 2), rows + 3))
    sizes = {"b": b, "i": rows, "w": width, "k": features}
    band = "w" if dilation == 1 else f"{dilation}*w"
    window = f"i+{band}{offset:+d}" if offset else f"i+{band}"
    x_dims = ["b", "i", "w" if summed else "k"]
    y_dims = {"b": "b", "row": window, "k": "k"}
    x_order, y_order = draw(st.permutations(x_dims)), draw(st.permutations(list(y_dims)))
    traversal = draw(st.permutations(["b", "i", "k" if summed else "w"]))
    x_read = f"X[{', '.join(x_order)}]"
    y_read = f"Y[{', '.join(y_dims[d] for d in y_order)}]"
    product = f"{x_read} * {y_read}" if draw(st.booleans()) else f"{y_read} * {x_read}"
    summation = "w" if summed else "k"
    text = f"L {', '.join(f'{i}:{sizes[i]}' for i in traversal)} ; S {summation}:{sizes[summation]} ; {product}"
    y_extent = {"b": b, "row": y_rows, "k": features}
    shapes = {"X": tuple(sizes[d] for d in x_order), "Y": tuple(y_extent[d] for d in y_order)}
    return parse(text, shapes), summed, dilation


@settings(max_examples=60, deadline=None)
@given(band_matmuls(), st.integers(0, 2**32 - 1))
def test_band_matmuls_match_their_tables_and_the_band_kernel_computes_them(drawn, seed):
    expr, summed, dilation = drawn
    match = (GBMM if summed else G2BMM).match(expr)
    assert isinstance(match, BandMatch), str(expr)
    assert (match.x, match.y, match.row, match.band, match.summed) == ("X", "Y", "i", "w", summed)
    assert match.dilation == dilation
    call = band_call(Kernel(match.kind, "out", expr, match), "float64")
    assert call is not None, str(expr)
    _run(call, expr, seed % 1000)


def test_a_band_read_with_a_row_stride_is_no_band_matmul():
    shapes = {"X": (2, 8, 3), "Y": (2, 20, 3)}
    expr = parse("L b:2, i:8, w:3 ; S k:3 ; X[b, i, k] * Y[b, 2*i+w, k]", shapes)
    assert G2BMM.match(expr) is None and match_operator(expr)[0] == "eop"


# --------------------------------------------------------------------------------------------
# GEMMs: any layout of a (batched) matmul is read in place


@st.composite
def batched_matmuls(draw):
    sizes = {"b": draw(st.integers(1, 3)), "m": draw(st.integers(2, 4)), "n": draw(st.integers(2, 4))}
    sizes["k"] = draw(st.integers(2, 4))
    traversal = draw(st.permutations(["b", "m", "n"]))
    a, b = draw(st.permutations(["b", "m", "k"])), draw(st.permutations(["b", "k", "n"]))
    text = f"L {', '.join(f'{i}:{sizes[i]}' for i in traversal)} ; S k:{sizes['k']} ; A[{', '.join(a)}] * B[{', '.join(b)}]"
    return parse(text, {"A": tuple(sizes[d] for d in a), "B": tuple(sizes[d] for d in b)})


@settings(max_examples=40, deadline=None)
@given(batched_matmuls(), st.integers(0, 2**32 - 1))
def test_every_layout_of_a_batched_matmul_is_a_gemm_read_in_place(expr, seed):
    kind, match = match_operator(expr)
    batch = next(it for it in expr.traversal if it.name == "b")
    assert kind == ("batch_matmul" if batch.size > 1 else "matmul")
    assert match.operator in (MATMUL, BATCH_MATMUL)
    assert implementations(Kernel(kind, "out", expr, match)) == ("blas", "tvm", "packed", "packed_wide", "transposed")
    _run(_step(Kernel(kind, "out", expr, match), "blas", "float64").call, expr, seed % 1000)


# --------------------------------------------------------------------------------------------
# Guided derivation toward a target operator's table; structures for selection


def test_the_operator_layout_rule_derives_toward_the_table_it_is_given():
    """OLLIE 5.2: GUIDEDDERIVE(E, T) reads the iterator mapping function off T's table."""
    layout = next(r for r in registered("guided") if r.name == "operator layout")
    shapes = {"A": (3, 5, 2, 2), "K": (5, 4)}
    scope = parse("L x:2, n:3, y:2, f:4 ; S c:5 ; A[n, c, x, y] * K[c, f]", shapes)
    assert layout.apply(scope) == []  # guided toward nothing, it proposes nothing
    inputs = random_inputs(scope, 1)
    for operator in OPERATORS:
        for result in layout.apply(scope, target=operator.table):
            np.testing.assert_allclose(evaluate(result, inputs), evaluate(scope, inputs), rtol=1e-12)
    (first, _) = layout.apply(scope, target=MATMUL.table)
    inner = first.body.source
    assert [it.name for it in inner.traversal] == ["n", "x", "y", "f"]  # m in A's order, then n
    assert layout.apply(scope, target=G2BMM.table) == []  # x, n, y index A alone: no G2BMM group


def test_a_kernels_structure_is_its_kind_and_its_operators_parameters():
    dilated = conv2d((1, 2, 9, 9), (3, 2, 3, 3), dilation=2)
    assert _structure(instantiate(dilated).kernels[0]) == ("conv2d", ((3, 2), (3, 2)))
    assert _structure(Kernel("eop", "out", dilated)) == ("eop",)


def test_the_product_inside_an_eoperator_is_found_where_it_is_the_one_sum():
    shapes = {"X": (6, 5), "W": (5, 4), "B": (4,)}
    fused = parse("L i:6, j:4 ; relu({ L m:6, n:4 ; S k:5 ; X[m, k] * W[k, n] }[i, j] + B[j])", shapes)
    position, product = inner_product(Kernel("eop", "out", fused, None, weights=frozenset({"W", "B"})))
    assert position == (0,) and product.kind == "matmul" and product.weights == {"W"}
    assert product.expr == parse("L m:6, n:4 ; S k:5 ; X[m, k] * W[k, n]", shapes)
    (matched,) = instantiate(product.expr).kernels
    assert inner_product(matched) == ((), matched)  # a matched kernel is its own product
    two = parse("L i:6 ; { L m:6 ; S k:5 ; X[m, k] }[i] + { L m:6 ; S k:4 ; W[k, m % 4] }[i]", shapes)
    assert inner_product(Kernel("eop", "out", two, None)) is None  # two sums: which one?
    no_operator = parse("L i:6 ; relu({ L m:6 ; S k:5 ; exp(X[m, k]) }[i])", shapes)
    assert inner_product(Kernel("eop", "out", no_operator, None)) is None  # a sum no operator matches
