"""ONNX front-end: an ONNX model as a ``Program`` of the expression IR (DESIGN.md, "Programs and
models").

    from rewriter.frontends.onnx import load_onnx
    model = load_onnx("resnet18.onnx")
    outputs = model.run({"input": x})              # ONNX output name -> array
    evaluate(model.program, model.feeds({"input": x}))   # the same through the reference semantics

Every ONNX node becomes one definition of the program, named after its (sanitised) output name;
the graph inputs and the weights are the program's input tensors. Weights are initializers and
Constant nodes, with each BatchNormalization folded into the Conv/ConvTranspose before it (its
only reader) at build time; a BatchNormalization anywhere else is a per-channel affine scope.

Shapes are static: a graph input with a symbolic dimension is refused (naming the tensor) unless
``input_shapes`` fixes it. The front-end computes every shape itself from the builders and checks
it against ONNX shape inference wherever that knows the shape.

What is not supported fails loudly, never silently wrong: all unsupported operators of a model are
listed in one ``OnnxImportError`` (with node names) before anything else is done, then all unknown
attributes; an attribute value the front-end does not handle (``Pad`` mode ``reflect``, a
training-mode ``Dropout``, ...) is an error naming the node and the attribute.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from rewriter.index import affine_index
from rewriter.ir import (
    ExpressionError,
    Index,
    Iterator,
    Lit,
    Num,
    Opaque,
    Program,
    Scope,
    Tensor,
    Unary,
    Var,
)
from rewriter.ir.builders import (
    FLOAT32_MAX,
    absolute,
    add,
    batch_matmul,
    binary,
    ceil,
    clip,
    compare,
    conv1d,
    conv2d,
    conv_transpose2d,
    cos,
    cumsum,
    einsum,
    erf,
    exp,
    floor,
    gelu,
    group_norm,
    layer_norm,
    log,
    log_softmax,
    matmul,
    mul,
    reduce_max,
    reduce_mean,
    reduce_norm,
    reduce_sum,
    relu,
    sigmoid,
    sin,
    softmax,
    sqrt,
    tanh,
    where,
)

from .common import (
    FrontendError,
    Model,
    Names,
    arg_max,
    batch_norm_affine,
    broadcast_to,
    cast,
    elementwise,
    fold_batch_norm,
    fresh,
    gather,
    gather_elements,
    is_nan,
    iterators,
    logical,
    resize,
    resize_weights,
    with_extent,
)

__all__ = ["Model", "OnnxImportError", "load_onnx", "SUPPORTED_OPS"]


class OnnxImportError(FrontendError):
    """An ONNX model the front-end cannot translate; the message names the file, node or tensor."""


def load_onnx(source, input_shapes: Mapping[str, Sequence[int]] | None = None) -> Model:
    """Translate an ONNX model (a path or a ``ModelProto``) to a ``Model``.

    ``input_shapes`` fixes the symbolic dimensions of graph inputs (ONNX name -> shape).
    """
    onnx = _import_onnx()
    given, where = _read(onnx, source)
    model = _shapes_folded(onnx, given, input_shapes or {})
    _check_ops(model.graph, where + (" (shape arithmetic folded by onnxruntime)" if model is not given else ""))
    _check_node_attributes(model.graph, where)
    constants = _constants(onnx, model.graph)
    shapes = _input_shapes(onnx, model.graph, constants, input_shapes or {})
    inferred = _inferred_shapes(onnx, model, shapes, where)
    nodes = _fold_batch_norms(onnx, model.graph, constants)
    imported = _Build(onnx, _opset(model), constants, shapes, inferred).run(nodes, model.graph)
    integers = {
        v.name for v in model.graph.input if v.name in shapes and v.type.tensor_type.elem_type not in _FLOAT_TYPES
    }
    return replace(imported, proto=given, integers=frozenset(integers))


def _shapes_folded(onnx, model, input_shapes: Mapping[str, Sequence[int]]):
    """The model with what is computable at build time folded to constants, where it has
    operators the front-end does not support: exporters compute shapes and masks at run time
    (Shape -> Gather -> Concat -> Reshape, ConstantOfShape -> Expand, padding amounts), which
    are constants once the input shapes are. onnxruntime's basic graph optimizations (constant
    folding, static Shape nodes, redundant node elimination) do this; the model is returned
    unchanged without onnxruntime or where it cannot load the model (a custom operator)."""
    if all(_op_key(node) in SUPPORTED_OPS for node in model.graph.node):
        return model
    try:
        import onnxruntime
    except ImportError:
        return model
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in fixed.graph.input:
        if value.name in input_shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, input_shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(size)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as directory:
        options.optimized_model_filepath = os.path.join(directory, "folded.onnx")
        try:
            onnxruntime.InferenceSession(fixed.SerializeToString(), options, providers=["CPUExecutionProvider"])
            folded = onnx.load(options.optimized_model_filepath)
        except Exception:  # noqa: BLE001  onnxruntime refuses it (a custom operator): the listing names what is not supported
            return model
    folded.graph.name = model.graph.name
    return folded


def _import_onnx():
    try:
        import onnx
    except ImportError:
        raise OnnxImportError("the ONNX front-end needs the onnx package: pip install 'rewriter[onnx]'") from None
    return onnx


def _read(onnx, source):
    """The model and how messages name it; an unreadable or corrupt file is an error naming it."""
    if isinstance(source, onnx.ModelProto):
        return source, f"ONNX model {source.graph.name or '(unnamed graph)'!r}"
    if not isinstance(source, (str, os.PathLike)):
        raise OnnxImportError(f"load_onnx() takes a path or an onnx.ModelProto, got {type(source).__name__}")
    path = os.fspath(source)
    try:
        model = onnx.load(path)
    except Exception as err:  # OSError, protobuf's DecodeError, onnx's own errors
        raise OnnxImportError(f"cannot read ONNX model {path}: {type(err).__name__}: {err}") from None
    if not model.graph.node and not model.graph.output:
        raise OnnxImportError(f"cannot read ONNX model {path}: it holds no graph")
    return model, path


def _opset(model) -> int:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    return versions[0] if versions else 1


def _op_key(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _label(node, position: int) -> str:
    """How messages name a node: its name, else its position and first output."""
    if node.name:
        return f"{_op_key(node)} node {node.name!r}"
    first = node.output[0] if node.output else ""
    return f"{_op_key(node)} node #{position} (output {first!r})"


def _check_ops(graph, where: str) -> None:
    """One error listing every unsupported operator with its node, before any other work."""
    unsupported = [
        (_op_key(node), _label(node, k)) for k, node in enumerate(graph.node) if _op_key(node) not in SUPPORTED_OPS
    ]
    if unsupported:
        kinds = sorted({op for op, _ in unsupported})
        raise OnnxImportError(
            f"{where}: {len(unsupported)} node(s) with unsupported operators ({', '.join(kinds)}): "
            + "; ".join(label for _, label in unsupported)
            + f". Supported: {', '.join(sorted(SUPPORTED_OPS))}"
        )


def _check_node_attributes(graph, where: str) -> None:
    """One error listing every attribute no handler reads (legacy or unknown semantics), every
    node output beyond the first that is used (MaxPool indices, training-mode statistics), and
    every Constant node without exactly one value."""
    problems = []
    for k, node in enumerate(graph.node):
        known = SUPPORTED_OPS[_op_key(node)].attributes
        problems += [
            f"{_label(node, k)}: attribute {a.name!r} is not supported" for a in node.attribute if a.name not in known
        ]
        problems += [
            f"{_label(node, k)}: output #{i} ({name!r}) is not supported"
            for i, name in enumerate(node.output)
            if i and name and not SUPPORTED_OPS[_op_key(node)].outputs
        ]
        if node.op_type == "Constant" and len(node.attribute) != 1:
            problems.append(f"{_label(node, k)}: a Constant needs exactly one value attribute")
    if problems:
        raise OnnxImportError(f"{where}: " + "; ".join(problems))


def _constants(onnx, graph) -> dict[str, np.ndarray]:
    """Initializers and Constant node values by ONNX name."""
    constants = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            attribute = node.attribute[0]
            value = onnx.helper.get_attribute_value(attribute)
            if attribute.name == "value":
                constants[node.output[0]] = onnx.numpy_helper.to_array(value)
            else:
                constants[node.output[0]] = np.asarray(
                    value, np.float32 if attribute.name.startswith("value_float") else np.int64
                )
    return constants


_FLOAT_TYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16
_INTEGER_TYPES = frozenset({2, 3, 4, 5, 6, 7, 12, 13})  # UINT8, INT8, UINT16, INT16, INT32, INT64, UINT32, UINT64


def _input_shapes(onnx, graph, constants, overrides) -> dict[str, tuple[int, ...]]:
    """Static shapes of the graph inputs that are not initializers; symbolic dimensions are
    refused, naming the tensor, unless ``overrides`` fixes them. Integer and boolean inputs
    (token ids, masks) are float data in the program: exact up to 2**24."""
    unknown = sorted(set(overrides) - {value.name for value in graph.input})
    if unknown:
        raise OnnxImportError(f"input_shapes names {', '.join(map(repr, unknown))}, not graph inputs")
    shapes = {}
    for value in graph.input:
        if value.name in constants:
            continue
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type not in _FLOAT_TYPES | _INTEGER_TYPES | {9}:  # 9: BOOL
            kind = onnx.TensorProto.DataType.Name(tensor_type.elem_type) if tensor_type.elem_type else "not a tensor"
            raise OnnxImportError(f"graph input {value.name!r} is not a numeric tensor ({kind})")
        given = overrides.get(value.name)
        if not tensor_type.HasField("shape"):
            if given is None:
                raise OnnxImportError(
                    f"graph input {value.name!r} has no shape; pass input_shapes={{{value.name!r}: (...)}}"
                )
            dims = [None] * len(given)
        else:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if given is not None:
            given = tuple(int(d) for d in given)
            if len(given) != len(dims) or any(d is not None and d != g for d, g in zip(dims, given)):
                raise OnnxImportError(
                    f"input_shapes gives {value.name!r} the shape {given}, the model says {_describe(tensor_type)}"
                )
            dims = list(given)
        dynamic = [axis for axis, d in enumerate(dims) if d is None or d <= 0]
        if dynamic:
            raise OnnxImportError(
                f"graph input {value.name!r} has dynamic dimension(s) at axis {dynamic} (shape {_describe(tensor_type)}); "
                f"pass input_shapes={{{value.name!r}: (...)}}"
            )
        shapes[value.name] = tuple(dims)
    return shapes


def _describe(tensor_type) -> str:
    return (
        "("
        + ", ".join(
            str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim
        )
        + ")"
    )


def _inferred_shapes(onnx, model, inputs, where: str) -> dict[str, tuple[int, ...]]:
    """Static shapes ONNX shape inference finds (inputs fixed as given): a cross-check only."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in fixed.graph.input:
        if value.name in inputs:
            shape = value.type.tensor_type.shape
            shape.ClearField("dim")
            for size in inputs[value.name]:
                shape.dim.add().dim_value = size
    try:
        inferred = onnx.shape_inference.infer_shapes(fixed)
    except Exception as err:  # onnx's inference errors have no common base class across versions
        raise OnnxImportError(f"{where}: ONNX shape inference fails: {err}") from None
    shapes = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    return shapes


