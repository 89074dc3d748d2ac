"""Loop merging (codegen/merged.py): adjacent loops that every read takes whole become one loop
over views of the buffers, and the merged scope computes the same elements."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen import compile_scope
from codegen.merged import merge_loops
from rewriter import evaluate, parse
from rewriter.ir import tensor_shapes
from rewriter.testing.strategies import random_inputs


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REWRITER_CACHE", str(tmp_path_factory.mktemp("kernels")))
        yield


POINTWISE_7X7 = (
    "L i0:1, i1:24, i2:7, i3:7 ; min(max({ L n:1, f:24, h:7, w:7 ; S c:16, r:1, s:1 ; "
    "X[n, c, h+r, s+w] * K[f, c, r, s] }[0, i1, i2, i3] + B[i1], 0), 6)"
)
SHAPES_7X7 = {"X": (1, 16, 7, 7), "K": (24, 16, 1, 1), "B": (24,)}


def viewed_inputs(merged, inputs):
    return {name: inputs[name].reshape(shape) for name, shape in tensor_shapes(merged).items()}


def test_a_pointwise_convolution_over_a_small_image_runs_over_its_pixels_as_one_loop():
    expr = parse(POINTWISE_7X7, SHAPES_7X7)
    merged = merge_loops(expr)
    assert str(merged) == (
        "L i0:1, i1:24, i2:49 ; min(max({ L n:1, f:24, h:49 ; S c:16 ; X[0, c, h] * K[f, c, 0, 0] }[0, i1, i2]"
        " + B[i1], 0), 6)"
    )
    inputs = random_inputs(expr, 3)
    np.testing.assert_allclose(
        evaluate(merged, viewed_inputs(merged, inputs)).reshape(expr.shape), evaluate(expr, inputs), rtol=1e-12
    )
    kernel = compile_scope(expr, dtype="float64")
    assert kernel.views == ((1, 16, 49), (24, 16, 1, 1), (24,), (1, 24, 49))
    np.testing.assert_allclose(kernel(**inputs), evaluate(expr, inputs), rtol=1e-9)


def test_a_strided_pointwise_convolution_reads_its_input_through_the_merged_loop():
    expr = parse(  # in NCHW4c: 4 output channels innermost
        "L n:1, fo:2, h:7, w:7, fi:4 ; S co:4, ci:4, r:1, s:1 ; X[n, co, 2*h+r, 2*w+s, ci] * K[fi+4*fo, ci+4*co, r, s]",
        {"X": (1, 4, 14, 14, 4), "K": (8, 16, 1, 1)},
    )
    assert str(merge_loops(expr)) == (
        "L n:1, fo:2, h:49, fi:4 ; S co:4, ci:4 ; X[0, co, 2*(h/7), 2*(h%7), ci] * K[fi+4*fo, ci+4*co, 0, 0]"
    )
    inputs = random_inputs(expr, 5)
    kernel = compile_scope(expr, dtype="float64")
    assert kernel.views == ((1, 4, 14, 14, 4), (8, 16, 1, 1), (1, 2, 49, 4))  # the input as it lies
    np.testing.assert_allclose(kernel(**inputs), evaluate(expr, inputs), rtol=1e-9)


@pytest.mark.parametrize(
    "text, shape, merged",
    [
        # a shifted read along c: c stays its own loop (c+1 would wrap into the next row)
        ("L a:3, b:4, c:5 ; X[a, b, c] + X[a, b, c+1]", (3, 4, 5), "L a:12, c:5 ; X[a, c] + X[a, c+1]"),
        # the same tensor read transposed: no view serves both reads
        ("L a:4, b:4 ; X[a, b] * X[b, a]", (4, 4), "L a:4, b:4 ; X[a, b] * X[b, a]"),
        # a window read at h+r: h and w stay apart, the batch and channels merge
        ("L n:2, c:3, h:5, w:5 ; S r:3 ; X[n, c, h+r-1, w]", (2, 3, 5, 5), "L n:6, h:5, w:5 ; S r:3 ; X[n, h+r-1, w]"),
        # a global average pool's sum over the pixels merges too
        ("L n:1, c:8 ; S h:7, w:7 ; X[n, c, h, w] / 49", (1, 8, 7, 7), "L n:1, c:8 ; S h:49 ; X[0, c, h] / 49"),
        # loops of one value are read at it: a 1x1 window's r and s, laid out first, and n
        (
            "L r:1, s:1, n:1, f:4, h:3, w:3 ; S c:2 ; X[n, c, h+r, s+w] * K[f, c, r, s]",
            (1, 2, 3, 3),
            "L r:1, f:4, h:9 ; S c:2 ; X[0, c, h] * K[f, c, 0, 0]",
        ),
        # a box that does not start at 0
        ("L a:1..4, b:4 ; X[a, b]", (4, 4), "L a:1..4, b:4 ; X[a, b]"),
        # a stride-2 1x1 convolution's input, its output channels innermost (a blocked
        # layout's): read through the merged loop's rows and columns
        (
            "L h:3, w:3, f:4 ; S c:2 ; X[c, 2*h, 2*w+1] * K[f, c, 0, 0]",
            (2, 6, 7),
            "L h:9, f:4 ; S c:2 ; X[c, 2*(h/3), 2*(h%3)+1] * K[f, c, 0, 0]",
        ),
        # ... its columns innermost (NCHW): they keep the vector lanes, and their loop
        (
            "L f:4, h:3, w:3 ; S c:2 ; X[c, 2*h, 2*w] * K[f, c, 0, 0]",
            (2, 6, 6),
            "L f:4, h:3, w:3 ; S c:2 ; X[c, 2*h, 2*w] * K[f, c, 0, 0]",
        ),
        # a stride-2 window stays apart
        ("L h:3, w:3, f:2 ; S r:2 ; X[f, 2*h+r, 2*w]", (2, 6, 6), "L h:3, w:3, f:2 ; S r:2 ; X[f, 2*h+r, 2*w]"),
    ],
)
def test_only_loops_every_read_takes_whole_merge(text, shape, merged):
    assert str(merge_loops(parse(text, {"X": shape, "K": (4, 2, 1, 1)}))) == merged


# Scopes over a box whose reads are exact, shifted, subsampled, transposed or broadcast, with a
# nested sum read whole or not: every merge ``merge_loops`` makes must keep every element.
@st.composite
def scopes_to_merge(draw):
    dims = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
    names = [f"i{k}" for k in range(len(dims))]
    box = ", ".join(f"{n}:{d}" for n, d in zip(names, dims))
    exact = "X[" + ", ".join(names) + "]"
    kept = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    kept.sort(key=names.index)
    broadcast = "Y[" + ", ".join(kept) + "]"
    terms = [exact, broadcast]
    shapes = {"X": tuple(dims), "Y": tuple(dims[names.index(n)] for n in kept)}
    if draw(st.booleans()):  # a read shifted along one loop
        k = draw(st.integers(0, len(dims) - 1))
        terms.append("Z[" + ", ".join(f"{n}+1" if j == k else n for j, n in enumerate(names)) + "]")
        shapes["Z"] = tuple(dims)
    if draw(st.booleans()):  # a read subsampled along every loop (a strided convolution's input)
        stride = draw(st.integers(2, 3))
        terms.append("V[" + ", ".join(f"{stride}*{n}" for n in names) + "]")
        shapes["V"] = tuple(stride * d for d in dims)
    if draw(st.booleans()):  # a nested sum over a new loop, read at the outer loops
        inner = ", ".join(f"j{k}:{d}" for k, d in enumerate(dims))
        reads = ", ".join(f"j{k}" for k in range(len(dims)))
        terms.append(f"{{ L {inner} ; S r:3 ; W[{reads}, r] }}[" + ", ".join(names) + "]")
        shapes["W"] = (*dims, 3)
    ops = draw(st.lists(st.sampled_from(["+", "*", "-"]), min_size=len(terms) - 1, max_size=len(terms) - 1))
    body = terms[0] + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:]))
    return parse(f"L {box} ; {body}", shapes)


@settings(max_examples=150, deadline=None)
@given(scopes_to_merge(), st.integers(0, 2**16))
def test_a_merged_scope_computes_every_element_its_scope_does(expr, seed):
    merged = merge_loops(expr)
    inputs = random_inputs(expr, seed)
    got = evaluate(merged, viewed_inputs(merged, inputs))
    np.testing.assert_allclose(got.reshape(expr.shape), evaluate(expr, inputs), rtol=1e-12, atol=1e-12)
