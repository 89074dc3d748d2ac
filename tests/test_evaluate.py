"""Reference semantics: the public cases against PyTorch / explicit loops, small and at full size."""

import numpy as np
import pytest

import rewriter.semantics.reference as reference
from rewriter import ExpressionError, evaluate, parse, parse_program
from rewriter.cases import CASES
from rewriter.ir import constant
from rewriter.semantics import sample_inputs

CONV3X3 = "L n:{N}, h:{H}, w:{W}, f:{F} ; S c:{C}, r:3, s:3 ; A[n, h+r-1, w+s-1, c] * K[r, s, f, c]"
CONVT = "L n:{N}, h:{H2}, w:{W2}, f:{F} ; S x:{H}, y:{W}, c:{C} ; A[n, x, y, c] * K[h+1-2*x, w+1-2*y, f, c]"
CONV5X5 = "L n:{N}, f:{F}, h:{H}, w:{W} ; S c:{C}, r:5, s:5 ; A[n, c, h+r-2, w+s-2] * K[f, c, r, s]"
G2BMM = "L b:{B}, i:{N}, j:{J} ; S k:{D} ; Q[b, i, k] * Kt[b, i+{dil}*j-{off}, k]"


def random_inputs(shapes, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}


def g2bmm_loops(q, k, width, dilation):
    """out[b, i, j] = sum_d q[b, i, d] * k[b, i + dilation*(j - width), d], 0 outside."""
    batch, n, _ = q.shape
    out = np.zeros((batch, n, 2 * width + 1))
    for j in range(2 * width + 1):
        shift = dilation * (j - width)
        lo, hi = max(0, -shift), min(n, n - shift)
        if lo < hi:
            out[:, lo:hi, j] = np.einsum("bid,bid->bi", q[:, lo:hi], k[:, lo + shift : hi + shift])
    return out


def torch_reference(name, inputs):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
    if name == "conv3x3":
        return F.conv2d(t["A"].permute(0, 3, 1, 2), t["K"].permute(2, 3, 0, 1), padding=1).permute(0, 2, 3, 1).numpy()
    if name == "convtranspose":
        out = F.conv_transpose2d(t["A"].permute(0, 3, 1, 2), t["K"].permute(3, 2, 0, 1), stride=2, padding=1)
        return out.permute(0, 2, 3, 1).numpy()
    if name == "conv5x5":
        return F.conv2d(t["A"], t["K"], padding=2).numpy()
    raise KeyError(name)