# --------------------------------------------------------------------------------------------
# BatchNormalization folding


def _fold_batch_norms(onnx, graph, constants) -> list[tuple[int, object]]:
    """(position in the graph, node) pairs, with each Conv/ConvTranspose -> BatchNormalization pair made one convolution.

    Inference-mode BN is ``x*scale + shift`` per channel, so it folds into the convolution's weight
    (scaled along the output-channel axis) and bias. Only when the convolution's result is read by
    the BN alone (not a graph output) and every parameter is a constant; new constants are added
    to ``constants`` under fresh names. The folded node keeps the convolution's name and takes
    the BN's output name, which is what later nodes read.
    """
    readers: dict[str, int] = {}
    for name in [i for node in graph.node for i in node.input] + [o.name for o in graph.output]:
        readers[name] = readers.get(name, 0) + 1
    taken = set(constants) | set(readers) | {out for node in graph.node for out in node.output}
    producer: dict[str, int] = {}
    nodes = list(graph.node)
    for k, node in enumerate(graph.node):
        source = producer.get(node.input[0]) if node.op_type == "BatchNormalization" and node.input else None
        if source is not None and _foldable(nodes[source], node, constants, readers):
            nodes[source] = _folded(onnx, nodes[source], node, constants, taken)
            nodes[k] = None
        for out in node.output:
            producer[out] = k
    return [(k, node) for k, node in enumerate(nodes) if node is not None]


def _foldable(conv, bn, constants, readers) -> bool:
    if conv.op_type not in ("Conv", "ConvTranspose") or readers.get(conv.output[0]) != 1 or not _batch_norm_mode_ok(bn):
        return False
    if (
        len(conv.input) < 2
        or len(bn.input) != 5
        or not all(name in constants for name in [*conv.input[1:], *bn.input[1:]] if name)
    ):
        return False
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    weight = constants[conv.input[1]]
    channels = weight.shape[1] * group if conv.op_type == "ConvTranspose" else weight.shape[0]
    return (conv.op_type == "Conv" or group == 1) and all(constants[name].shape == (channels,) for name in bn.input[1:])


def _batch_norm_mode_ok(bn) -> bool:
    attrs = {a.name: a for a in bn.attribute}
    return ("training_mode" not in attrs or attrs["training_mode"].i == 0) and (
        "spatial" not in attrs or attrs["spatial"].i == 1
    )


