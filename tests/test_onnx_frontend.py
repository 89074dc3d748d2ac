"""ONNX front-end and model zoo: every supported operator on a one-node graph and every zoo model
(small) against onnxruntime, BatchNormalization folding, and the errors that name the culprit.

Without onnxruntime the value comparisons skip after the shapes are checked against ONNX shape
inference; without onnx the whole file skips.
"""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from rewriter import evaluate, parse_program, zoo  # noqa: E402
from rewriter.frontends.onnx import SUPPORTED_OPS, OnnxImportError, load_onnx  # noqa: E402
from rewriter.ir import ExpressionError  # noqa: E402


def rnd(*shape, seed=0, low=None):
    """Random float32 values; ``low`` keeps them away from 0 (divisors, variances)."""
    rng = np.random.default_rng(seed + sum(shape))
    values = rng.standard_normal(shape)
    if low is not None:
        values = np.sign(values) * (low + np.abs(values))
    return values.astype(np.float32)


def graph_model(nodes, inputs, outputs=("y",), constants=None, opset=17):
    """A model from nodes; ``inputs`` maps graph input names to shapes, ``constants`` names to arrays."""
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(value), name) for name, value in (constants or {}).items()],
    )
    ir_version = 10 if opset >= 21 else 8  # what onnxruntime asks of the opset
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def one_node(op, operands, opset=17, **attributes):
    """A model of one node named "node" reading ``operands`` in order: a shape tuple is a graph
    input, anything else an initializer."""
    inputs = {name: value for name, value in operands.items() if isinstance(value, tuple)}
    constants = {name: value for name, value in operands.items() if not isinstance(value, tuple)}
    node = helper.make_node(op, list(operands), ["y"], name="node", **attributes)
    return graph_model([node], inputs, constants=constants, opset=opset)


def check(model, rtol=1e-4):
    """The front-end's program evaluated on random inputs: shapes as ONNX shape inference gives
    them, then values as onnxruntime computes them (skipped without onnxruntime)."""
    imported = load_onnx(model)
    feeds = {name: rnd(*shape, seed=1) for name, shape in imported.inputs.items()}
    ours = imported.run(feeds)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output
    for value in inferred:  # (where inference knows the shape: not for GroupNormalization at opset 18)
        if value.type.tensor_type.HasField("shape"):
            assert ours[value.name].shape == tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for value, expected in zip(session.get_outputs(), session.run(None, feeds)):
        got = ours[value.name]
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-5 * scale, err_msg=value.name)
    return imported


def i64(*values):
    return np.array(values, np.int64)


X4 = {"x": (2, 3, 7, 7)}

