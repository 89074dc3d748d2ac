"""Builders: each against numpy / PyTorch / explicit loops, exact printed text, round trips,
and the errors that name the problem."""

import functools
import re

import numpy as np
import pytest

from rewriter import ExpressionError, Scope, Tensor, evaluate, parse
from rewriter.cases import CASES
from rewriter.ir import tensor_shapes
from rewriter.ir.builders import (
    absolute,
    add,
    batch_matmul,
    binary,
    compare,
    conv2d,
    conv_transpose2d,
    div,
    einsum,
    exp,
    g2bmm,
    gbmm,
    layer_norm,
    matmul,
    maximum,
    mul,
    reduce_max,
    reduce_mean,
    reduce_norm,
    reduce_sum,
    relu,
    sigmoid,
    softmax,
    sqrt,
    sub,
    tanh,
    unary,
    where,
)


def run(expr: Scope, seed: int = 0, positive: bool = False):
    """Evaluate ``expr`` on random inputs; returns (result, inputs)."""
    rng = np.random.default_rng(seed)
    inputs = {name: rng.standard_normal(shape) for name, shape in tensor_shapes(expr).items()}
    if positive:
        inputs = {name: np.abs(v) + 0.1 for name, v in inputs.items()}
    return evaluate(expr, inputs), inputs


def assert_round_trips(expr: Scope):
    assert parse(str(expr), tensor_shapes(expr)) == expr


# --------------------------------------------------------------------------------------------
# Exact printed text


def test_public_cases_print_exactly():
    cases = {
        "conv5x5": conv2d((16, 32, 224, 224), (1, 32, 5, 5), padding=2),
        "conv3x3": conv2d((1, 7, 7, 512), (3, 3, 512, 512), padding=1, layout="NHWC"),
        "convtranspose": conv_transpose2d((16, 2, 2, 256), (4, 4, 448, 256), stride=2, padding=1, layout="NHWC"),
        "g2bmm": g2bmm(Tensor("Q", (8, 10000, 64)), Tensor("Kt", (8, 10000, 64)), 32, dilation=4),
    }
    assert (
        str(cases["conv5x5"]) == "L n:16, f:1, h:224, w:224 ; S c:32, r:5, s:5 ; A[n, c, h+r-2, w+s-2] * K[f, c, r, s]"
    )
    assert str(cases["conv3x3"]) == "L n:1, h:7, w:7, f:512 ; S c:512, r:3, s:3 ; A[n, h+r-1, w+s-1, c] * K[r, s, f, c]"
    assert str(cases["convtranspose"]) == (
        "L n:16, h:4, w:4, f:448 ; S x:2, y:2, c:256 ; A[n, x, y, c] * K[h+1-2*x, w+1-2*y, f, c]"
    )
    assert str(cases["g2bmm"]) == "L b:8, i:10000, j:65 ; S k:64 ; Q[b, i, k] * Kt[b, i+4*j-128, k]"
    for name, expr in cases.items():
        assert expr == CASES[name].expression()