def _batch_norm_affine(bn, constants) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) per channel of a BatchNormalization node whose parameters are constants."""
    epsilon = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
    return batch_norm_affine(*(constants[name] for name in bn.input[1:5]), epsilon)


def _folded(onnx, conv, bn, constants, taken: set[str]):
    """The convolution with the batch norm after it folded in, under the batch norm's output name."""
    scale, shift = _batch_norm_affine(bn, constants)
    weight = constants[conv.input[1]]
    bias = constants[conv.input[2]] if len(conv.input) > 2 and conv.input[2] else 0.0
    folded_weight, folded_bias = fold_batch_norm(
        weight, bias, scale, shift, 1 if conv.op_type == "ConvTranspose" else 0
    )
    out = bn.output[0]
    names = {fresh(f"{out}_folded_weight", taken): folded_weight, fresh(f"{out}_folded_bias", taken): folded_bias}
    constants.update(names)
    taken.update(names)
    folded = onnx.NodeProto()
    folded.CopyFrom(conv)
    del folded.input[:]
    folded.input.extend([conv.input[0], *names])
    folded.output[0] = out
    return folded


# --------------------------------------------------------------------------------------------
# The build: nodes to definitions


class _Build:
    """One import: ONNX values as IR tensors, constants as arrays, definitions in node order."""

    def __init__(self, onnx, opset, constants, inputs, inferred):
        self.onnx = onnx
        self.opset = opset
        self.constants = constants
        self.inputs = inputs
        self.shapes = dict(inputs)  # computed values (graph inputs, node outputs) -> shape
        self.inferred = inferred
        self.names = Names()
        self.weights: dict[str, np.ndarray] = {}
        self.definitions: list[tuple[str, Scope]] = []
        self.softmaxes: dict[str, tuple[Tensor, int]] = {}  # a Softmax's output -> its input and axis (IsNaN)

    def run(self, nodes, graph) -> Model:
        for name in self.inputs:
            self.names(name)
        for position, proto in nodes:
            if proto.op_type != "Constant":
                self.define(_Node(proto, position, self))
        outputs = []
        for value in graph.output:
            if value.name not in self.shapes or value.name in self.inputs:
                raise OnnxImportError(f"graph output {value.name!r} is not computed by a node")
            outputs.append(self.names(value.name))
        program = Program(tuple(self.definitions), tuple(outputs))
        names = {onnx: ir for onnx, ir in self.names.ids.items() if onnx in self.shapes or ir in self.weights}
        return Model(program, self.weights, dict(self.inputs), tuple(v.name for v in graph.output), names)

    def define(self, node: "_Node") -> None:
        op = SUPPORTED_OPS[node.op]
        try:
            result = op.handler(node)
        except OnnxImportError:
            raise
        except ExpressionError as err:
            raise OnnxImportError(f"{node.label}: {err}") from None
        for out, scope in zip(node.proto.output, result if op.outputs else [result]):
            if not out:
                continue  # an output the graph does not name: not computed
            expected = self.inferred.get(out)
            if expected is not None and expected != scope.shape:
                raise OnnxImportError(
                    f"{node.label}: the front-end computes shape {scope.shape} for {out!r}, ONNX shape inference {expected}"
                )
            self.shapes[out] = scope.shape
            self.definitions.append((self.names(out), scope))


class _Node:
    """One ONNX node as its handler sees it: inputs as IR tensors or constant arrays, attributes
    with defaults, errors that name the node."""

    def __init__(self, proto, position: int, build: _Build):
        self.proto = proto
        self.op = _op_key(proto)
        self.label = _label(proto, position)
        self.build = build
        self.attributes = {a.name: build.onnx.helper.get_attribute_value(a) for a in proto.attribute}

    @property
    def opset(self) -> int:
        return self.build.opset

    def error(self, message: str) -> OnnxImportError:
        return OnnxImportError(f"{self.label}: {message}")

    def attr(self, name: str, default=None):
        value = self.attributes.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def has(self, index: int) -> bool:
        return index < len(self.proto.input) and self.proto.input[index] != ""

    def const(self, index: int) -> np.ndarray | None:
        return self.build.constants.get(self.proto.input[index]) if self.has(index) else None

    def ints(self, name: str, index: int | None = None, default=None) -> tuple[int, ...] | None:
        """An integer list from attribute ``name`` or, in newer opsets, constant input ``index``."""
        if name in self.attributes:
            return tuple(int(v) for v in self.attributes[name])
        if index is not None and self.has(index):
            value = self.const(index)
            if value is None:
                raise self.error(f"input {index} ({name}, {self.proto.input[index]!r}) must be a constant")
            return tuple(int(v) for v in np.ravel(value))
        return default

    def shape(self, index: int) -> tuple[int, ...]:
        """The shape of input ``index``, without making a constant a weight of the program."""
        constant = self.const(index)
        return constant.shape if constant is not None else self.tensor(index).shape

    def tensor(self, index: int) -> Tensor:
        """Input ``index`` as the program reads it: a weight or a computed tensor."""
        if not self.has(index):
            raise self.error(f"input {index} is missing")
        name = self.proto.input[index]
        if name in self.build.constants:
            ir = self.build.names(name)
            self.build.weights[ir] = self.build.constants[name]
            return Tensor(ir, self.build.constants[name].shape)
        if name not in self.build.shapes:
            raise self.error(f"input {name!r} is not defined before the node")
        return Tensor(self.build.names(name), self.build.shapes[name])

    def weight(self, suffix: str, value: np.ndarray) -> Tensor:
        """A new weight computed at build time (a BatchNormalization's scale and shift)."""
        name = self.build.names.fresh(f"{self.proto.output[0]}_{suffix}")
        self.build.weights[name] = value
        return Tensor(name, value.shape)


# --------------------------------------------------------------------------------------------
# Small IR helpers


def _ones(shape: Sequence[int]) -> Scope:
    """``L i0, ... ; 1``: read at an index, 1 inside the shape and 0 outside (a bounds mask)."""
    return Scope(iterators(shape), (), Num(1.0))


# --------------------------------------------------------------------------------------------
# Handlers: convolutions and pooling


def _spatial(node: _Node, x: Tensor, ranks=(4,)) -> tuple[int, ...]:
    if x.rank not in ranks:
        what = " and ".join(f"{r - 2}-D (rank-{r})" for r in ranks)
        raise node.error(f"only {what} inputs are supported, got shape {x.shape}")
    return x.shape[2:]


def _pads(node: _Node, sizes, kernel, strides, dilations) -> list[tuple[int, int]]:
    """(begin, end) padding per spatial axis, from ``pads`` or ``auto_pad``."""
    auto = node.attr("auto_pad", "NOTSET")
    if auto == "NOTSET":
        pads = node.ints("pads", default=(0,) * (2 * len(sizes)))
        return list(zip(pads[: len(sizes)], pads[len(sizes) :]))
    if auto == "VALID":
        return [(0, 0)] * len(sizes)
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        raise node.error(f"attribute auto_pad={auto!r} is not supported")
    result = []
    for size, k, s, d in zip(sizes, kernel, strides, dilations):
        total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        result.append((small, big) if auto == "SAME_UPPER" else (big, small))
    return result