SMALL = {
    "conv3x3": (CONV3X3.format(N=2, H=5, W=6, F=4, C=3), {"A": (2, 5, 6, 3), "K": (3, 3, 4, 3)}),
    "convtranspose": (CONVT.format(N=2, H=3, W=2, H2=6, W2=4, F=5, C=3), {"A": (2, 3, 2, 3), "K": (4, 4, 5, 3)}),
    "conv5x5": (CONV5X5.format(N=2, F=3, H=7, W=6, C=4), {"A": (2, 4, 7, 6), "K": (3, 4, 5, 5)}),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_convolutions_agree_with_torch(name):
    text, shapes = SMALL[name]
    inputs = random_inputs(shapes)
    np.testing.assert_allclose(
        evaluate(parse(text, shapes), inputs), torch_reference(name, inputs), rtol=1e-10, atol=1e-10
    )


@pytest.mark.parametrize("name", ["conv3x3", "convtranspose", "conv5x5"])
def test_full_size_public_convolutions_agree_with_torch(name):
    case = CASES[name]
    inputs = random_inputs(case.shapes, dtype=np.float32)
    expected = torch_reference(name, inputs)
    out = evaluate(case.expression(), inputs)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("batch, n, width, dilation, depth", [(2, 9, 2, 1, 3), (1, 12, 2, 3, 4), (2, 5, 3, 2, 2)])
def test_small_g2bmm_agrees_with_loops(batch, n, width, dilation, depth):
    text = G2BMM.format(B=batch, N=n, J=2 * width + 1, D=depth, dil=dilation, off=dilation * width)
    shapes = {"Q": (batch, n, depth), "Kt": (batch, n, depth)}
    inputs = random_inputs(shapes)
    np.testing.assert_allclose(
        evaluate(parse(text, shapes), inputs), g2bmm_loops(inputs["Q"], inputs["Kt"], width, dilation), atol=1e-12
    )


def test_full_size_g2bmm_agrees_with_loops():
    case = CASES["g2bmm"]
    inputs = random_inputs(case.shapes, dtype=np.float32)
    expected = g2bmm_loops(inputs["Q"].astype(np.float64), inputs["Kt"].astype(np.float64), 32, 4)
    np.testing.assert_allclose(evaluate(case.expression(), inputs), expected, rtol=1e-5, atol=1e-5)


def test_matmul_chain_with_nested_scope():
    case = CASES["matmul_chain"]
    inputs = random_inputs(case.shapes)
    np.testing.assert_allclose(evaluate(case.expression(), inputs), inputs["A"] @ inputs["B"] @ inputs["C"], rtol=1e-12)


def test_conv3x3_full_size_is_fast_enough_to_be_a_reference():
    # Not a timing test: it checks the evaluator never builds the 115M-point iteration space,
    # by refusing any intermediate larger than the inputs times the 9 kernel offsets.
    case = CASES["conv3x3"]
    limit = 9 * 7 * 7 * 512 * 4
    expr = case.expression()
    assert reference._footprint(expr, {it.name: it.size for it in expr.iterators}) <= limit


def test_padding_reads_are_zero_and_ranges_with_starts_offset_the_output():
    expr = parse("L i:-2..3 ; A[i] + 10*A[i+1]", {"A": (3,)})
    a = np.array([1.0, 2.0, 3.0])
    # i = -2 .. 2: A[i] is 0 outside 0..2
    np.testing.assert_array_equal(evaluate(expr, {"A": a}), [0, 10, 21, 32, 3])


def test_nested_scope_with_range_start_is_read_in_iterator_coordinates():
    expr = parse("L i:4 ; { L j:1..3 ; A[j] }[i]", {"A": (4,)})
    np.testing.assert_array_equal(evaluate(expr, {"A": np.array([5.0, 6.0, 7.0, 8.0])}), [0, 6, 7, 0])


def test_max_reduction_sum_of_terms_and_division():
    shapes = {"A": (3, 4), "B": (3,)}
    inputs = random_inputs(shapes)
    a, b = inputs["A"], inputs["B"]
    cases = {
        "L i:3 ; M j:4 ; A[i, j]": a.max(axis=1),
        "L i:3 ; S j:4 ; A[i, j] + B[i] - 2": a.sum(axis=1) + 4 * b - 8,
        "L i:3 ; S j:4 ; -(A[i, j] * A[i, j]) / B[i]": -(a * a).sum(axis=1) / b,
        "L i:3 ; S j:4 ; exp(A[i, j]) * B[i]": np.exp(a).sum(axis=1) * b,
        "L i:3 ; S j:4, k:5 ; A[i, j]": 5 * a.sum(axis=1),
        "L i:3, j:4 ; max(relu(A[i, j]), sigmoid(B[i]))": np.maximum(np.maximum(a, 0), (1 / (1 + np.exp(-b)))[:, None]),
        "L ; S i:3, j:4 ; A[i, j]": np.array(a.sum()),
        "L i:3, j:4 ; tanh(A[i%2, (j+i)/2]) * 0.5": 0.5
        * np.tanh(a[np.arange(3)[:, None] % 2, (np.arange(4)[None, :] + np.arange(3)[:, None]) // 2]),
    }
    for text, expected in cases.items():
        np.testing.assert_allclose(evaluate(parse(text, shapes), inputs), expected, rtol=1e-12, err_msg=text)


def test_chunked_evaluation_equals_dense(monkeypatch):
    text, shapes = SMALL["conv5x5"]
    inputs = random_inputs(shapes)
    dense = evaluate(parse(text, shapes), inputs)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 16)
    gathered = parse("L n:2, f:3, h:7, w:6 ; S c:4, r:5, s:5 ; A[n, c, (h+r-2)/1, w+s-2] * K[f, c, r, s]", shapes)
    np.testing.assert_allclose(evaluate(gathered, inputs), dense, rtol=1e-12)


def test_program_evaluates_in_order():
    program = parse_program("B = L i:3, j:3 ; S k:3 ; A[i, k] * A[k, j]\nC = L i:3 ; relu(B[i, i])", {"A": (3, 3)})
    a = random_inputs({"A": (3, 3)})["A"]
    np.testing.assert_allclose(evaluate(program, {"A": a}), np.maximum(np.diag(a @ a), 0))


def test_inputs_are_checked():
    expr = parse("L i:3 ; A[i] * B[i]", {"A": (3,), "B": (3,)})
    with pytest.raises(ExpressionError, match="missing input tensor\\(s\\): B"):
        evaluate(expr, {"A": np.zeros(3)})
    with pytest.raises(ExpressionError, match=r"input B has shape \(4,\), the expression expects \(3,\)"):
        evaluate(expr, {"A": np.zeros(3), "B": np.zeros(4)})


def test_a_constant_table_binds_itself_and_keeps_one_value_per_name():
    """A tensor a rule made with ``constant`` needs no input: evaluation and sampled inputs take
    its recorded values; recording other values under its name is refused."""
    table = constant("test_table_2x2", [[1, 2], [3, 4]])
    expr = parse("L i:2 ; S j:2 ; test_table_2x2[i, j] * X[j]", {"X": (2,), table.name: table.shape})
    np.testing.assert_allclose(evaluate(expr, {"X": np.array([1.0, 10.0])}), [21.0, 43.0])
    np.testing.assert_array_equal(sample_inputs((), {table.name: (2, 2)})[table.name], [[1, 2], [3, 4]])
    assert constant("test_table_2x2", [[1, 2], [3, 4]]) == table  # the same values again: the same tensor
    with pytest.raises(ExpressionError, match="already recorded"):
        constant("test_table_2x2", [[1, 2], [3, 5]])