@pytest.mark.parametrize(
    "expr, text",
    [
        (lambda: matmul((2, 3), (3, 4)), "L i:2, j:4 ; S k:3 ; A[i, k] * B[k, j]"),
        (lambda: matmul((3, 2), (4, 3), transpose_a=True, transpose_b=True), "L i:2, j:4 ; S k:3 ; A[k, i] * B[j, k]"),
        (lambda: batch_matmul((5, 2, 3), (5, 3, 4)), "L b:5, i:2, j:4 ; S k:3 ; A[b, i, k] * B[b, k, j]"),
        (
            lambda: conv2d((1, 3, 9, 9), (4, 3, 3, 3), stride=2, padding=1),
            "L n:1, f:4, h:5, w:5 ; S c:3, r:3, s:3 ; A[n, c, 2*h+r-1, 2*w+s-1] * K[f, c, r, s]",
        ),
        (
            lambda: conv2d((1, 3, 9, 9), (4, 3, 3, 3), dilation=2, padding=2),
            "L n:1, f:4, h:9, w:9 ; S c:3, r:3, s:3 ; A[n, c, h+2*r-2, w+2*s-2] * K[f, c, r, s]",
        ),
        (
            lambda: conv2d((1, 8, 5, 5), (4, 2, 1, 1), groups=4),
            "L n:1, f:4, h:5, w:5 ; S c:2, r:1, s:1 ; A[n, 2*f+c, h+r, w+s] * K[f, c, r, s]",
        ),
        (
            lambda: conv2d((1, 4, 5, 5), (8, 2, 1, 1), groups=2),
            "L n:1, f:8, h:5, w:5 ; S c:2, r:1, s:1 ; A[n, 2*(f/4)+c, h+r, w+s] * K[f, c, r, s]",
        ),
        (
            lambda: conv_transpose2d((1, 3, 4, 4), (3, 2, 3, 3)),
            "L n:1, f:2, h:6, w:6 ; S c:3, x:4, y:4 ; A[n, c, x, y] * K[c, f, h-x, w-y]",
        ),
        (lambda: gbmm((2, 6, 5), (2, 6, 3), 2), "L b:2, i:6, k:3 ; S j:5 ; A[b, i, j] * V[b, i+j-2, k]"),
        (lambda: add((3, 1), (4,)), "L i0:3, i1:4 ; A[i0, 0] + B[i1]"),
        (lambda: maximum((2, 3), 0.0), "L i0:2, i1:3 ; max(A[i0, i1], 0)"),
        (lambda: unary("neg", (2,)), "L i0:2 ; -A[i0]"),
        (
            lambda: relu(matmul((2, 3), (3, 4))),
            "L i0:2, i1:4 ; relu({ L i:2, j:4 ; S k:3 ; A[i, k] * B[k, j] }[i0, i1])",
        ),
        (lambda: reduce_sum((2, 3, 4), 1), "L i0:2, i2:4 ; S r1:3 ; A[i0, r1, i2]"),
        (lambda: reduce_max((2, 3), -1, keepdims=True), "L i0:2, i1:1 ; M r1:3 ; A[i0, r1]"),
        (lambda: reduce_mean((2, 4), 1), "L i0:2 ; S r1:4 ; A[i0, r1] * 0.25"),
        (lambda: einsum("ij,jk->ik", (2, 3), (3, 4)), "L i:2, k:4 ; S j:3 ; A[i, j] * B[j, k]"),
        (lambda: einsum("ii", (3, 3)), "L ; S i:3 ; A[i, i]"),
        (lambda: einsum("LS,SM", (2, 3), (3, 4)), "L L_:2, M_:4 ; S S_:3 ; A[L_, S_] * B[S_, M_]"),
    ],
)
def test_printed_text(expr, text):
    assert str(expr()) == text


def test_default_name_taken_by_another_operand_gets_a_digit():
    # B@B would be silently wrong: the shape operand must not reuse the tensor B's name
    assert str(matmul(Tensor("B", (2, 2)), (2, 2))) == "L i:2, j:2 ; S k:2 ; B[i, k] * B1[k, j]"
    e = add(matmul((2, 3), (3, 4)), (2, 4))
    assert sorted(tensor_shapes(e)) == ["A", "B", "B1"]


# --------------------------------------------------------------------------------------------
# Matrix products and einsum against numpy


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul(ta, tb):
    a, b = ((3, 2) if ta else (2, 3)), ((4, 3) if tb else (3, 4))
    out, x = run(matmul(a, b, transpose_a=ta, transpose_b=tb))
    np.testing.assert_allclose(out, (x["A"].T if ta else x["A"]) @ (x["B"].T if tb else x["B"]))


@pytest.mark.parametrize("ta, tb", [(False, False), (True, True)])
def test_batch_matmul(ta, tb):
    out, x = run(batch_matmul((2, 4, 3) if ta else (2, 3, 4), (2, 5, 4) if tb else (2, 4, 5), ta, tb))
    a = x["A"].transpose(0, 2, 1) if ta else x["A"]
    b = x["B"].transpose(0, 2, 1) if tb else x["B"]
    np.testing.assert_allclose(out, np.matmul(a, b))


def test_scopes_compose():
    chain = matmul(matmul((3, 4), (4, 5)), (5, 2))
    out, x = run(chain)
    np.testing.assert_allclose(out, x["A"] @ x["B"] @ x["B1"])
    # a scope whose range starts at 1 is read from its first element, like a tensor
    shifted = parse("L i:1..4 ; A[i]", {"A": (5,)})
    out, x = run(relu(shifted))
    np.testing.assert_allclose(out, np.maximum(x["A"][1:4], 0))