def _window(node: _Node, x: Tensor, kernel, ranks=(4,), ceil: bool = False):
    """Strides, dilations, pads and output sizes of a convolution or pooling window: floor mode,
    or with ``ceil`` ceil mode, where a last window may run past the end padding but must start
    inside the input or its begin padding (as PyTorch and onnxruntime count them)."""
    sizes = _spatial(node, x, ranks)
    strides = node.ints("strides", default=(1,) * len(sizes))
    dilations = node.ints("dilations", default=(1,) * len(sizes))
    pads = _pads(node, sizes, kernel, strides, dilations)
    out = []
    for n, k, s, d, (b, e) in zip(sizes, kernel, strides, dilations, pads):
        span = n + b + e - (k - 1) * d - 1
        size = -(-span // s) + 1 if ceil else span // s + 1
        out.append(size - 1 if ceil and (size - 1) * s >= n + b else size)
    if min(out) < 1:
        raise node.error(f"the window does not fit: input {sizes}, kernel {tuple(kernel)}, pads {pads}")
    return strides, dilations, pads, tuple(out)


def _kernel(node: _Node, weight_shape) -> tuple[int, int]:
    kernel = tuple(weight_shape[2:])
    given = node.ints("kernel_shape")
    if given is not None and given != kernel:
        raise node.error(f"attribute kernel_shape={given} differs from the weight's {kernel}")
    return kernel


def _with_bias(node: _Node, scope: Scope, index: int) -> Scope:
    """The scope plus input ``index`` (one value per output channel, axis 1), if present."""
    if not node.has(index):
        return scope
    bias = node.tensor(index)
    return elementwise(scope, lambda read: read + bias[Var("i1")])


def _conv(node: _Node) -> Scope:
    """Conv over 1-D (N, C, L) or 2-D (N, C, H, W) inputs."""
    x, w = node.tensor(0), node.tensor(1)
    kernel = _kernel(node, w.shape)
    strides, dilations, pads, out = _window(node, x, kernel, ranks=(3, 4))
    begin, end = tuple(b for b, _ in pads), tuple(e for _, e in pads)
    build = conv2d if x.rank == 4 else conv1d
    groups = node.attr("group", 1)
    scope = build(x, w, stride=strides, padding=begin, dilation=dilations, groups=groups, padding_end=end)
    return _with_bias(node, with_extent(scope, scope.shape[:2] + out), 2)


def _conv_transpose(node: _Node) -> Scope:
    x, w = node.tensor(0), node.tensor(1)
    if node.attr("group", 1) != 1:
        raise node.error(f"attribute group={node.attr('group')} is not supported (grouped transposed convolution)")
    if any(d != 1 for d in node.ints("dilations", default=(1, 1))):
        raise node.error(
            f"attribute dilations={node.ints('dilations')} is not supported (dilated transposed convolution)"
        )
    if node.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise node.error(f"attribute auto_pad={node.attr('auto_pad')!r} is not supported")
    kernel = _kernel(node, w.shape)
    sizes = _spatial(node, x)
    strides = node.ints("strides", default=(1, 1))
    pads = _pads(node, sizes, kernel, strides, (1, 1))
    extra = node.ints("output_padding", default=(0, 0))
    out = tuple(s * (n - 1) + e + k - b - a for n, k, s, e, (b, a) in zip(sizes, kernel, strides, extra, pads))
    scope = conv_transpose2d(x, w, stride=strides, padding=(pads[0][0], pads[1][0]))
    return _with_bias(node, with_extent(scope, scope.shape[:2] + out), 2)


def _pool(kind: str):
    """MaxPool / AveragePool over 2-D windows (floor or ceil mode).

    Padding is not zero for these: max pooling pads with -inf, so a padded read adds
    ``(ones[idx] - 1) * FLT_MAX`` (0 inside, the lowest float32 outside); average pooling without
    ``count_include_pad`` divides by the number of in-bounds reads, itself a scope over a ones mask,
    and with it by the number of reads inside the padding (a ceil-mode window's overhang past the
    end padding does not count).
    """

    def handle(node: _Node) -> Scope:
        x = node.tensor(0)
        kernel = node.ints("kernel_shape")
        if kernel is None or len(kernel) != 2:
            raise node.error(f"attribute kernel_shape must give 2 sizes, got {kernel}")
        ceil = bool(node.attr("ceil_mode", 0))
        (sh, sw), (dh, dw), pads, (oh, ow) = _window(node, x, kernel, ceil=ceil)
        rows, cols = affine_index({"h": sh, "r": dh}, -pads[0][0]), affine_index({"w": sw, "s": dw}, -pads[1][0])
        traversal = (
            Iterator("n", 0, x.shape[0]),
            Iterator("c", 0, x.shape[1]),
            Iterator("h", 0, oh),
            Iterator("w", 0, ow),
        )
        window = (Iterator("r", 0, kernel[0]), Iterator("s", 0, kernel[1]))
        read = x[Var("n"), Var("c"), rows, cols]
        within = tuple(n + b + e for n, (b, e) in zip(x.shape[2:], pads))  # the padded input's sizes
        reach = ((oh - 1) * sh + (kernel[0] - 1) * dh + 1, (ow - 1) * sw + (kernel[1] - 1) * dw + 1)
        overhang = reach[0] > within[0] or reach[1] > within[1]
        padded = any(b or e for b, e in pads) or overhang
        if kind == "max":  # ONNX pads with -inf; a padded read is float32's lowest finite value instead
            body = read + (_ones(x.shape[2:])[rows, cols] - 1.0) * FLOAT32_MAX if padded else read
            return Scope(traversal, window, body, "max")
        if padded and not node.attr("count_include_pad", 0):  # count the reads inside the input
            inside = _ones(x.shape[2:])[rows, cols]
        elif overhang:  # count the reads inside the padding
            inside = _ones(within)[affine_index({"h": sh, "r": dh}), affine_index({"w": sw, "s": dw})]
        else:
            return Scope(traversal, window, read * Num(1.0 / (kernel[0] * kernel[1])))
        count = Scope(traversal[2:], window, inside)
        return Scope(traversal, window, read / count[Var("h"), Var("w")])

    return handle


def _global_average_pool(node: _Node) -> Scope:
    x = node.tensor(0)
    return reduce_mean(x, tuple(range(2, x.rank)), keepdims=True)


def _batch_norm(node: _Node) -> Scope:
    """A BatchNormalization that could not be folded: ``x*scale[c] + shift[c]``, c = axis 1."""
    if not _batch_norm_mode_ok(node.proto):
        raise node.error("attributes training_mode=1 / spatial=0 are not supported")
    params = [node.const(k) for k in range(1, 5)]
    if any(p is None for p in params):
        raise node.error("scale, bias, mean and variance must be constants")
    x = node.tensor(0)
    scale, shift = _batch_norm_affine(node.proto, node.build.constants)
    if x.rank < 2 or x.shape[1] != scale.shape[0]:
        raise node.error(f"input shape {x.shape} does not have {scale.shape[0]} channels on axis 1")
    dtype = params[0].dtype
    s, t = node.weight("scale", scale.astype(dtype)), node.weight("shift", shift.astype(dtype))
    return elementwise(x, lambda read: read * s[Var("i1")] + t[Var("i1")])


# --------------------------------------------------------------------------------------------
# Handlers: products and element-wise operations


def _matmul(node: _Node) -> Scope:
    a, b = node.tensor(0), node.tensor(1)
    if a.rank == b.rank == 2:
        return matmul(a, b)
    if a.rank == b.rank == 3 and a.shape[0] == b.shape[0]:
        return batch_matmul(a, b)
    return _broadcast_matmul(node, a, b)


def _broadcast_matmul(node: _Node, a: Tensor, b: Tensor) -> Scope:
    """numpy's matmul where the builders stop: 1-D operands and broadcast batch axes
    (``L b0, ..., i, j ; S k ; A[.., i, k] * B[.., k, j]``, size-1 batch axes read at 0)."""
    k = a.shape[-1]
    if (b.shape[-2] if b.rank > 1 else b.shape[0]) != k:
        raise node.error(f"inner dimensions differ: {a.shape} @ {b.shape}")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise node.error(f"batch axes do not broadcast: {a.shape} @ {b.shape}") from None

    def batch_reads(shape):
        lead = len(batch) - len(shape)
        return [Lit(0) if size == 1 else Var(f"b{lead + t}") for t, size in enumerate(shape)]

    rows = (Iterator("i", 0, a.shape[-2]),) if a.rank > 1 else ()
    cols = (Iterator("j", 0, b.shape[-1]),) if b.rank > 1 else ()
    left = a[tuple(batch_reads(a.shape[:-2]) + [it.var for it in rows] + [Var("k")])]
    right = b[tuple(batch_reads(b.shape[:-2]) + [Var("k")] + [it.var for it in cols])]
    return Scope(iterators(batch, "b") + rows + cols, (Iterator("k", 0, k),), left * right)


def _operands(node: _Node, indices: Sequence[int]) -> list:
    """Element-wise operands; a one-element constant becomes a number (an IR constant) where the
    other operands alone give the output shape."""
    numbers: dict[int, float] = {}
    for i in indices:
        value = node.const(i)
        others = [len(node.shape(j)) for j in indices if j != i and j not in numbers]
        if value is not None and value.size == 1 and others and value.ndim <= max(others):
            numbers[i] = float(value.reshape(()))
    return [numbers[i] if i in numbers else node.tensor(i) for i in indices]


def _binary(op: str):
    def handle(node: _Node) -> Scope:
        return binary(op, *_operands(node, (0, 1)))

    return handle


def _gemm(node: _Node) -> Scope:
    a, b = node.tensor(0), node.tensor(1)
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    scope = matmul(a, b, transpose_a=bool(node.attr("transA", 0)), transpose_b=bool(node.attr("transB", 0)))
    if alpha != 1.0:
        scope = mul(scope, alpha)
    if not node.has(2) or beta == 0.0:
        return scope
    bias = node.const(2)
    if bias is not None and bias.size == 1:
        return add(scope, float(bias.reshape(())) * beta)
    return add(scope, node.tensor(2) if beta == 1.0 else mul(node.tensor(2), beta))


def _unary(builder):
    return lambda node: builder(node.tensor(0))


def _leaky_relu(node: _Node) -> Scope:
    """``relu(x) - alpha*relu(-x)``: exact for every alpha (``max(x, alpha*x)`` is not, above 1)."""
    alpha = node.attr("alpha", 0.01)
    return elementwise(node.tensor(0), lambda read: Unary("relu", read) - alpha * Unary("relu", -read))


def _identity(node: _Node) -> Scope:
    return elementwise(node.tensor(0), lambda read: read)


def _gather(node: _Node) -> Scope | Opaque:
    """Gather: a view where the indices are constants that step evenly, else an opaque gather
    (token embeddings: indices known only at run time)."""
    indices = node.const(1)
    chosen = node.tensor(1) if indices is None else indices
    return gather(node.tensor(0), chosen, node.attr("axis", 0), lambda values: node.weight("indices", values))


def _gather_elements(node: _Node) -> Opaque:
    index = node.const(1)
    chosen = node.tensor(1) if index is None else index
    return gather_elements(node.tensor(0), chosen, node.attr("axis", 0), lambda values: node.weight("indices", values))


def _cumsum(node: _Node) -> Scope:
    (axis,) = node.ints("axis", 1)
    return cumsum(node.tensor(0), axis, bool(node.attr("exclusive", 0)), bool(node.attr("reverse", 0)))


def _arg_max(node: _Node) -> Scope:
    """ArgMax: the position of the largest element along ``axis`` (``arg_max``)."""
    last = bool(node.attr("select_last_index", 0))
    constant = lambda values: node.weight("positions", values)  # noqa: E731
    return arg_max(node.tensor(0), node.attr("axis", 0), bool(node.attr("keepdims", 1)), constant, last)


def _logical(op: str):
    """And, Or, Xor of masks (``logical``)."""
    return lambda node: logical(op, *_operands(node, (0, 1)))


def _is_nan(node: _Node) -> Scope:
    """IsNaN (``is_nan``), of a Softmax's output the rows that are -inf everywhere."""
    return is_nan(node.tensor(0), node.build.softmaxes.get(node.proto.input[0]))


def _not(node: _Node) -> Scope:
    return elementwise(node.tensor(0), lambda read: 1.0 - read)


def _einsum(node: _Node) -> Scope:
    """Einsum through the builder: one iterator per letter (no ellipsis, no size-1 broadcasting)."""
    return einsum(node.attr("equation").replace(" ", ""), *(node.tensor(k) for k in range(len(node.proto.input))))


def _variadic(op: str):
    """Min / Max over any number of inputs, with broadcasting: a chain of binary ``op``."""

    def handle(node: _Node) -> Scope:
        inputs = _operands(node, range(len(node.proto.input)))
        result = inputs[0] if len(inputs) > 1 else binary(op, inputs[0], inputs[0])
        for other in inputs[1:]:
            result = binary(op, result, other)
        return result

    return handle


def _compare(op: str):
    return lambda node: compare(op, *_operands(node, (0, 1)))


def _where(node: _Node) -> Scope:
    return where(*_operands(node, (0, 1, 2)))


def _clip(node: _Node) -> Scope:
    """Bounds from attributes (before opset 11) or constant inputs 1 and 2 (either may be absent)."""
    bounds = []
    for index, name in ((1, "min"), (2, "max")):
        if name in node.attributes:
            bounds.append(float(node.attr(name)))
            continue
        value = node.const(index) if node.has(index) else None
        if node.has(index) and value is None:
            raise node.error(f"input {index} ({name}) must be a constant")
        bounds.append(None if value is None else float(np.ravel(value)[0]))
    return clip(node.tensor(0), *bounds)


def _hard_sigmoid(node: _Node) -> Scope:
    """``max(0, min(1, alpha*x + beta))``."""
    alpha, beta = node.attr("alpha", 0.2), node.attr("beta", 0.5)
    return clip(elementwise(node.tensor(0), lambda read: alpha * read + beta), 0.0, 1.0)


def _hard_swish(node: _Node) -> Scope:
    """``x * max(0, min(1, x/6 + 1/2))``."""
    x = node.tensor(0)
    gate = clip(elementwise(x, lambda read: read * (1 / 6) + 0.5), 0.0, 1.0)
    return mul(x, gate)


def _reciprocal(node: _Node) -> Scope:
    return binary("/", 1.0, node.tensor(0))


def _neg(node: _Node) -> Scope:
    return elementwise(node.tensor(0), lambda read: -read)


def _cast(node: _Node) -> Scope:
    """To a float type: the value; to bool or an integer type: ``cast``."""
    to = node.attr("to")
    if to in _FLOAT_TYPES:
        return _identity(node)
    if to == 9 or to in _INTEGER_TYPES:  # 9: BOOL
        return cast(node.tensor(0), "bool" if to == 9 else "integer")
    raise node.error(f"Cast to ONNX type {to} is not supported")


def _layer_norm(node: _Node) -> Scope:
    """LayerNormalization (opset 17) fissioned into mean, centring, variance, rsqrt and scale."""
    x = node.tensor(0)
    axis = node.attr("axis", -1) % max(x.rank, 1)
    if node.attr("stash_type", 1) != 1:
        raise node.error("stash_type other than float32 is not supported")
    bias = node.tensor(2) if node.has(2) else None
    return layer_norm(x, tuple(range(axis, x.rank)), node.attr("epsilon", 1e-5), node.tensor(1), bias)


def _gelu(node: _Node) -> Scope:
    return gelu(node.tensor(0), node.attr("approximate", "none"))


def _dropout(node: _Node) -> Scope:
    """Inference: the input (a training-mode input that is not a constant false is refused)."""
    training = node.const(2) if node.has(2) else None
    if (node.has(2) and training is None) or (training is not None and bool(np.ravel(training)[0])):
        raise node.error("Dropout in training mode is not supported")
    return _identity(node)


def _normalised_exp(builder, name: str):
    """Softmax / LogSoftmax along ``axis`` (opset 13 on; before it, only the last axis, which
    is where flattening the trailing axes changes nothing)."""

    def handle(node: _Node) -> Scope:
        x = node.tensor(0)
        axis = node.attr("axis", -1 if node.opset >= 13 else 1) % max(x.rank, 1)
        if node.opset < 13 and axis != x.rank - 1:
            raise node.error(
                f"before opset 13 {name} normalises axes {axis}.. flattened; only the last axis (axis={x.rank - 1}) is supported"
            )
        if name == "Softmax":
            node.build.softmaxes[node.proto.output[0]] = (x, axis)
        return builder(x, axis)

    return handle


def _instance_norm(node: _Node) -> Scope:
    """InstanceNormalization: each (sample, channel) normalised over its spatial axes (a layer
    norm over the trailing axes), then ``scale[c]`` and ``bias[c]`` along axis 1."""
    x = node.tensor(0)
    normalised = layer_norm(x, tuple(range(2, x.rank)), node.attr("epsilon", 1e-5))
    channel = (x.shape[1],) + (1,) * (x.rank - 2)
    scale, bias = (_reshaped(node, node.tensor(k), channel) for k in (1, 2))
    return add(mul(normalised, scale), bias)


def _group_norm(node: _Node) -> Scope:
    """GroupNormalization (``group_norm``). Opset 18 gives scale and bias per group (each
    channel takes its group's: a view), opset 21 per channel."""
    x, groups = node.tensor(0), node.attr("num_groups")
    if node.attr("stash_type", 1) != 1:
        raise node.error("stash_type other than float32 is not supported")
    scale, bias = node.tensor(1), node.tensor(2)
    if node.opset < 21 and scale.shape == (groups,) != (x.shape[1],):
        per_group = x.shape[1] // groups
        scale, bias = (Scope(iterators(x.shape[1:2]), (), t[Var("i0") // Lit(per_group)]) for t in (scale, bias))
    return group_norm(x, groups, node.attr("epsilon", 1e-5), scale, bias)


def _resize(node: _Node) -> Scope:
    """Resize, nearest and linear (``resize``: a view at rational nearest scales, else one
    interpolation matrix product per resized axis). Output sizes from ``sizes``, else the
    floor of size times ``scales`` (whose values the coordinates then use)."""
    x = node.tensor(0)
    if node.attr("mode", "nearest") not in ("nearest", "linear"):
        raise node.error(f"attribute mode={node.attr('mode')!r} is not supported (nearest and linear are)")
    if node.attr("antialias", 0) or node.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise node.error("attributes antialias and keep_aspect_ratio_policy are not supported")
    axes = [a % x.rank for a in node.ints("axes", default=range(x.rank))]
    scales_at, sizes_at = (1, None) if node.opset < 11 else (2, 3)
    scales = node.const(scales_at) if node.has(scales_at) else None
    sizes = node.const(sizes_at) if sizes_at is not None and node.has(sizes_at) else None
    if (sizes is None or sizes.size == 0) and (scales is None or scales.size == 0):
        raise node.error("the output sizes or scales must be constants")
    matrices = {}
    for k, axis in enumerate(axes):
        given = float(scales[k]) if sizes is None or sizes.size == 0 else None
        out = int(sizes[k]) if given is None else int(math.floor(x.shape[axis] * given))
        if out != x.shape[axis] or (given is not None and given != 1.0):
            matrices[axis] = resize_weights(
                x.shape[axis],
                out,
                node.attr("mode", "nearest"),
                node.attr("coordinate_transformation_mode", "half_pixel"),
                node.attr("nearest_mode", "round_prefer_floor"),
                given,
            )
    return resize(x, matrices, lambda matrix: node.weight("interpolation", matrix))


def _squeeze(node: _Node) -> Scope:
    """Squeeze / Unsqueeze: a reshape to the shape their axes give."""
    x = node.tensor(0)
    axes = node.ints("axes", 1)
    if node.proto.op_type == "Unsqueeze":
        rank = x.rank + len(axes)
        added = {a % rank for a in axes}
        dims, rest = [], iter(x.shape)
        for k in range(rank):
            dims.append(1 if k in added else next(rest))
    else:
        dropped = {a % x.rank for a in axes} if axes else {k for k, d in enumerate(x.shape) if d == 1}
        if any(x.shape[a] != 1 for a in dropped):
            raise node.error(f"cannot squeeze axes {sorted(dropped)} of shape {x.shape}")
        dims = [d for k, d in enumerate(x.shape) if k not in dropped]
    return _reshaped(node, x, dims)


def _expand(node: _Node) -> Scope:
    """Expand: numpy broadcasting to the constant shape (a size-1 axis is read at 0)."""
    x, target = node.tensor(0), node.ints("shape", 1)
    if target is None:
        raise node.error("input 1 (shape) must be a constant")
    rank = max(x.rank, len(target))
    a, b = (1,) * (rank - x.rank) + x.shape, (1,) * (rank - len(target)) + tuple(target)
    return broadcast_to(x, tuple(max(p, q) for p, q in zip(a, b)))


def _split(node: _Node) -> list[Scope]:
    """Split along ``axis`` into the sizes ``split`` gives (input 1 from opset 13, an attribute
    before), else into equal parts, one per output (the last smaller where they do not divide)."""
    x = node.tensor(0)
    axis = node.attr("axis", 0) % x.rank
    count = len(node.proto.output)
    sizes = node.ints("split", 1)
    if sizes is None:
        part = -(-x.shape[axis] // count)
        sizes = tuple(min(part, x.shape[axis] - k * part) for k in range(count))
    if sum(sizes) != x.shape[axis] or len(sizes) != count or min(sizes) < 1:
        raise node.error(
            f"split sizes {tuple(sizes)} do not divide axis {axis} of size {x.shape[axis]} into {count} outputs"
        )
    parts, start = [], 0
    for size in sizes:
        shape = x.shape[:axis] + (size,) + x.shape[axis + 1 :]
        its = iterators(shape)
        reads = tuple(it.var + start if k == axis and start else it.var for k, it in enumerate(its))
        parts.append(Scope(its, (), x[reads]))
        start += size
    return parts


def _reduce(builder):
    def handle(node: _Node) -> Scope:
        x = node.tensor(0)
        axes = node.ints("axes", 1)
        if not axes and node.attr("noop_with_empty_axes", 0):
            return elementwise(x, lambda read: read)
        return builder(x, axes or None, keepdims=bool(node.attr("keepdims", 1)))

    return handle


# --------------------------------------------------------------------------------------------
# Handlers: layout


def _reshape_reads(src: Sequence[int], dst: Sequence[int]) -> list[Index]:
    """Each source axis's index as a function of the output iterators i0, i1, ...

    Axes are grouped where the running products of the two shapes meet, so a split or merge reads
    with one affine index (``4*i1+i2``) or floor division and modulo by constants, never through
    one flat index over the whole tensor. Size-1 source axes read 0.
    """
    reads: list[Index] = [Lit(0)] * len(src)
    a = [k for k, d in enumerate(src) if d != 1]
    b = [k for k, d in enumerate(dst) if d != 1]
    while a:
        group_a, group_b = [a.pop(0)], [b.pop(0)]
        size_a, size_b = src[group_a[0]], dst[group_b[0]]
        while size_a != size_b:
            if size_a < size_b:
                group_a.append(a.pop(0))
                size_a *= src[group_a[-1]]
            else:
                group_b.append(b.pop(0))
                size_b *= dst[group_b[-1]]
        strides, stride = {}, 1
        for k in reversed(group_b):
            strides[f"i{k}"] = stride
            stride *= dst[k]
        flat = affine_index(dict(reversed(strides.items())))
        stride = 1
        for position, k in reversed(list(enumerate(group_a))):
            index = flat if stride == 1 else flat // stride
            reads[k] = index % src[k] if position else index
            stride *= src[k]
    return reads


def _reshaped(node: _Node, x: Tensor, shape: Sequence[int]) -> Scope:
    if math.prod(shape) != math.prod(x.shape):
        raise node.error(f"cannot reshape {x.shape} to {tuple(shape)}")
    its = iterators(shape)
    return Scope(its, (), x[tuple(_reshape_reads(x.shape, shape))])


def _reshape(node: _Node) -> Scope:
    x = node.tensor(0)
    target = node.ints("shape", 1)
    if target is None:
        raise node.error("input 1 (shape) is missing")
    allow_zero = node.attr("allowzero", 0)
    dims = [x.shape[k] if d == 0 and not allow_zero else d for k, d in enumerate(target)]
    if dims.count(-1) == 1:
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(x.shape) // known if known else 0
    return _reshaped(node, x, dims)


def _flatten(node: _Node) -> Scope:
    x = node.tensor(0)
    axis = node.attr("axis", 1)
    axis = axis + x.rank if axis < 0 else axis
    return _reshaped(node, x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


def _transpose(node: _Node) -> Scope:
    x = node.tensor(0)
    perm = node.ints("perm", default=tuple(reversed(range(x.rank))))
    if sorted(perm) != list(range(x.rank)):
        raise node.error(f"attribute perm={perm} is not a permutation of {x.rank} axes")
    reads: list[Index] = [Lit(0)] * x.rank
    for k, axis in enumerate(perm):
        reads[axis] = Var(f"i{k}")
    return Scope(iterators([x.shape[a] for a in perm]), (), x[tuple(reads)])


def _concat(node: _Node) -> Scope:
    """A sum of shifted reads: each input reads 0 outside its own slab of the concatenation axis."""
    parts = [node.tensor(k) for k in range(len(node.proto.input)) if node.has(k)]
    rank = parts[0].rank
    axis = node.attr("axis") % rank
    for part in parts:
        if part.rank != rank or any(part.shape[k] != parts[0].shape[k] for k in range(rank) if k != axis):
            raise node.error(f"input shapes {[p.shape for p in parts]} differ outside axis {axis}")
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    body, offset = None, 0
    for part in parts:
        reads = [Var(f"i{k}") for k in range(rank)]
        reads[axis] = affine_index({f"i{axis}": 1}, -offset)
        body = part[tuple(reads)] if body is None else body + part[tuple(reads)]
        offset += part.shape[axis]
    return Scope(iterators(shape), (), body)


def _slice(node: _Node) -> Scope:
    x = node.tensor(0)
    starts, ends = node.ints("starts", 1), node.ints("ends", 2)
    if starts is None or ends is None:
        raise node.error("starts and ends are missing")
    axes = node.ints("axes", 3, default=tuple(range(len(starts))))
    steps = node.ints("steps", 4, default=(1,) * len(starts))
    shape, reads = list(x.shape), [Var(f"i{k}") for k in range(x.rank)]
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= x.rank
        size = x.shape[axis]
        if step == 0:
            raise node.error("a step of 0")
        start, end = (v + size if v < 0 else v for v in (start, end))
        if step > 0:
            start, end = min(max(start, 0), size), min(max(end, 0), size)
        else:
            start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
        shape[axis] = max(0, -(-(end - start) // step))
        if shape[axis] == 0:
            raise node.error(f"the slice of axis {axis} is empty")
        reads[axis] = affine_index({f"i{axis}": step}, start)
    return Scope(iterators(shape), (), x[tuple(reads)])


def _pad(node: _Node) -> Scope:
    """Constant padding: reads shifted by the leading pads (0 outside); a non-zero value v adds
    ``v * (1 - ones[idx])``. Negative pads crop."""
    mode = node.attr("mode", "constant")
    if mode != "constant":
        raise node.error(f"attribute mode={mode!r} is not supported")
    x = node.tensor(0)
    pads = node.ints("pads", 1)
    if pads is None:
        raise node.error("pads are missing")
    axes = [a % x.rank for a in node.ints("axes", 3, default=tuple(range(x.rank)))]
    begin, end = [0] * x.rank, [0] * x.rank
    for k, axis in enumerate(axes):
        begin[axis], end[axis] = pads[k], pads[k + len(axes)]
    value = node.attr("value", 0.0)
    if node.has(2):
        constant = node.const(2)
        if constant is None:
            raise node.error("input 2 (constant_value) must be a constant")
        value = float(np.ravel(constant)[0])
    shape = [d + b + e for d, b, e in zip(x.shape, begin, end)]
    reads = tuple(affine_index({f"i{k}": 1}, -b) for k, b in enumerate(begin))
    body = x[reads] if value == 0 else x[reads] + value * (1.0 - _ones(x.shape)[reads])
    return Scope(iterators(shape), (), body)


@dataclass(frozen=True)
class _Op:
    handler: Callable[[_Node], Scope] | None  # None: consumed at build time (Constant)
    attributes: frozenset[str] = frozenset()
    outputs: bool = False  # the handler returns one scope per node output (Split)


def _op(handler, *attributes: str, outputs: bool = False) -> _Op:
    return _Op(handler, frozenset(attributes), outputs)


_WINDOW = ("auto_pad", "dilations", "kernel_shape", "pads", "strides")

# op type -> handler and the attributes it reads; anything else is refused up front.
SUPPORTED_OPS: dict[str, _Op] = {
    "Conv": _op(_conv, "group", *_WINDOW),
    "ConvTranspose": _op(_conv_transpose, "group", "output_padding", *_WINDOW),
    "MatMul": _op(_matmul),
    "Gemm": _op(_gemm, "alpha", "beta", "transA", "transB"),
    "Add": _op(_binary("+")),
    "Sub": _op(_binary("-")),
    "Mul": _op(_binary("*")),
    "Div": _op(_binary("/")),
    "Pow": _op(_binary("pow")),
    "Min": _op(_variadic("min")),
    "Max": _op(_variadic("max")),
    "Equal": _op(_compare("equal")),
    "Less": _op(_compare("less")),
    "LessOrEqual": _op(_compare("less_equal")),
    "Greater": _op(_compare("greater")),
    "GreaterOrEqual": _op(_compare("greater_equal")),
    "Where": _op(_where),
    "Relu": _op(_unary(relu)),
    "LeakyRelu": _op(_leaky_relu, "alpha"),
    "Sigmoid": _op(_unary(sigmoid)),
    "Tanh": _op(_unary(tanh)),
    "Sin": _op(_unary(sin)),
    "Cos": _op(_unary(cos)),
    "Exp": _op(_unary(exp)),
    "Log": _op(_unary(log)),
    "Erf": _op(_unary(erf)),
    "Sqrt": _op(_unary(sqrt)),
    "Abs": _op(_unary(absolute)),
    "Floor": _op(_unary(floor)),
    "Ceil": _op(_unary(ceil)),
    "Neg": _op(_neg),
    "Reciprocal": _op(_reciprocal),
    "Clip": _op(_clip, "min", "max"),
    "HardSigmoid": _op(_hard_sigmoid, "alpha", "beta"),
    "HardSwish": _op(_hard_swish),
    "Gelu": _op(_gelu, "approximate"),
    "Cast": _op(_cast, "to", "saturate"),
    "Dropout": _op(_dropout, "seed", "ratio"),
    "LayerNormalization": _op(_layer_norm, "axis", "epsilon", "stash_type"),
    "InstanceNormalization": _op(_instance_norm, "epsilon"),
    "GroupNormalization": _op(_group_norm, "epsilon", "num_groups", "stash_type"),
    "LogSoftmax": _op(_normalised_exp(log_softmax, "LogSoftmax"), "axis"),
    "ReduceMax": _op(_reduce(reduce_max), "axes", "keepdims", "noop_with_empty_axes"),
    "Squeeze": _op(_squeeze, "axes"),
    "Resize": _op(
        _resize,
        "mode",
        "coordinate_transformation_mode",
        "nearest_mode",
        "cubic_coeff_a",
        "exclude_outside",
        "extrapolation_value",
        "antialias",
        "axes",
        "keep_aspect_ratio_policy",
    ),
    "Gather": _op(_gather, "axis"),
    "GatherElements": _op(_gather_elements, "axis"),
    "CumSum": _op(_cumsum, "exclusive", "reverse"),
    "ArgMax": _op(_arg_max, "axis", "keepdims", "select_last_index"),
    "Einsum": _op(_einsum, "equation"),
    "Not": _op(_not),
    "And": _op(_logical("and")),
    "Or": _op(_logical("or")),
    "Xor": _op(_logical("xor")),
    "IsNaN": _op(_is_nan),
    "Split": _op(_split, "axis", "split", "num_outputs", outputs=True),
    "Unsqueeze": _op(_squeeze, "axes"),
    "Expand": _op(_expand),
    "BatchNormalization": _op(_batch_norm, "epsilon", "momentum", "training_mode", "spatial"),
    "Reshape": _op(_reshape, "allowzero"),
    "Flatten": _op(_flatten, "axis"),
    "Transpose": _op(_transpose, "perm"),
    "Concat": _op(_concat, "axis"),
    "Slice": _op(_slice, "starts", "ends", "axes"),
    "Pad": _op(_pad, "mode", "pads", "value"),
    "Softmax": _op(_normalised_exp(softmax, "Softmax"), "axis"),
    "ReduceMean": _op(_reduce(reduce_mean), "axes", "keepdims", "noop_with_empty_axes"),
    "ReduceSum": _op(_reduce(reduce_sum), "axes", "keepdims", "noop_with_empty_axes"),
    "ReduceL1": _op(_reduce(functools.partial(reduce_norm, ord=1)), "axes", "keepdims", "noop_with_empty_axes"),
    "ReduceL2": _op(_reduce(reduce_norm), "axes", "keepdims", "noop_with_empty_axes"),
    "GlobalAveragePool": _op(_global_average_pool),
    "AveragePool": _op(_pool("average"), "ceil_mode", "count_include_pad", *_WINDOW),
    "MaxPool": _op(_pool("max"), "ceil_mode", "storage_order", *_WINDOW),
    "Constant": _op(None, "value", "value_float", "value_floats", "value_int", "value_ints"),
    "Identity": _op(_identity),
}