# (id, op type, operands (a shape: graph input, an array: initializer), attributes[, opset])
OP_CASES = [
    ("conv", "Conv", {**X4, "w": rnd(4, 3, 3, 3), "b": rnd(4)}, dict(pads=[1, 1, 1, 1])),
    ("conv1d", "Conv", {"x": (2, 4, 11), "w": rnd(6, 2, 3)}, dict(group=2, strides=[2], dilations=[2], pads=[2, 1])),
    (
        "conv_stride_dilation",
        "Conv",
        {**X4, "w": rnd(4, 3, 3, 2)},
        dict(strides=[2, 1], dilations=[2, 1], pads=[2, 1, 2, 0]),
    ),
    ("conv_groups", "Conv", {"x": (1, 4, 6, 6), "w": rnd(6, 2, 3, 3)}, dict(group=2)),
    ("conv_asymmetric_pads", "Conv", {**X4, "w": rnd(2, 3, 3, 3)}, dict(pads=[0, 1, 2, 0])),
    ("conv_1xk", "Conv", {**X4, "w": rnd(2, 3, 1, 5)}, dict(pads=[0, 2, 0, 2])),
    ("conv_same_upper", "Conv", {**X4, "w": rnd(2, 3, 4, 4)}, dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ("conv_same_lower", "Conv", {**X4, "w": rnd(2, 3, 4, 4)}, dict(auto_pad="SAME_LOWER")),
    ("conv_valid", "Conv", {**X4, "w": rnd(2, 3, 3, 3)}, dict(auto_pad="VALID", strides=[2, 2])),
    (
        "conv_transpose",
        "ConvTranspose",
        {"x": (2, 3, 3, 3), "w": rnd(3, 4, 4, 4), "b": rnd(4)},
        dict(strides=[2, 2], pads=[1, 1, 1, 1]),
    ),
    (
        "conv_transpose_output_padding",
        "ConvTranspose",
        {"x": (1, 3, 4, 4), "w": rnd(3, 2, 5, 5)},
        dict(strides=[2, 2], pads=[2, 2, 2, 2], output_padding=[1, 1]),
    ),
    (
        "conv_transpose_asymmetric",
        "ConvTranspose",
        {"x": (1, 2, 3, 4), "w": rnd(2, 3, 3, 2)},
        dict(strides=[2, 3], pads=[0, 1, 1, 0]),
    ),
    ("matmul", "MatMul", {"a": (3, 4), "b": (4, 5)}, {}),
    ("matmul_batch", "MatMul", {"a": (2, 3, 4), "b": (2, 4, 5)}, {}),
    ("matmul_broadcast", "MatMul", {"a": (2, 1, 3, 4), "b": rnd(5, 4, 2)}, {}),
    ("matmul_vector_left", "MatMul", {"a": (4,), "b": (2, 4, 3)}, {}),
    ("matmul_vector_right", "MatMul", {"a": (3, 4), "b": (4,)}, {}),
    ("gemm", "Gemm", {"a": (4, 3), "b": rnd(5, 3), "c": rnd(5)}, dict(transB=1)),
    (
        "gemm_alpha_beta",
        "Gemm",
        {"a": (3, 4), "b": (5, 3), "c": rnd(4, 1)},
        dict(transA=1, transB=1, alpha=0.5, beta=2.0),
    ),
    ("gemm_scalar_c", "Gemm", {"a": (3, 4), "b": (4, 2), "c": np.float32(0.25)}, dict(beta=3.0)),
    ("gemm_no_c", "Gemm", {"a": (3, 4), "b": (4, 2)}, {}),
    ("add_broadcast", "Add", {"a": (2, 3, 4), "b": (3, 1)}, {}),
    ("sub", "Sub", {"a": (2, 3), "b": (2, 3)}, {}),
    ("sub_scalar_left", "Sub", {"a": np.float32(1.5), "b": (2, 3)}, {}),
    ("mul_constant", "Mul", {"a": (2, 3, 4), "b": rnd(4)}, {}),
    ("div", "Div", {"a": (2, 3), "b": rnd(2, 3, low=0.5)}, {}),
    ("div_scalar", "Div", {"a": (2, 3), "b": np.array([4.0], np.float32)}, {}),
    ("relu", "Relu", {"x": (2, 5)}, {}),
    ("leaky_relu", "LeakyRelu", {"x": (2, 5)}, dict(alpha=0.1)),
    ("leaky_relu_steep", "LeakyRelu", {"x": (2, 5)}, dict(alpha=2.0)),
    ("sigmoid", "Sigmoid", {"x": (2, 5)}, {}),
    ("tanh", "Tanh", {"x": (2, 5)}, {}),
    (
        "batch_norm",
        "BatchNormalization",
        {"x": (2, 3, 4, 4), "s": rnd(3), "bias": rnd(3), "mean": rnd(3), "var": np.abs(rnd(3, low=0.5))},
        dict(epsilon=1e-3),
    ),
    (
        "batch_norm_2d",
        "BatchNormalization",
        {"x": (4, 5), "s": rnd(5), "bias": rnd(5), "mean": rnd(5), "var": np.abs(rnd(5, low=0.5))},
        {},
    ),
    ("reshape", "Reshape", {"x": (2, 3, 4), "shape": i64(0, -1)}, {}),
    ("reshape_split", "Reshape", {"x": (2, 12), "shape": i64(2, 3, 2, 2)}, {}),
    ("reshape_regroup", "Reshape", {"x": (6, 4), "shape": i64(4, 1, 6)}, {}),
    ("flatten", "Flatten", X4, dict(axis=2)),
    ("flatten_axis0", "Flatten", X4, dict(axis=0)),
    ("flatten_negative", "Flatten", X4, dict(axis=-1)),
    ("transpose", "Transpose", X4, dict(perm=[0, 2, 3, 1])),
    ("transpose_default", "Transpose", {"x": (2, 3, 4)}, {}),
    ("concat", "Concat", {"a": (2, 1, 3), "b": (2, 4, 3), "c": (2, 2, 3)}, dict(axis=1)),
    ("concat_last", "Concat", {"a": (2, 3), "b": rnd(2, 2)}, dict(axis=-1)),
    (
        "slice",
        "Slice",
        {"x": (4, 5, 6), "starts": i64(1, -5), "ends": i64(3, 100), "axes": i64(0, 2), "steps": i64(1, 2)},
        {},
    ),
    (
        "slice_reverse",
        "Slice",
        {"x": (4, 5), "starts": i64(-1), "ends": i64(-100), "axes": i64(1), "steps": i64(-2)},
        {},
    ),
    ("pad", "Pad", {**X4, "pads": i64(0, 0, 1, 2, 0, 0, 2, 1)}, {}),
    ("pad_value_crop", "Pad", {"x": (3, 4), "pads": i64(1, -1, 2, 1), "value": np.float32(1.5)}, {}),
    ("pad_axes", "Pad", {**X4, "pads": i64(2, 1, 0, 3), "value": np.float32(-0.5), "axes": i64(-1, 1)}, {}, 18),
    ("softmax", "Softmax", {"x": (2, 3, 4)}, dict(axis=1)),
    ("softmax_default", "Softmax", {"x": (2, 3, 4)}, {}),
    ("softmax_opset11", "Softmax", {"x": (2, 3, 4)}, dict(axis=2), 11),
    ("reduce_mean", "ReduceMean", {"x": (2, 3, 4)}, dict(axes=[0, 2], keepdims=0)),
    ("reduce_mean_opset18", "ReduceMean", {"x": (2, 3, 4), "axes": i64(-1)}, {}, 18),
    ("reduce_sum", "ReduceSum", {"x": (2, 3, 4), "axes": i64(1)}, dict(keepdims=1)),
    ("reduce_sum_all", "ReduceSum", {"x": (2, 3, 4)}, dict(keepdims=0)),
    ("reduce_sum_noop", "ReduceSum", {"x": (2, 3)}, dict(noop_with_empty_axes=1)),
    ("einsum", "Einsum", {"a": (2, 3, 4), "b": (2, 4, 5)}, dict(equation="bij, bjk -> bki")),
    ("reduce_l2", "ReduceL2", {"x": (2, 3, 4)}, dict(axes=[1, 2], keepdims=1)),
    ("reduce_l1_opset18", "ReduceL1", {"x": (2, 3, 4), "axes": i64(0)}, dict(keepdims=0), 18),
    ("global_average_pool", "GlobalAveragePool", X4, {}),
    ("average_pool", "AveragePool", X4, dict(kernel_shape=[2, 2], strides=[2, 2])),
    ("average_pool_exclude_pad", "AveragePool", X4, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("average_pool_include_pad", "AveragePool", X4, dict(kernel_shape=[3, 2], pads=[1, 0, 1, 1], count_include_pad=1)),
    ("max_pool", "MaxPool", X4, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("max_pool_dilated", "MaxPool", X4, dict(kernel_shape=[2, 2], dilations=[2, 2])),
    ("max_pool_ceil", "MaxPool", X4, dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ("average_pool_ceil", "AveragePool", X4, dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    (
        "average_pool_ceil_include_pad",
        "AveragePool",
        {"x": (1, 2, 8, 8)},
        dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
    ),
    ("max_pool_same", "MaxPool", X4, dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ("identity", "Identity", {"x": (2, 3)}, {}),
    ("pow_square", "Pow", {"a": (2, 3), "b": np.float32(2.0)}, {}),
    ("pow_tensor", "Pow", {"a": np.abs(rnd(2, 3, low=0.5)), "b": (2, 3)}, {}),
    ("min", "Min", {"a": (2, 3), "b": (3,), "c": rnd(2, 3)}, {}),
    ("max", "Max", {"a": (2, 3), "b": (2, 3)}, {}),
    ("max_one_input", "Max", {"a": (2, 3)}, {}),
    ("exp", "Exp", {"x": (2, 5)}, {}),
    ("erf", "Erf", {"x": (2, 5)}, {}),
    ("sin", "Sin", {"x": (2, 5)}, {}),
    ("cos", "Cos", {"x": (2, 5)}, {}),
    ("abs", "Abs", {"x": (2, 5)}, {}),
    ("floor", "Floor", {"x": (2, 5)}, {}),
    ("ceil", "Ceil", {"x": (2, 5)}, {}),
    ("neg", "Neg", {"x": (2, 5)}, {}),
    ("reciprocal", "Reciprocal", {"x": (2, 5)}, {}),
    ("clip", "Clip", {"x": (2, 5), "lo": np.float32(-0.5), "hi": np.float32(0.5)}, {}),
    ("clip_min_only", "Clip", {"x": (2, 5), "lo": np.float32(0.0)}, {}),
    ("clip_attributes", "Clip", {"x": (2, 5)}, dict(min=-0.3, max=0.2), 6),
    ("hard_sigmoid", "HardSigmoid", {"x": (2, 5)}, dict(alpha=0.3, beta=0.4)),
    ("hard_swish", "HardSwish", {"x": (2, 5)}, {}),
    ("gelu", "Gelu", {"x": (2, 5)}, {}, 20),
    ("gelu_tanh", "Gelu", {"x": (2, 5)}, dict(approximate="tanh"), 20),
    ("dropout", "Dropout", {"x": (2, 5)}, {}),
    ("cast_float", "Cast", {"x": (2, 3)}, dict(to=TensorProto.FLOAT)),
    ("layer_norm", "LayerNormalization", {"x": (2, 3, 4), "s": rnd(4), "b": rnd(4)}, dict(epsilon=1e-3)),
    ("layer_norm_axis1", "LayerNormalization", {"x": (2, 3, 4), "s": rnd(3, 4)}, dict(axis=1)),
    ("instance_norm", "InstanceNormalization", {**X4, "s": rnd(3), "b": rnd(3)}, dict(epsilon=1e-3)),
    ("resize_nearest", "Resize", {**X4, "roi": np.zeros(0, np.float32), "s": np.float32([1, 1, 2, 1.5])}, {}),
    (
        "resize_nearest_sizes",
        "Resize",
        {**X4, "roi": np.zeros(0, np.float32), "s": np.zeros(0, np.float32), "n": i64(2, 3, 5, 16)},
        dict(coordinate_transformation_mode="align_corners", nearest_mode="round_prefer_ceil"),
    ),
    (
        "resize_linear",
        "Resize",
        {**X4, "roi": np.zeros(0, np.float32), "s": np.float32([1, 1, 2, 2])},
        dict(mode="linear"),
    ),
    (
        "resize_linear_sizes",
        "Resize",
        {**X4, "roi": np.zeros(0, np.float32), "s": np.zeros(0, np.float32), "n": i64(2, 3, 3, 12)},
        dict(mode="linear", coordinate_transformation_mode="asymmetric"),
    ),
    # opset 18: scale and bias per group; 21: per channel
    ("group_norm_18", "GroupNormalization", {**X4, "s": rnd(3), "b": rnd(3)}, dict(num_groups=3, epsilon=1e-3), 18),
    ("group_norm_21", "GroupNormalization", {"x": (2, 6, 5), "s": rnd(6), "b": rnd(6)}, dict(num_groups=2), 21),
    ("log_softmax", "LogSoftmax", {"x": (2, 3, 4)}, dict(axis=1)),
    ("reduce_max", "ReduceMax", {"x": (2, 3, 4)}, dict(axes=[1], keepdims=0)),
    ("reduce_max_opset18", "ReduceMax", {"x": (2, 3, 4), "axes": i64(-1)}, {}, 18),
    ("squeeze", "Squeeze", {"x": (2, 1, 3, 1), "axes": i64(1, -1)}, {}),
    ("squeeze_all", "Squeeze", {"x": (2, 1, 3, 1)}, {}),
    ("cumsum", "CumSum", {"x": (2, 5, 3), "axis": i64(1)}, {}),
    ("cumsum_exclusive_reverse", "CumSum", {"x": (2, 5), "axis": np.int64(-1)}, dict(exclusive=1, reverse=1)),
    ("gather_elements", "GatherElements", {"x": (3, 4), "i": np.array([[0, 2], [1, -1], [2, 2]])}, dict(axis=0)),
    ("gather_one", "Gather", {"x": (2, 5, 3), "i": np.int64(-2)}, dict(axis=1)),  # a view, the axis dropped
    ("gather_stepping", "Gather", {"x": (7, 3), "i": i64(5, 3, 1)}, {}),  # a view: 5 - 2*i
    ("gather_irregular", "Gather", {"x": (7, 3), "i": np.array([[0, 6], [2, 2]])}, {}),  # opaque, constant indices
    ("unsqueeze", "Unsqueeze", {"x": (2, 3), "axes": i64(0, -1)}, {}),
    ("expand", "Expand", {"x": (3, 1), "shape": i64(2, 3, 4)}, {}),
    ("expand_keep", "Expand", {"x": (2, 3, 4), "shape": i64(3, 1)}, {}),
]

# Operators whose output is not float (masks, integers) or whose input needs a domain: a short
# graph ending in a float, each compared with onnxruntime like the one-node cases.
_COMPARISONS = ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")


def _graph_cases():
    cases = {}
    for op in _COMPARISONS:  # y = where(floor(a) op floor(b), a, b): equal floors are common
        nodes = [
            helper.make_node("Floor", ["a"], ["fa"]),
            helper.make_node("Floor", ["b"], ["fb"]),
            helper.make_node(op, ["fa", "fb"], ["c"]),
            helper.make_node("Where", ["c", "a", "b"], ["y"]),
        ]
        cases[op] = graph_model(nodes, {"a": (2, 3, 4), "b": (3, 4)})
    positive = [helper.make_node("Abs", ["x"], ["ax"]), helper.make_node("Add", ["ax", "one"], ["p"])]
    for op in ("Log", "Sqrt"):
        nodes = positive + [helper.make_node(op, ["p"], ["y"])]
        cases[op] = graph_model(nodes, {"x": (2, 5)}, constants={"one": np.float32(1.0)})
    casts = [  # through an integer type (truncation) and bool (non-zero) back to float
        helper.make_node("Mul", ["x", "three"], ["x3"]),
        helper.make_node("Cast", ["x3"], ["i"], to=TensorProto.INT32),
        helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["f"], ["bool"], to=TensorProto.BOOL),
        helper.make_node("Where", ["bool", "f", "x"], ["y"]),
    ]
    cases["Cast"] = graph_model(casts, {"x": (2, 5)}, constants={"three": np.float32(3.0)})
    nots = [helper.make_node("Greater", ["x", "half"], ["g"]), helper.make_node("Not", ["g"], ["n"])]
    nots.append(helper.make_node("Where", ["n", "x", "half"], ["y"]))
    cases["Not"] = graph_model(nots, {"x": (2, 5)}, constants={"half": np.float32(0.5)})
    arg_max = [  # on floors, so that ties are common: the first and the last of the largest
        helper.make_node("Floor", ["x"], ["f"]),
        helper.make_node("ArgMax", ["f"], ["first"], axis=1, keepdims=0),
        helper.make_node("ArgMax", ["f"], ["last"], axis=-1, select_last_index=1),
        helper.make_node("Cast", ["first"], ["y0"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["last"], ["y1"], to=TensorProto.FLOAT),
    ]
    cases["ArgMax"] = graph_model(arg_max, {"x": (3, 6, 5)}, ("y0", "y1"))
    for op in ("And", "Or", "Xor"):  # y = where(floor(a) > 0 op floor(b) < 0, a, b)
        nodes = [
            helper.make_node("Floor", ["a"], ["fa"]),
            helper.make_node("Floor", ["b"], ["fb"]),
            helper.make_node("Greater", ["fa", "zero"], ["pa"]),
            helper.make_node("Less", ["fb", "zero"], ["nb"]),
            helper.make_node(op, ["pa", "nb"], ["c"]),
            helper.make_node("Where", ["c", "a", "b"], ["y"]),
        ]
        cases[op] = graph_model(nodes, {"a": (2, 3, 4), "b": (3, 4)}, constants={"zero": np.float32(0.0)})
    mask = np.array([[True, False, True, True], [False] * 4, [True] * 4])  # row 1 masked everywhere
    is_nan = [  # attention's export with a boolean mask: -inf where masked, NaN rows of a softmax zeroed
        helper.make_node("Where", ["mask", "zero", "minus_inf"], ["bias"]),
        helper.make_node("Add", ["x", "bias"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["y0"]),
        helper.make_node("Sqrt", ["x"], ["root"]),  # NaN where x < 0
        helper.make_node("IsNaN", ["root"], ["negative"]),
        helper.make_node("Where", ["negative", "x", "root"], ["y1"]),
    ]
    constants = {"mask": mask, "zero": np.float32(0.0), "minus_inf": np.float32(-np.inf)}
    cases["IsNaN"] = graph_model(is_nan, {"x": (2, 3, 4)}, ("y0", "y1"), constants=constants)
    split = helper.make_node("Split", ["x", "sizes"], ["y0", "y1", "y2"], axis=1)
    cases["Split"] = graph_model([split], {"x": (2, 7, 3)}, ("y0", "y1", "y2"), constants={"sizes": i64(2, 4, 1)})
    return cases


def test_split_into_equal_parts_names_every_output():
    split = helper.make_node("Split", ["x"], ["a", "b", "c"], axis=-1, num_outputs=3)
    check(graph_model([split], {"x": (2, 8)}, ("a", "b", "c"), opset=18))  # 3 + 3 + 2


GRAPH_CASES = _graph_cases()


def test_op_cases_cover_every_supported_op():
    assert {case[1] for case in OP_CASES} | set(GRAPH_CASES) | {"Constant", "Where"} == set(SUPPORTED_OPS)


@pytest.mark.parametrize("op", sorted(GRAPH_CASES))
def test_mask_and_domain_ops_match_onnxruntime(op):
    check(GRAPH_CASES[op])


@pytest.mark.parametrize("case", OP_CASES, ids=[case[0] for case in OP_CASES])
def test_op_matches_onnxruntime(case):
    _, op, operands, attributes, *opset = case
    check(one_node(op, operands, *opset, **attributes))


@pytest.mark.parametrize(
    "attribute, value",
    [("value", numpy_helper.from_array(rnd(2, 3), "c")), ("value_float", 2.5), ("value_floats", [1.0, -2.0, 3.0])],
)
def test_constant_nodes_are_weights(attribute, value):
    nodes = [helper.make_node("Constant", [], ["c"], **{attribute: value}), helper.make_node("Mul", ["x", "c"], ["y"])]
    imported = check(graph_model(nodes, {"x": (2, 3)}))
    assert [name for name, _ in imported.program.definitions] == ["y"]


# --------------------------------------------------------------------------------------------
# The model zoo


@pytest.mark.parametrize("name", zoo.NAMES)
def test_zoo_model_matches_onnxruntime(name):
    model = zoo.build(name, small=True)
    imported = load_onnx(model)
    assert len(imported.program.definitions) <= len(model.graph.node)
    assert parse_program(str(imported.program), imported.program.inputs) == imported.program
    check(model, rtol=1e-3)


def test_zoo_program_evaluates_with_inputs_and_weights():
    imported = load_onnx(zoo.build("srcnn", small=True))
    x = rnd(*imported.inputs["input"])
    out = evaluate(imported.program, {"input": x, **imported.weights})
    np.testing.assert_array_equal(out, imported.run({"input": x})["output"])


def test_zoo_save_writes_a_loadable_file(tmp_path):
    path = tmp_path / "gcn.onnx"
    zoo.save("gcn", path, small=True)
    assert load_onnx(path).inputs == {"input": (1, 16, 8, 8)}


def test_zoo_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown zoo model 'vgg'.*resnet18"):
        zoo.build("vgg")


FULL_SHAPES = {
    "infogan": ((16, 228), (16, 3, 32, 32)),
    "dcgan": ((16, 100), (16, 3, 64, 64)),
    "srcnn": ((16, 1, 224, 224), (16, 1, 224, 224)),
    "gcn": ((1, 2048, 16, 16), (1, 21, 16, 16)),
    "resnet18": ((1, 3, 224, 224), (1, 1000)),
    "csrnet": ((1, 3, 224, 224), (1, 1, 28, 28)),
    "longformer": ((1, 10000, 512), (1, 10000, 512)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.NAMES)
def test_full_size_zoo_models_import_with_the_documented_shapes(name):
    imported = load_onnx(zoo.build(name))
    assert (imported.inputs["input"], dict(imported.program.definitions)["output"].shape) == FULL_SHAPES[name]
    assert f"{FULL_SHAPES[name][0]}" in zoo.describe(name) and f"{FULL_SHAPES[name][1]}" in zoo.describe(name)


# --------------------------------------------------------------------------------------------
# BatchNormalization folding


def conv_bn_model(op="Conv", bias=True, conv_is_output=False):
    weight = rnd(3, 4, 3, 3) if op == "ConvTranspose" else rnd(4, 3, 3, 3)
    constants = {"w": weight, "s": rnd(4), "beta": rnd(4), "mean": rnd(4), "var": np.abs(rnd(4, low=0.5))}
    if bias:
        constants["b"] = rnd(4)
    conv = helper.make_node(op, ["x", "w", "b"] if bias else ["x", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1])
    bn = helper.make_node("BatchNormalization", ["conv", "s", "beta", "mean", "var"], ["y"], name="bn", epsilon=1e-3)
    outputs = ("y", "conv") if conv_is_output else ("y",)
    return graph_model([conv, bn], {"x": (2, 3, 5, 5)}, outputs, constants), constants


@pytest.mark.parametrize("op, bias", [("Conv", True), ("Conv", False), ("ConvTranspose", True)])
def test_batch_norm_folds_into_the_convolution(op, bias):
    model, c = conv_bn_model(op, bias)
    imported = check(model)
    ((name, _),) = imported.program.definitions  # one definition: the BN is gone
    assert name == "y" and "w" not in imported.weights and "mean" not in imported.weights
    scale = c["s"] / np.sqrt(c["var"] + 1e-3)
    axis = (1, -1, 1, 1) if op == "ConvTranspose" else (-1, 1, 1, 1)
    np.testing.assert_allclose(imported.weights["y_folded_weight"], c["w"] * scale.reshape(axis), rtol=1e-6)
    np.testing.assert_allclose(
        imported.weights["y_folded_bias"], (c.get("b", 0) - c["mean"]) * scale + c["beta"], rtol=1e-5, atol=1e-6
    )


def test_batch_norm_is_not_folded_when_the_convolution_is_read_elsewhere():
    model, _ = conv_bn_model(conv_is_output=True)
    imported = check(model)
    assert [name for name, _ in imported.program.definitions] == ["conv", "y"]
    assert imported.outputs == ("y", "conv")


# --------------------------------------------------------------------------------------------
# Errors


def test_unsupported_ops_are_listed_together_before_anything_else():
    nodes = [
        helper.make_node("ScatterElements", ["x", "idx", "x"], ["g"], name="scatter_1"),
        helper.make_node("Relu", ["g"], ["r"], name="relu_1"),
        helper.make_node("NonZero", ["r"], ["e"]),
        helper.make_node("Fancy", ["e"], ["y"], name="custom", domain="com.example"),
    ]
    model = graph_model(nodes, {"x": ("N", 4)}, constants={"idx": i64(0, 2)})  # also a dynamic input
    with pytest.raises(OnnxImportError) as info:
        load_onnx(model)
    message = str(info.value)
    assert "3 node(s) with unsupported operators (NonZero, ScatterElements, com.example.Fancy)" in message
    for part in ("ScatterElements node 'scatter_1'", "NonZero node #2 (output 'e')", "com.example.Fancy node 'custom'"):
        assert part in message
    assert "relu_1" not in message and "dynamic" not in message
    assert isinstance(info.value, ValueError)


W = rnd(3, 2, 2, 2)
UNSUPPORTED_VALUES = [
    (
        one_node("Pad", {**X4, "pads": i64(0, 0, 1, 1, 0, 0, 1, 1)}, mode="reflect"),
        "Pad node 'node': attribute mode='reflect' is not supported",
    ),
    (
        one_node("ConvTranspose", {**X4, "w": W}, output_shape=[8, 8]),
        "ConvTranspose node 'node': attribute 'output_shape' is not supported",
    ),
    (
        one_node("ConvTranspose", {**X4, "w": W}, auto_pad="SAME_UPPER"),
        "ConvTranspose node 'node': attribute auto_pad='SAME_UPPER' is not supported",
    ),
    (
        one_node("ConvTranspose", {**X4, "w": W}, dilations=[2, 2]),
        "ConvTranspose node 'node': attribute dilations=(2, 2) is not supported",
    ),
    (one_node("Softmax", {"x": (2, 3, 4)}, 11, axis=1), "Softmax node 'node': before opset 13"),
    (
        one_node("Slice", {"x": (4, 5), "starts": (1,), "ends": i64(3)}),
        "Slice node 'node': input 1 (starts, 'starts') must be a constant",
    ),
    (
        one_node("Conv", {"x": (2, 3, 4, 5, 6), "w": rnd(2, 3, 1, 1, 1)}),
        "Conv node 'node': only 1-D (rank-3) and 2-D (rank-4) inputs are supported",
    ),
]


@pytest.mark.parametrize(
    "model, expected", UNSUPPORTED_VALUES, ids=[e.split(": ")[1][:40] for _, e in UNSUPPORTED_VALUES]
)
def test_unsupported_attribute_values_name_the_node_and_attribute(model, expected):
    with pytest.raises(OnnxImportError) as info:
        load_onnx(model)
    assert expected in str(info.value)


def test_second_outputs_are_refused():
    node = helper.make_node("MaxPool", ["x"], ["y", "indices"], name="pool", kernel_shape=[2, 2])
    model = graph_model([node], X4, outputs=("y", "indices"))
    with pytest.raises(OnnxImportError, match=r"MaxPool node 'pool': output #1 \('indices'\) is not supported"):
        load_onnx(model)


def test_corrupt_and_missing_files_are_named(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07this is not a protobuf \xff\xfe")
    with pytest.raises(OnnxImportError, match="broken.onnx"):
        load_onnx(path)
    with pytest.raises(OnnxImportError, match="cannot read ONNX model .*missing.onnx"):
        load_onnx(tmp_path / "missing.onnx")


def test_dynamic_dimensions_name_the_tensor_unless_fixed():
    model = one_node("Relu", {"tokens": ("batch", 4)})
    with pytest.raises(
        OnnxImportError, match=r"graph input 'tokens' has dynamic dimension\(s\) at axis \[0\] \(shape \(batch, 4\)\)"
    ):
        load_onnx(model)
    imported = load_onnx(model, input_shapes={"tokens": (3, 4)})
    assert imported.inputs == {"tokens": (3, 4)} and imported.program.definitions[0][1].shape == (3, 4)
    with pytest.raises(OnnxImportError, match="the model says"):
        load_onnx(model, input_shapes={"tokens": (3, 5)})


def test_names_that_are_not_identifiers_are_sanitised():
    nodes = [
        helper.make_node("Relu", ["input.1"], ["/layer1/relu_output_0"]),
        helper.make_node("Tanh", ["/layer1/relu_output_0"], ["exp"]),
    ]
    imported = check(graph_model(nodes, {"input.1": (2, 3)}, outputs=("exp",)))
    assert imported.names == {"input.1": "input_1", "/layer1/relu_output_0": "layer1_relu_output_0", "exp": "exp_"}
    assert imported.program.outputs == ("exp_",)


def test_gather_by_token_ids_known_at_run_time_is_an_opaque_definition():
    """An embedding lookup: int64 ids (a graph input) gather rows of a weight; the rest of the
    graph stays scopes, and the program matches onnxruntime."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"]), helper.make_node("Relu", ["rows"], ["y"])],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, (2, 3))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rnd(10, 4), "table")],
    )
    model = load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    kinds = [type(expr).__name__ for _, expr in model.program.definitions]
    assert kinds == ["Opaque", "Scope"]
    ids = np.array([[0, 9, -1], [3, 3, 5]])
    np.testing.assert_allclose(model.run({"ids": ids})["y"], model.original({"ids": ids})["y"], rtol=1e-6)
    with pytest.raises(ExpressionError, match="index 16 in ids is out of range for axis 0 of table"):
        model.run({"ids": ids + 7})