def test_size_one_axes():
    # a size-1 iterator used in an index (batch_matmul with one row, a summed axis of size 1)
    out, x = run(batch_matmul((2, 1, 3), (2, 3, 1)))
    np.testing.assert_allclose(out, np.matmul(x["A"], x["B"]))
    out, x = run(reduce_sum((2, 1, 3), 1))
    np.testing.assert_allclose(out, x["A"].sum(axis=1))
    out, x = run(add((2, 1, 3), (2, 1, 1)))
    np.testing.assert_allclose(out, x["A"] + x["B"])


@pytest.mark.parametrize(
    "subscripts, shapes",
    [
        ("ij,jk->ik", [(2, 3), (3, 4)]),
        ("ij,jk", [(2, 3), (3, 4)]),
        ("bij,bjk->bki", [(2, 3, 4), (2, 4, 5)]),
        ("ij->ji", [(2, 3)]),
        ("ii->i", [(3, 3)]),
        ("ii", [(3, 3)]),
        ("i,j->ij", [(2,), (3,)]),
        ("ij,ij->", [(2, 3), (2, 3)]),
        ("ba", [(2, 3)]),
        ("Ba", [(2, 3)]),
        ("ijk,kl,lm->mi", [(2, 3, 4), (4, 2), (2, 3)]),
        ("iij->j", [(2, 2, 3)]),
        (" i j , j k -> i k ", [(2, 3), (3, 4)]),
    ],
)
def test_einsum(subscripts, shapes):
    expr = einsum(subscripts, *shapes)
    out, x = run(expr)
    names = [t for t in "ABCD"][: len(shapes)]
    np.testing.assert_allclose(out, np.einsum(subscripts.replace(" ", ""), *(x[n] for n in names)))
    assert_round_trips(expr)


def test_einsum_keeps_tensor_names_and_reads_scopes():
    expr = einsum("ij,jk->ik", Tensor("X", (2, 3)), matmul((3, 4), (4, 2)))
    out, x = run(expr)
    np.testing.assert_allclose(out, x["X"] @ (x["A"] @ x["B"]))


# --------------------------------------------------------------------------------------------
# Convolutions against PyTorch


def _nhwc(t):
    return t.permute(0, 2, 3, 1)


CONV_PARAMS = [
    dict(),
    dict(padding=1),
    dict(stride=2, padding=1),
    dict(stride=(2, 1), padding=(1, 2)),
    dict(dilation=2, padding=2),
    dict(stride=2, dilation=(1, 2), padding=(0, 1)),
    dict(groups=2, padding=1),
    dict(groups=4, stride=2),
    dict(groups=8, padding=1),  # depthwise
]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("params", CONV_PARAMS, ids=str)
def test_conv2d_against_torch(params, layout):
    torch = pytest.importorskip("torch")
    groups = params.get("groups", 1)
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((2, 8, 7, 6)))
    w = torch.from_numpy(rng.standard_normal((8, 8 // groups, 3, 2)))
    expected = torch.nn.functional.conv2d(x, w, **params)
    if layout == "NCHW":
        expr = conv2d(tuple(x.shape), tuple(w.shape), layout=layout, **params)
        out = evaluate(expr, {"A": x.numpy(), "K": w.numpy()})
    else:
        # OLLIE's layouts: input (N, H, W, C), weight (R, S, F, C/groups)
        xs, ws = _nhwc(x), w.permute(2, 3, 0, 1)
        expr = conv2d(tuple(xs.shape), tuple(ws.shape), layout=layout, **params)
        out = evaluate(expr, {"A": xs.numpy(), "K": ws.numpy()})
        expected = _nhwc(expected)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-10)
    assert_round_trips(expr)


CONVT_PARAMS = [
    dict(),
    dict(stride=2),
    dict(stride=2, padding=1),
    dict(stride=2, padding=1, output_padding=1),
    dict(stride=(3, 2), padding=(2, 0), output_padding=(1, 1)),
    dict(padding=1),
]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("params", CONVT_PARAMS, ids=str)
def test_conv_transpose2d_against_torch(params, layout):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4, 5)))
    w = torch.from_numpy(rng.standard_normal((3, 4, 4, 3)))  # (C, F, R, S)
    expected = torch.nn.functional.conv_transpose2d(x, w, **params)
    if layout == "NCHW":
        expr = conv_transpose2d(tuple(x.shape), tuple(w.shape), layout=layout, **params)
        out = evaluate(expr, {"A": x.numpy(), "K": w.numpy()})
    else:
        xs, ws = _nhwc(x), w.permute(2, 3, 1, 0)  # weight (R, S, F, C)
        expr = conv_transpose2d(tuple(xs.shape), tuple(ws.shape), layout=layout, **params)
        out = evaluate(expr, {"A": xs.numpy(), "K": ws.numpy()})
        expected = _nhwc(expected)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-10)
    assert_round_trips(expr)


def test_relu_of_conv_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3))
    expr = relu(conv2d(x.shape, w.shape, padding=1))
    expected = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1))
    np.testing.assert_allclose(evaluate(expr, {"A": x, "K": w}), expected.numpy(), atol=1e-10)


# --------------------------------------------------------------------------------------------
# Band products against loops


def g2bmm_loops(q, k, width, dilation):
    batch, n, _ = q.shape
    out = np.zeros((batch, n, 2 * width + 1))
    for b in range(batch):
        for i in range(n):
            for j in range(2 * width + 1):
                row = i + dilation * (j - width)
                if 0 <= row < k.shape[1]:
                    out[b, i, j] = q[b, i] @ k[b, row]
    return out


def gbmm_loops(a, v, width, dilation):
    batch, n, band = a.shape
    out = np.zeros((batch, n, v.shape[2]))
    for b in range(batch):
        for i in range(n):
            for j in range(band):
                row = i + dilation * (j - width)
                if 0 <= row < v.shape[1]:
                    out[b, i] += a[b, i, j] * v[b, row]
    return out


@pytest.mark.parametrize("width, dilation", [(0, 1), (1, 1), (2, 1), (2, 3), (3, 2)])
def test_g2bmm_and_gbmm(width, dilation):
    scores = g2bmm((2, 9, 4), (2, 9, 4), width, dilation)
    out, x = run(scores)
    np.testing.assert_allclose(out, g2bmm_loops(x["Q"], x["K"], width, dilation))
    mixed = gbmm((2, 9, 2 * width + 1), (2, 9, 3), width, dilation)
    out, x = run(mixed)
    np.testing.assert_allclose(out, gbmm_loops(x["A"], x["V"], width, dilation))
    # attention as one expression: band scores feed the band product
    both = gbmm(scores, (2, 9, 4), width, dilation)
    out, x = run(both)
    np.testing.assert_allclose(out, gbmm_loops(g2bmm_loops(x["Q"], x["K"], width, dilation), x["V"], width, dilation))


# --------------------------------------------------------------------------------------------
# Element-wise operations, reductions, softmax, layer norm against numpy


@pytest.mark.parametrize(
    "builder, reference",
    [
        (relu, lambda a: np.maximum(a, 0)),
        (exp, np.exp),
        (tanh, np.tanh),
        (sigmoid, lambda a: 1 / (1 + np.exp(-a))),
        (sqrt, np.sqrt),
        (lambda x: unary("neg", x), np.negative),
    ],
)
def test_unary(builder, reference):
    expr = builder((2, 3))
    out, x = run(expr, positive=builder is sqrt)
    np.testing.assert_allclose(out, reference(x["A"]))
    assert_round_trips(expr)


@pytest.mark.parametrize(
    "builder, reference",
    [(add, np.add), (sub, np.subtract), (mul, np.multiply), (div, np.divide), (maximum, np.maximum)],
)
@pytest.mark.parametrize("shapes", [((2, 3), (2, 3)), ((3, 1), (4,)), ((1,), (2, 1, 3)), ((2, 1, 4), (3, 1))])
def test_binary_broadcasts_like_numpy(builder, reference, shapes):
    expr = builder(*shapes)
    out, x = run(expr, positive=True)
    np.testing.assert_allclose(out, reference(x["A"], x["B"]))
    assert_round_trips(expr)


def test_binary_with_a_constant():
    out, x = run(binary("-", 1.5, (2, 3)))
    np.testing.assert_allclose(out, 1.5 - x["A"])


def test_where_chooses_exactly_even_past_an_infinity_or_a_nan_it_does_not_choose():
    """``c * a + (1 - c) * b`` would make ``0 * inf`` or ``0 * nan``, a NaN, where the branch not
    chosen is infinite (a log of 0: T5's position buckets) or undefined (``n / d`` at ``d = 0``);
    ``select`` keeps the branch chosen exactly, an infinity too. A constant is finite: a ``-inf``
    fill is the lowest float32."""
    c = np.array([1.0, 0.0, 1.0, 0.0, 1.0])
    a = np.array([2.5, -np.inf, np.inf, np.nan, -0.0])
    b = np.array([np.nan, 3.0, 1.0, -np.inf, np.inf])
    out = evaluate(where((5,), (5,), (5,)), {"C": c, "A": a, "B": b})
    np.testing.assert_array_equal(out, [2.5, 3.0, np.inf, -np.inf, 0.0])
    out = evaluate(where((5,), (5,), -np.inf), {"C": c, "A": a})
    lowest = -np.finfo(np.float32).max
    np.testing.assert_array_equal(out, [2.5, lowest, np.inf, lowest, 0.0])


@pytest.mark.parametrize("op", ["equal", "less", "less_equal", "greater", "greater_equal"])
def test_a_comparison_with_an_infinity_takes_a_clamped_infinity_for_it(op):
    """A -inf fill is the lowest float32 (above): compared with -inf or +inf, on either side, a
    value past half the float32 range is the infinity, as IEEE arithmetic would compare the
    infinity itself (attention's ``scores == -inf`` finds its masked scores)."""
    highest = float(np.finfo(np.float32).max)
    held = np.array([-highest, -highest + 1e31, -1e30, 0.0, 5.0, highest], np.float32)
    meant = np.array([-np.inf, -np.inf, -1e30, 0.0, 5.0, np.inf])
    compared = getattr(np, op)
    for infinity in (-np.inf, np.inf):
        np.testing.assert_array_equal(evaluate(compare(op, (6,), infinity), {"A": held}), compared(meant, infinity))
        np.testing.assert_array_equal(evaluate(compare(op, infinity, (6,)), {"A": held}), compared(infinity, meant))


def test_a_safe_division_is_zero_where_the_divisor_is():
    n, d = Tensor("n", (4,)), Tensor("d", (4,))
    safe = where(compare("greater", absolute(d), 0.0), div(n, d), 0.0)
    assert "select(" in str(safe) and parse(str(safe), {"n": (4,), "d": (4,)}) == safe
    with np.errstate(divide="ignore", invalid="ignore"):
        out = evaluate(safe, {"n": np.array([0.0, 1.0, 2.0, 3.0]), "d": np.array([0.0, 0.0, 2.0, 4.0])})
    np.testing.assert_array_equal(out, [0.0, 0.0, 1.0, 0.75])


@pytest.mark.parametrize("axes", [0, 1, -1, (0, 2), (2, 0), None, ()])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(axes, keepdims):
    l1 = functools.partial(reduce_norm, ord=1)
    l1_reference = lambda a, **kw: np.abs(a).sum(**kw)  # noqa: E731
    l2_reference = lambda a, **kw: np.sqrt((a * a).sum(**kw))  # noqa: E731
    builders = [(reduce_sum, np.sum), (reduce_max, np.max), (reduce_mean, np.mean)]
    for builder, reference in builders + [(reduce_norm, l2_reference), (l1, l1_reference)]:
        expr = builder((2, 3, 4), axes, keepdims=keepdims)
        out, x = run(expr)
        np.testing.assert_allclose(out, reference(x["A"], axis=axes, keepdims=keepdims))
        if expr.traversal:  # a rank-0 scope prints "L ; S ..." fine, but skip the trivial case
            assert_round_trips(expr)


@pytest.mark.parametrize("shape, axis", [((5,), -1), ((2, 5), -1), ((2, 5), 0), ((2, 3, 4), 1)])
def test_softmax(shape, axis):
    expr = softmax(shape, axis)
    out, x = run(expr)
    a = x["A"] * 50  # large values: the stable form must not overflow
    out = evaluate(expr, {"A": a})
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=axis, keepdims=True))
    assert np.all(np.isfinite(out))
    assert_round_trips(expr)


@pytest.mark.parametrize("shape, axes", [((2, 5), -1), ((5,), -1), ((2, 3, 4), (1, 2)), ((2, 3, 4), (-2, -1))])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm(shape, axes, affine):
    normalized = shape[-(len(axes) if isinstance(axes, tuple) else 1) :]
    kwargs = dict(weight=normalized, bias=normalized) if affine else {}
    expr = layer_norm(shape, axes, eps=1e-3, **kwargs)
    out, x = run(expr)
    a, ax = x["A"], tuple(range(len(shape) - len(normalized), len(shape)))
    mean = a.mean(axis=ax, keepdims=True)
    expected = (a - mean) / np.sqrt(((a - mean) ** 2).mean(axis=ax, keepdims=True) + 1e-3)
    if affine:
        expected = expected * x["W"] + x["B"]
    np.testing.assert_allclose(out, expected)
    assert_round_trips(expr)


def test_layer_norm_against_torch():
    torch = pytest.importorskip("torch")
    expr = layer_norm((2, 3, 4), (1, 2), weight=(3, 4), bias=(3, 4))
    out, x = run(expr)
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    expected = torch.nn.functional.layer_norm(t["A"], (3, 4), t["W"], t["B"], eps=1e-5)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-10)


# --------------------------------------------------------------------------------------------
# Round trips of every builder


@pytest.mark.parametrize(
    "make",
    [
        lambda: matmul((2, 3), (4, 3), transpose_b=True),
        lambda: batch_matmul((2, 3, 4), (2, 4, 5)),
        lambda: conv2d((1, 4, 6, 6), (4, 2, 3, 3), stride=2, padding=1, dilation=2, groups=2),
        lambda: conv2d((1, 6, 6, 4), (3, 3, 4, 1), padding=(1, 0), groups=4, layout="NHWC"),
        lambda: conv_transpose2d((1, 3, 3, 2), (3, 3, 5, 2), stride=2, padding=1, output_padding=1, layout="NHWC"),
        lambda: g2bmm((1, 8, 2), (1, 8, 2), 2, 3),
        lambda: gbmm((1, 8, 5), (1, 8, 2), 2, 3),
        lambda: sigmoid(add((2, 1), (3,))),
        lambda: reduce_mean((3, 3), 1, keepdims=True),
        lambda: reduce_max(relu((2, 3)), 0),
        lambda: softmax(matmul((2, 3), (3, 4))),
        lambda: layer_norm((2, 3), weight=Tensor("gamma", (3,))),
        lambda: einsum("abc,cd->da", (2, 3, 4), (4, 5)),
    ],
)
def test_every_builder_round_trips(make):
    assert_round_trips(make())


# --------------------------------------------------------------------------------------------
# Errors name the problem


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: matmul((2, 3), (4, 5)), "matmul: inner dimensions differ: A has 3 columns, B has 4 rows"),
        (lambda: matmul((2, 3, 4), (4, 5)), "matmul: operand A must have rank 2"),
        (
            lambda: matmul(matmul((2, 3), (3, 4)), (5, 2)),
            "matmul: inner dimensions differ: the scope passed as a has 4 columns, B1 has 5 rows",
        ),
        (lambda: matmul("A", (2, 2)), "matmul: argument a must be a Tensor, a Scope or a shape tuple, got str"),
        (lambda: matmul((2, 0), (0, 2)), "matmul: tensor A: dimension 1 has size 0"),
        (lambda: matmul(Tensor("A", (2, 3)), Tensor("A", (3, 4))), "matmul: tensor A is used with two shapes"),
        (lambda: batch_matmul((2, 3, 4), (3, 4, 5)), "batch_matmul: batch sizes differ: A has 2, B has 3"),
        (
            lambda: conv2d((1, 4, 5, 5), (2, 3, 3, 3)),
            "conv2d: weight K has 3 input channels per group, input A has 4 channels and groups=1",
        ),
        (lambda: conv2d((1, 4, 5, 5), (3, 2, 3, 3), groups=2), "conv2d: groups=2 must divide"),
        (lambda: conv2d((1, 4, 5, 5), (2, 4, 3, 3), stride=0), "conv2d: stride must be at least 1, got 0"),
        (lambda: conv2d((1, 4, 5, 5), (2, 4, 3, 3), padding=-1), "conv2d: padding must be at least 0, got -1"),
        (lambda: conv2d((1, 4, 5, 5), (2, 4, 3, 3), padding=(1, 2, 3)), "conv2d: padding must be an integer or a pair"),
        (lambda: conv2d((1, 4, 5, 5), (2, 4, 3, 3), dilation=1.5), "conv2d: dilation must be an integer, got 1.5"),
        (lambda: conv2d((1, 4, 5, 5), (2, 4, 3, 3), stride=(1, 0)), "conv2d: stride (width) must be at least 1"),
        (lambda: conv2d((1, 4, 5, 5), (2, 4, 3, 3), layout="NCWH"), "conv2d: layout must be one of NCHW, NHWC"),
        (lambda: conv2d((1, 4, 2, 5), (2, 4, 3, 3)), "conv2d: the kernel does not fit: input height 2"),
        (lambda: conv2d((4, 5, 5), (2, 4, 3, 3)), "conv2d: input A must have rank 4"),
        (
            lambda: conv_transpose2d((1, 4, 5, 5), (3, 2, 3, 3)),
            "conv_transpose2d: weight K has 3 input channels, input A has 4",
        ),
        (
            lambda: conv_transpose2d((1, 4, 5, 5), (4, 2, 3, 3), stride=2, output_padding=2),
            "conv_transpose2d: output_padding (2, 2) must be smaller than the stride",
        ),
        (
            lambda: conv_transpose2d((1, 4, 1, 1), (4, 2, 1, 1), padding=1),
            "conv_transpose2d: padding (1, 1) leaves an empty output",
        ),
        (lambda: g2bmm((2, 8, 4), (2, 8, 3), 1), "g2bmm: feature sizes differ: Q has 4, K has 3"),
        (lambda: g2bmm((2, 8, 4), (2, 8, 4), -1), "g2bmm: width must be at least 0, got -1"),
        (lambda: g2bmm((2, 8, 4), (2, 8, 4), 1, dilation=0), "g2bmm: dilation must be at least 1, got 0"),
        (lambda: gbmm((2, 8, 4), (2, 8, 3), 2), "gbmm: A has a band of 4 but width 2 needs 2*width+1 = 5"),
        (lambda: add((2, 3), (4, 3)), "add: shapes do not broadcast: A (2, 3) and B (4, 3) differ in axis -2"),
        (lambda: binary("**", (2,), (2,)), "binary: unknown operator '**'"),
        (lambda: binary("+", 1, 2), "binary: at least one operand must be"),
        (lambda: unary("cosh", (2,)), "unary: unknown function 'cosh'"),
        (lambda: reduce_sum((2, 3), 2), "reduce_sum: axis 2 is out of range for rank 2"),
        (lambda: reduce_max((2, 3), (0, -2)), "reduce_max: axis -2 is repeated"),
        (lambda: reduce_mean((2, 3), 1.0), "reduce_mean: axis 1.0 is not an integer"),
        (lambda: reduce_norm((2, 3), 1, ord=3), "reduce_norm: ord 3 is not 1 or 2"),
        (lambda: softmax((2, 3), (0, 1)), "softmax: softmax takes a single axis"),
        (lambda: layer_norm((2, 3, 4), (0, 1)), "layer_norm: axes (0, 1) must be the trailing axes"),
        (lambda: layer_norm((2, 3), weight=(2,)), "layer_norm: weight W has shape (2,), the normalised shape is (3,)"),
        (lambda: layer_norm((2, 3), eps=-1.0), "layer_norm: eps must be a non-negative number"),
        (
            lambda: einsum("ij,jk->ik", (2, 3), (4, 5)),
            "einsum: letter 'j' has size 3 in A (axis 1) but 4 in B (axis 0)",
        ),
        (lambda: einsum("ii", (2, 3)), "einsum: letter 'i' has size 2 in A (axis 0) but 3 in A (axis 1)"),
        (lambda: einsum("ij,jk->ik", (2, 3)), "einsum: subscripts 'ij,jk->ik' name 2 operand(s), 1 given"),
        (lambda: einsum("ijk", (2, 3)), "einsum: subscript 'ijk' has 3 letter(s) but A has rank 2"),
        (lambda: einsum("ij->iz", (2, 3)), "einsum: output letter 'z' appears in no operand"),
        (lambda: einsum("ij->ii", (2, 3)), "einsum: output subscript 'ii' repeats a letter"),
        (lambda: einsum("...i->i", (2, 3)), "einsum: ellipsis"),
        (lambda: einsum("i1->i", (2, 3)), "einsum: subscript character '1' is not a letter"),
        (lambda: einsum("ij"), "einsum: at least one operand is needed"),
    ],
)
def test_errors_name_the_problem(call, message):
    with pytest.raises(ExpressionError, match="^" + re.escape(message)):
        call()
