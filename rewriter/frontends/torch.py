"""PyTorch front-end: a ``torch.nn.Module`` as a ``Program`` of the expression IR, and a
``torch.compile`` backend (DESIGN.md, "Programs and models"). Needs torch (``pip install
'rewriter[torch]'``); importing this module does not import it.

    from rewriter.frontends.torch import from_torch
    model = from_torch(module.eval(), (x,))
    model.run({"x": x.numpy()})                     # FX input name -> array; outputs by FX name
    evaluate(model.program, model.feeds({"x": x.numpy()}))   # the same through the reference semantics

    torch.compile(module, backend="rewriter")       # after register(), or through the entry point

``from_torch`` exports the module with ``torch.export`` and decomposes it to core ATen operators,
so one table of handlers (``SUPPORTED_OPS``, keyed by overload: ``aten.addmm.default``) serves
every module: ``linear`` arrives as ``permute`` + ``addmm``, ``flatten`` as ``view``, ``dropout``
in eval mode as ``clone``. Every FX call becomes one definition named after its node, except the
no-ops (aliases of their input) and the calls computed from constants alone (a weight's transpose,
``torch.ones``), which are folded at build time. Parameters, buffers and folded constants the
program reads are its weights; an inference-mode batch norm is folded into the convolution before
it when it is that convolution's only reader, else it is a per-channel affine scope.

Shapes are static. What is not supported fails loudly: every unsupported operator of a graph is
listed in one ``TorchImportError`` (with FX node names) before anything else is done; a handler's
refusal (a 3-D convolution, a ``divisor_override``) names the node.

The backend translates each graph dynamo gives it the same way (its parameters are graph inputs,
read at every call, so nothing is folded into them), optimizes it (``optimize_program``) and runs
the compiled program. A graph it cannot translate (dynamic shapes: pass ``dynamic=False``) runs
as it came, with a warning that says why.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

from rewriter.index import affine_index, simplify
from rewriter.ir import (
    Binary,
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
    smax,
)
from rewriter.ir.builders import (
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
    erf,
    exp,
    floor,
    gelu,
    group_norm,
    layer_norm,
    log,
    matmul,
    mul,
    reduce_max,
    reduce_mean,
    reduce_norm,
    reduce_sum,
    relu,
    rsqrt,
    sigmoid,
    sin,
    softmax,
    sqrt,
    tanh,
    unary,
    where,
)
from rewriter.pipeline import optimize_program

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
    gather,
    gather_elements,
    is_nan,
    iterators,
    logical,
    resize,
    resize_weights,
)
from .onnx import _concat, _ones, _pad, _pool, _reshaped, _slice, _transpose

__all__ = ["TorchImportError", "from_torch", "rewriter_backend", "register", "SUPPORTED_OPS"]

BACKEND_NAME = "rewriter"


class TorchImportError(FrontendError):
    """A module or graph the front-end cannot translate; the message names the FX node or input."""


def from_torch(module, example_inputs: Sequence) -> Model:
    """Translate ``module`` (a ``torch.nn.Module``, in eval mode for batch norm and dropout) at the
    shapes of ``example_inputs`` (a sequence of tensors) to a ``Model``: the program, its weights
    (numpy arrays), its inputs and outputs by FX placeholder and output node name."""
    return _translate(_export(module, example_inputs))


def _import_torch():
    try:
        import torch
    except ImportError:
        raise TorchImportError("the PyTorch front-end needs torch: pip install 'rewriter[torch]'") from None
    return torch


def _export(module, example_inputs: Sequence):
    """The module as a functional graph of core ATen operators: ``torch.export`` then its default
    decompositions, which leave far fewer operators (and overloads) to handle. Attention
    (``scaled_dot_product_attention``) is kept whole: its decompositions give their result other
    strides than the operator's, and a ``view`` after it that holds in eager mode fails there
    (GPT-2 with more than one sequence)."""
    torch = _import_torch()
    try:
        return torch.export.export(module, tuple(example_inputs)).run_decompositions(_decompositions())
    except Exception as err:  # torch.export raises many unrelated types
        raise TorchImportError(f"torch.export fails: {type(err).__name__}: {err}") from None


def _decompositions() -> dict:
    """The decompositions ``_export`` runs: torch's defaults, attention left whole. Which
    operators they take apart moves with torch's version (``linalg_vector_norm`` since 2.14)."""
    table = _import_torch().export.default_decompositions()
    for op in [op for op in table if "scaled_dot_product" in str(op)]:
        del table[op]
    return table


def _translate(exported) -> Model:
    graph = exported.graph
    constants = _constant_inputs(exported)
    foldable = _foldable(graph, constants)
    _check_ops(graph, foldable)
    _check_outputs(exported)
    model = _Build(constants, _user_inputs(exported)).run(graph, foldable)
    placeholders = {node.name: node.meta.get("val") for node in graph.nodes if node.op == "placeholder"}
    integers = {name for name in model.inputs if not placeholders[name].dtype.is_floating_point}
    return replace(model, integers=frozenset(integers))


# --------------------------------------------------------------------------------------------
# Checks and constants, before any translation


def _op_key(node) -> str:
    """``aten.add.Tensor`` for an ATen overload; the Python name for anything else (getitem)."""
    target = node.target
    return str(target) if hasattr(target, "overloadpacket") else getattr(target, "__name__", repr(target))


def _check_ops(graph, foldable: set[str]) -> None:
    """One error listing every unsupported operator with its FX node, before any other work
    (calls folded at build time run in torch and need no handler)."""
    unsupported = [
        (_op_key(node), node.name)
        for node in graph.nodes
        if node.op == "call_function" and node.name not in foldable and _op_key(node) not in SUPPORTED_OPS
    ]
    if unsupported:
        kinds = sorted({op for op, _ in unsupported})
        raise TorchImportError(
            f"{len(unsupported)} node(s) with unsupported operators ({', '.join(kinds)}): "
            + "; ".join(f"{op} node {name!r}" for op, name in unsupported)
            + ". Supported: rewriter.frontends.torch.SUPPORTED_OPS"
        )


def _check_outputs(exported) -> None:
    """Only plain outputs: a graph that mutates a buffer or an input (batch norm in training mode
    updating its statistics) has effects a program cannot have."""
    specs = exported.graph_signature.output_specs
    effects = [f"{spec.kind.name.lower()} of {spec.target!r}" for spec in specs if spec.kind.name != "USER_OUTPUT"]
    if effects:
        raise TorchImportError(f"the graph has side effects ({', '.join(effects)}); is the module in eval mode?")


def _constant_inputs(exported) -> dict[str, object]:
    """Placeholder name -> tensor for parameters, buffers and lifted constants."""
    constants = {}
    for spec in exported.graph_signature.input_specs:
        if spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            source = exported.state_dict if spec.target in exported.state_dict else exported.constants
            constants[spec.arg.name] = source[spec.target]
        elif spec.kind.name != "USER_INPUT":
            raise TorchImportError(f"graph input {spec.arg.name!r} of kind {spec.kind.name} is not supported")
    return constants


def _user_inputs(exported) -> dict[str, tuple[int, ...]]:
    """FX name -> static shape of each user input, in call order; only tensors of numbers
    (integer and boolean ones, token ids and masks, are float data in the program)."""
    nodes = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    shapes = {}
    for spec in exported.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            value = nodes[spec.arg.name].meta.get("val")
            if getattr(value, "is_complex", lambda: True)():
                raise TorchImportError(f"input {spec.arg.name!r} is not a real-valued tensor ({value!r})")
            shapes[spec.arg.name] = _static_shape(value, f"input {spec.arg.name!r}")
    return shapes


def _static_shape(value, what: str) -> tuple[int, ...]:
    if not all(isinstance(d, int) for d in value.shape):
        raise TorchImportError(f"{what} has a dynamic shape {tuple(value.shape)}; only static shapes are supported")
    return tuple(value.shape)


def _foldable(graph, constants) -> set[str]:
    """Names of the nodes computed from constants alone, placeholders included: they are run in
    torch at build time. Seeded random operators are not: their value changes from call to call."""
    torch = _import_torch()
    known = set(constants)
    for node in graph.nodes:
        seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        if node.op == "call_function" and not seeded and all(n.name in known for n in node.all_input_nodes):
            known.add(node.name)
    return known


# --------------------------------------------------------------------------------------------
# The build: FX calls to definitions


class _Build:
    """One translation: FX values as program tensors, constants as torch values (weights once the
    program reads them), definitions in graph order."""

    def __init__(self, constants: dict[str, object], inputs: dict[str, tuple[int, ...]]):
        self.constants = dict(constants)
        self.inputs = inputs
        self.names = Names()
        # values with no elements (a size-0 axis) are never defined: only a cat reads one, and
        # leaves it out. Dynamo hands an empty parameter over as a graph input (YOLOS's middle
        # position embeddings with one layer), which the program then never reads.
        self.empty: set[str] = {name for name, shape in inputs.items() if 0 in shape}
        self.values: dict[str, Tensor] = {
            name: Tensor(self.names(name), shape) for name, shape in inputs.items() if name not in self.empty
        }
        self.weights: dict[str, np.ndarray] = {}
        self.definitions: list[tuple[str, Scope]] = []
        self.folded_batch_norms: set[str] = set()  # batch norms a convolution has taken in

    def run(self, graph, foldable: set[str]) -> Model:
        for fx in graph.nodes:
            if fx.op == "call_function" and fx.name in foldable:
                self.fold(fx)
            elif fx.op == "call_function":
                self.define(_Node(fx, self))
        results = graph.output_node().args[0]
        outputs = tuple(self.output(fx) for fx in results)
        program = Program(tuple(self.definitions), outputs)
        held = set(program.inputs) | {name for name, _ in self.definitions}
        names = {fx: tensor.name for fx, tensor in self.values.items() if tensor.name in held or fx in self.inputs}
        return Model(program, self.weights, dict(self.inputs), tuple(fx.name for fx in results), names)

    def fold(self, fx) -> None:
        """Run a call on constants in torch; its value is a constant like a parameter."""
        args, kwargs = _map_nodes((fx.args, fx.kwargs), lambda n: self.constants[n.name])
        try:
            self.constants[fx.name] = fx.target(*args, **kwargs)
        except Exception as err:  # whatever the operator raises
            raise TorchImportError(f"{_op_key(fx)} node {fx.name!r}: folding it at build time fails: {err}") from None

    def define(self, node: "_Node") -> None:
        if 0 in getattr(node.fx.meta.get("val"), "shape", ()):
            self.empty.add(node.name)
            return
        try:
            result = SUPPORTED_OPS[node.key](node)
        except TorchImportError:
            raise
        except ExpressionError as err:
            raise node.error(str(err)) from None
        if result is None:  # a split (its parts are defined where they are read), a check
            return
        if isinstance(result, Tensor):  # a no-op, a folded batch norm, output 0 of a tuple
            self.values[node.name] = result
            return
        if result.shape != node.shape:
            raise node.error(f"the front-end computes shape {result.shape}, torch {node.shape}")
        name = self.names(node.name)
        self.definitions.append((name, result))
        self.values[node.name] = Tensor(name, result.shape)

    def tensor(self, fx) -> Tensor:
        """An FX value as the program reads it: a computed tensor, an input or a weight."""
        if fx.name in self.empty:
            raise TorchImportError(f"{fx.name!r} is empty (a size-0 axis): only cat reads an empty tensor")
        if fx.name not in self.values:
            if fx.name not in self.constants:
                raise TorchImportError(f"{fx.name!r} is not defined before it is read")
            self.values[fx.name] = self.weight(fx.name, _numpy(self.constants[fx.name]))
        return self.values[fx.name]

    def intermediate(self, text: str, scope: Scope) -> Tensor:
        """A definition a handler makes before its own (a view another definition reads)."""
        name = self.names.fresh(text)
        self.definitions.append((name, scope))
        return Tensor(name, scope.shape)

    def weight(self, text: str, value: np.ndarray) -> Tensor:
        name = self.names.fresh(text)
        self.weights[name] = value
        return Tensor(name, value.shape)

    def output(self, fx) -> str:
        """The program name of an output; an input or a weight returned as it is gets a copy,
        since program outputs are definitions."""
        if not hasattr(fx, "name"):
            raise TorchImportError(f"output {fx!r} is not a tensor")
        tensor = self.tensor(fx)
        if any(name == tensor.name for name, _ in self.definitions):
            return tensor.name
        name = self.names.fresh(f"{fx.name}_out")
        self.definitions.append((name, elementwise(tensor, lambda read: read)))
        return name


def _map_nodes(value, fn):
    """``value`` (nested lists, tuples, dicts) with every FX node replaced by ``fn(node)``."""
    if isinstance(value, (list, tuple)):
        return type(value)(_map_nodes(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_nodes(v, fn) for k, v in value.items()}
    return fn(value) if hasattr(value, "all_input_nodes") else value


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy()


class _Node:
    """One FX call as its handler sees it: arguments with the schema's defaults, tensors and
    constants as the program reads them, errors that name the node."""

    def __init__(self, fx, build: _Build):
        self.fx = fx
        self.build = build
        self.name = fx.name
        self.key = _op_key(fx)
        self.label = f"{self.key} node {fx.name!r}"

    def error(self, message: str) -> TorchImportError:
        return TorchImportError(f"{self.label}: {message}")

    def arg(self, index: int):
        """Argument ``index``: positional, by keyword, or the schema's default."""
        if index < len(self.fx.args):
            return self.fx.args[index]
        spec = self.fx.target._schema.arguments[index]
        return self.fx.kwargs.get(spec.name, spec.default_value if spec.has_default_value() else None)

    def tensor(self, index: int) -> Tensor:
        return self.build.tensor(self.arg(index))

    def const(self, index: int) -> np.ndarray | None:
        """Argument ``index`` as an array when it is known at build time (None otherwise)."""
        value = self.arg(index)
        name = getattr(value, "name", None)
        return _numpy(self.build.constants[name]) if name in self.build.constants else None

    def weight(self, suffix: str, value: np.ndarray) -> Tensor:
        """A new weight computed at build time (a folded batch norm's scale and shift)."""
        return self.build.weight(f"{self.name}_{suffix}", value)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape torch gives the (first) result: the cross-check of every definition."""
        value = self.fx.meta["val"]
        return _static_shape(value[0] if isinstance(value, (tuple, list)) else value, self.label)


class _AsOnnx:
    """An ATen call dressed as the ONNX node that means the same, so onnx_frontend's handlers for
    pooling, concatenation, slicing, padding and transposition translate it: the semantics agree,
    only the argument layout differs (the caller converts that)."""

    def __init__(self, node: _Node, inputs: Sequence, **attributes):
        self.node = node
        self.inputs = list(inputs)
        self.attributes = attributes
        self.proto = SimpleNamespace(input=self.inputs)

    def error(self, message: str) -> TorchImportError:
        return self.node.error(message)

    def has(self, index: int) -> bool:
        return index < len(self.inputs)

    def tensor(self, index: int) -> Tensor:
        return self.node.build.tensor(self.inputs[index])

    def attr(self, name: str, default=None):
        return self.attributes.get(name, default)

    def ints(self, name: str, index: int | None = None, default=None):
        return tuple(self.attributes[name]) if name in self.attributes else default


# --------------------------------------------------------------------------------------------
# Handlers: convolution and batch norm


_BATCH_NORM = "aten._native_batch_norm_legit_no_training.default"


def _convolution(node: _Node) -> Scope:
    """``convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)``."""
    x = node.tensor(0)
    stride, padding, dilation, transposed, output_padding, groups = (node.arg(k) for k in range(3, 9))
    if x.rank not in (3, 4) or (transposed and x.rank != 4):
        raise node.error(
            f"only 1-D and 2-D convolutions and 2-D transposed ones are supported, got input shape {x.shape}"
        )
    if transposed and (groups != 1 or any(d != 1 for d in dilation)):
        raise node.error(f"transposed convolution with groups={groups}, dilation={dilation} is not supported")
    weight, bias = _conv_parameters(node, transposed)
    if x.rank == 4:  # a one-element list stands for both axes (EfficientNet's depthwise convolutions)
        stride, padding, dilation, output_padding = map(_two, (stride, padding, dilation, output_padding))
    if transposed:
        scope = conv_transpose2d(x, weight, stride, padding, output_padding)
    else:
        scope = (conv2d if x.rank == 4 else conv1d)(x, weight, stride, padding, dilation, groups)
    return scope if bias is None else elementwise(scope, lambda read: read + bias[Var("i1")])


def _conv_parameters(node: _Node, transposed: bool) -> tuple[Tensor, Tensor | None]:
    """Weight and bias, with the batch norm after the convolution folded in when it is the
    convolution's only reader and everything is known at build time: inference-mode batch norm
    is ``x*scale + shift`` per output channel, so it scales the weight along that axis."""
    has_bias = node.arg(2) is not None
    weight, bias = node.const(1), node.const(2) if has_bias else 0.0
    affine = _only_batch_norm_reader(node) if weight is not None and bias is not None else None
    if affine is None:
        return node.tensor(1), node.tensor(2) if has_bias else None
    folded_weight, folded_bias = fold_batch_norm(weight, bias, *affine, 1 if transposed else 0)
    return node.weight("folded_weight", folded_weight), node.weight("folded_bias", folded_bias)


def _only_batch_norm_reader(node: _Node) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) of the batch norm that alone reads the convolution's result, when its
    parameters are constants; that batch norm is then marked folded."""
    readers = list(node.fx.users)
    if len(readers) != 1 or _op_key(readers[0]) != _BATCH_NORM or readers[0].args[0] is not node.fx:
        return None
    bn = _Node(readers[0], node.build)
    affine = _batch_norm_affine(bn)
    if affine is not None:
        node.build.folded_batch_norms.add(bn.name)
    return affine


def _batch_norm_affine(bn: _Node) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) per channel of inference-mode batch norm, y = x*scale + shift, or None when
    a parameter is not known at build time. A missing weight or bias (affine=False) is 1 or 0."""
    mean, var = bn.const(3), bn.const(4)
    gamma = bn.const(1) if bn.arg(1) is not None else 1.0
    beta = bn.const(2) if bn.arg(2) is not None else 0.0
    if any(p is None for p in (gamma, beta, mean, var)):
        return None
    return batch_norm_affine(gamma, beta, mean, var, bn.arg(6))


def _batch_norm(node: _Node) -> Scope | Tensor:
    """``_native_batch_norm_legit_no_training(x, weight, bias, mean, var, momentum, eps)``: folded
    into the convolution before it, else ``x*scale[c] + shift[c]`` with c = axis 1 (computed in the
    program when the parameters are graph inputs, as under torch.compile)."""
    if node.name in node.build.folded_batch_norms:
        return node.tensor(0)
    x = node.tensor(0)
    affine = _batch_norm_affine(node)
    if affine is not None:
        dtype = node.const(3).dtype
        scale, shift = (node.weight(name, value.astype(dtype)) for name, value in zip(("scale", "shift"), affine))
        return elementwise(x, lambda read: read * scale[Var("i1")] + shift[Var("i1")])
    c = Var("i1")
    mean, var = node.tensor(3), node.tensor(4)

    def normalise(read):
        out = (read - mean[c]) / Unary("sqrt", var[c] + float(node.arg(6)))
        out = out * node.tensor(1)[c] if node.arg(1) is not None else out
        return out + node.tensor(2)[c] if node.arg(2) is not None else out

    return elementwise(x, normalise)


def _batch_statistics_norm(node: _Node) -> Scope:
    """``_native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)``: x
    normalised by its own mean and (biased) variance over every axis but the channels (axis 1),
    as BiT's weight standardization computes it from a weight under torch.compile; output 0."""
    x = node.tensor(0)
    axes = tuple(axis for axis in range(x.rank) if axis != 1)
    centred = binary("-", x, reduce_mean(x, axes, keepdims=True))
    variance = reduce_mean(mul(centred, centred), axes, keepdims=True)
    normalised = mul(centred, rsqrt(add(variance, float(node.arg(5)))))
    c = Var("i1")
    weight = node.tensor(1) if node.arg(1) is not None else None
    bias = node.tensor(2) if node.arg(2) is not None else None

    def affine(read):
        read = read * weight[c] if weight is not None else read
        return read + bias[c] if bias is not None else read

    return normalised if weight is None and bias is None else elementwise(normalised, affine)


# --------------------------------------------------------------------------------------------
# Handlers: products and element-wise operations


def _addmm(node: _Node) -> Scope:
    """``beta*bias + alpha*(a @ b)`` (``linear`` decomposes to this)."""
    product = matmul(node.tensor(1), node.tensor(2))
    beta, alpha = node.arg(3), node.arg(4)
    product = product if alpha == 1 else mul(product, alpha)
    return add(product, node.tensor(0) if beta == 1 else mul(node.tensor(0), beta))


def _operand(node: _Node, index: int, other: int):
    """An element-wise operand: a number stays a number, as does a one-element constant when the
    other operand alone has the output's rank; anything else is a tensor."""
    value = node.arg(index)
    if not hasattr(value, "name"):
        return float(value)
    constant = node.const(index)
    partner = node.arg(other)
    partner_rank = len(partner.meta["val"].shape) if hasattr(partner, "meta") else -1
    if constant is not None and constant.size == 1 and constant.ndim <= partner_rank:
        return float(constant.reshape(()))
    return node.tensor(index)


def _binary(op: str):
    """``add.Tensor``, ``sub.Tensor`` (with ``alpha``), ``mul.Tensor``, ``div.Tensor``."""

    def handle(node: _Node) -> Scope:
        a, b = _operand(node, 0, 1), _operand(node, 1, 0)
        alpha = node.arg(2) if op in "+-" else 1
        if alpha != 1:
            b = b * alpha if isinstance(b, float) else mul(b, alpha)
        return binary(op, a, b)

    return handle


def _unary(builder):
    return lambda node: builder(node.tensor(0))


def _leaky_relu(node: _Node) -> Scope:
    """``relu(x) - slope*relu(-x)``: exact for every slope (``max(x, slope*x)`` is not, above 1)."""
    slope = float(node.arg(1))
    return elementwise(node.tensor(0), lambda read: Unary("relu", read) - slope * Unary("relu", -read))


def _hardtanh(node: _Node) -> Scope:
    """``min(max(x, low), high)`` as ``-max(-max(x, low), -high)`` (ReLU6 arrives as this)."""
    low, high = float(node.arg(1)), float(node.arg(2))
    return elementwise(node.tensor(0), lambda read: -smax(-smax(read, low), -high))


def _reciprocal(node: _Node) -> Scope:
    return binary("/", 1.0, node.tensor(0))


_COMPARISONS = {"lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal", "eq": "equal"}


def _compare(op: str):
    """``gt.Scalar``, ``lt.Tensor``, ...: a 0/1 mask (against an infinite scalar, attention's
    ``scores == -inf``, as ``compare`` takes one)."""

    def handle(node: _Node):
        return compare(op, _operand(node, 0, 1), _operand(node, 1, 0))

    return handle


def _where(node: _Node) -> Scope:
    return where(node.tensor(0), _operand(node, 1, 2), _operand(node, 2, 1))


def _clamp(node: _Node) -> Scope:
    low, high = node.arg(1), node.arg(2)
    return clip(node.tensor(0), None if low is None else float(low), None if high is None else float(high))


def _not_equal(node: _Node) -> Scope:
    """``ne``: ``1 - (a == b)`` (a 0/1 mask)."""
    return elementwise(_compare("equal")(node), lambda read: 1.0 - read)


def _to_copy(node: _Node) -> Tensor | Scope:
    """``_to_copy(x, dtype=...)`` (``.to``, ``.type_as``): data are float here, so to a float
    type it is the value, to bool or an integer type ``cast``."""
    dtype, x = node.fx.kwargs.get("dtype"), node.tensor(0)
    if dtype is None or dtype.is_floating_point:
        return x
    return cast(x, "bool" if str(dtype) == "torch.bool" else "integer")


def _flip(node: _Node) -> Scope:
    """``flip(x, dims)``: a view reading each flipped axis from its end."""
    x = node.tensor(0)
    flipped = {d % x.rank for d in node.arg(1)}
    its = iterators(x.shape)
    return Scope(
        its,
        (),
        x[tuple(size - 1 - it.var if k in flipped else it.var for k, (it, size) in enumerate(zip(its, x.shape)))],
    )


def _remainder(node: _Node) -> Scope:
    """``remainder(a, b)``: ``a - floor(a / b) * b`` (Python's sign convention, as torch's)."""
    a, b = _operand(node, 0, 1), _operand(node, 1, 0)
    return binary("-", a, binary("*", floor(binary("/", a, b)), b))


def _cumsum(node: _Node) -> Scope:
    return cumsum(node.tensor(0), node.arg(1))


def _argmax(node: _Node) -> Scope:
    """``argmax(x, dim, keepdim)``: the position of the largest element along ``dim``, of the
    flattened tensor where dim is None (``arg_max``)."""
    constant = lambda values: node.weight("positions", values)  # noqa: E731
    return arg_max(node.tensor(0), node.arg(1), bool(node.arg(2)), constant)


def _attention(node: _Node) -> Scope:
    """``scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)``
    in eval mode, one definition per step: the scores ``q @ k^T * scale`` (with ``enable_gqa``
    each of k's and v's heads serves a group of q's), -inf where a boolean mask is False (a
    float mask added), -inf above the diagonal where causal, the softmax, its rows masked
    everywhere zeroed (torch's safe softmax: ``is_nan``), and the product with v."""
    q, k, v = node.tensor(0), node.tensor(1), node.tensor(2)
    if node.arg(4):
        raise node.error(f"attention with dropout_p={node.arg(4)} is training: call the module's eval()")
    *batch, rows, width = q.shape
    scale = node.fx.kwargs.get("scale")
    scale = 1.0 / math.sqrt(width) if scale is None else float(scale)
    grouped = bool(node.fx.kwargs.get("enable_gqa", False))
    its, e = iterators((*batch, rows, k.shape[-2])), Iterator("e", 0, width)
    lead, row, key = [it.var for it in its[:-2]], its[-2].var, its[-1].var
    score = q[(*lead, row, e.var)] * k[(*_heads(node, k, batch, lead, grouped), key, e.var)] * Num(scale)
    scores = node.build.intermediate(f"{node.name}_scores", Scope(its, (e,), score))
    if node.arg(3) is not None:
        mask = node.tensor(3)
        scores = node.build.intermediate(
            f"{node.name}_masked", where(mask, scores, -math.inf) if _is_bool(node, 3) else add(scores, mask)
        )
    if node.arg(5):
        below = node.weight("causal", np.tril(np.ones((rows, k.shape[-2]), np.float32)))
        scores = node.build.intermediate(f"{node.name}_causal", where(below, scores, -math.inf))
    weights = node.build.intermediate(f"{node.name}_weights", softmax(scores, -1))
    safe = node.build.intermediate(f"{node.name}_safe", where(is_nan(weights, (scores, -1)), 0.0, weights))
    its, s = iterators((*batch, rows, v.shape[-1])), Iterator("s", 0, k.shape[-2])
    lead = [it.var for it in its[:-2]]
    body = safe[(*lead, its[-2].var, s.var)] * v[(*_heads(node, v, batch, lead, grouped), s.var, its[-1].var)]
    return Scope(its, (s,), body)


def _heads(node: _Node, t: Tensor, batch: Sequence[int], lead: Sequence[Index], grouped: bool) -> list[Index]:
    """The reads of key or value ``t``'s leading axes at the query's ``lead``: the same index, 0
    on a size-1 axis, and on the heads' axis with grouped heads ``h / (query heads / t's heads)``."""
    reads, offset = [], len(batch) - (t.rank - 2)
    for axis, size in enumerate(t.shape[:-2]):
        full, index = batch[offset + axis], lead[offset + axis]
        if size == full:
            reads.append(index)
        elif size == 1:
            reads.append(Lit(0))
        elif grouped and axis == t.rank - 3 and full % size == 0:
            reads.append(index // (full // size))
        else:
            raise node.error(f"{t.name}'s leading axes {t.shape[:-2]} do not match the query's {tuple(batch)}")
    return reads


def _gather_elements(node: _Node) -> Opaque:
    """``gather(x, dim, index)``."""
    index = node.const(2)
    chosen = node.tensor(2) if index is None else index
    return gather_elements(node.tensor(0), chosen, node.arg(1), lambda values: node.weight("indices", values))


def _no_op(node: _Node) -> None:
    """``_assert_tensor_metadata``: a check torch's export leaves in; shapes are static here."""
    return None


def _logical_not(node: _Node) -> Scope:
    """``not x``: ``1 - x`` of x as a 0/1 mask (``_truth``)."""
    return elementwise(_truth(node, 0, 0), lambda read: 1.0 - read)


def _logical(op: str):
    """``logical_and``/``or``/``xor``, and ``bitwise_and``/``or``/``xor`` of bool tensors (masks):
    ``logical`` of 0/1 masks, a number or a tensor that is not bool read as ``x != 0`` first."""

    def handle(node: _Node) -> Scope:
        _masks_only(node)
        return logical(op, *(_truth(node, k, 1 - k) for k in (0, 1)))

    return handle


def _truth(node: _Node, index: int, other: int) -> Scope | Tensor | float:
    """Operand ``index`` as a 0/1 mask: a bool tensor as it is, another ``cast`` to bool."""
    value = _operand(node, index, other)
    if isinstance(value, float):
        return float(value != 0)
    return value if _is_bool(node, index) else cast(value, "bool")


def _is_bool(node: _Node, index: int) -> bool:
    """Whether the node's tensor argument ``index`` is a bool tensor (a mask)."""
    return str(node.fx.args[index].meta["val"].dtype) == "torch.bool"


def _bitwise_not(node: _Node) -> Scope:
    """``~x`` of a bool tensor: ``logical_not``."""
    _masks_only(node)
    return _logical_not(node)


def _masks_only(node: _Node) -> None:
    """Bitwise operations on integers have no float form: only bool tensors (masks) pass."""
    given = [str(fx.meta["val"].dtype) for fx in node.fx.args[:2] if hasattr(fx, "meta")]
    if "bitwise" in _op_key(node.fx) and any(dtype != "torch.bool" for dtype in given):
        raise node.error(f"bitwise operations on {', '.join(given)} are supported on bool tensors (masks) only")


def _isnan(node: _Node) -> Scope:
    """``isnan(x)`` (``is_nan``), of a softmax's result the rows that are -inf everywhere."""
    source = node.fx.args[0]
    of_softmax = str(source.target).startswith(("aten._softmax", "aten._safe_softmax"))
    return is_nan(node.tensor(0), (node.build.tensor(source.args[0]), source.args[1]) if of_softmax else None)


def _any(node: _Node) -> Scope:
    """``any(x, dim, keepdim)``: the largest of ``x != 0`` along ``dim`` (a 0/1 mask)."""
    return reduce_max(cast(node.tensor(0), "bool"), node.arg(1), keepdims=bool(node.arg(2)))


def _full_like(node: _Node) -> Tensor:
    """``full_like(x, value)``: a weight of x's shape filled with value (x itself is not read)."""
    return node.build.weight(node.name, np.full(node.shape, float(node.arg(1)), np.float32))


def _layer_norm(node: _Node) -> Scope:
    """``native_layer_norm(x, normalized_shape, weight, bias, eps)``, fissioned into mean,
    centring, variance, 1/sqrt and scale (``layer_norm``); only output 0 (the result) is read."""
    x, normalized = node.tensor(0), node.arg(1)
    weight = node.tensor(2) if node.arg(2) is not None else None
    bias = node.tensor(3) if node.arg(3) is not None else None
    return layer_norm(x, tuple(range(x.rank - len(normalized), x.rank)), float(node.arg(4)), weight, bias)


def _upsample(mode: str):
    """``upsample_nearest2d.vec(x, output_size, scale_factors)`` and
    ``upsample_bilinear2d.vec(x, output_size, align_corners, scale_factors)`` (``resize``):
    torch's nearest reads ``floor(o / scale)``, its bilinear ``(o + 0.5) / scale - 0.5``
    (corners aligned: ``o * (n-1) / (m-1)``), clamped to the input."""

    def handle(node: _Node) -> Scope:
        x = node.tensor(0)
        corners = mode == "linear" and node.arg(2)
        factors = node.arg(2 if mode == "nearest" else 3)
        matrices = {}
        for k, axis in enumerate(range(2, x.rank)):
            size, scale = node.shape[axis], (float(factors[k]) if factors else None)
            coordinates = "align_corners" if corners else ("asymmetric" if mode == "nearest" else "half_pixel")
            matrices[axis] = resize_weights(x.shape[axis], size, mode, coordinates, "floor", scale)
        return resize(x, matrices, lambda matrix: node.weight("interpolation", matrix))

    return handle


def _group_norm(node: _Node) -> Scope:
    """``native_group_norm(x, weight, bias, N, C, HxW, groups, eps)`` (``group_norm``); only
    output 0 (the result) is read."""
    weight = node.tensor(1) if node.arg(1) is not None else None
    bias = node.tensor(2) if node.arg(2) is not None else None
    return group_norm(node.tensor(0), node.arg(6), float(node.arg(7)), weight, bias)


def _gelu(node: _Node) -> Scope:
    return gelu(node.tensor(0), node.arg(1) or "none")


def _softmax(node: _Node) -> Scope:
    return softmax(node.tensor(0), node.arg(1))


def _reduce(builder):
    """``mean.dim`` / ``sum.dim_IntList(x, dims, keepdim)``; empty or no dims reduce everything."""
    return lambda node: builder(node.tensor(0), node.arg(1) or None, keepdims=bool(node.arg(2)))


def _vector_norm(node: _Node) -> Scope:
    """``linalg_vector_norm(x, ord, dim, keepdim)``: the L1 or L2 norm (no dims: of everything)."""
    return reduce_norm(node.tensor(0), node.arg(2) or None, node.arg(1), keepdims=bool(node.arg(3)))


def _copy(node: _Node) -> Tensor | Scope:
    """``copy(x, src)`` (functional ``x.copy_(src)``): ``src`` broadcast to x's shape."""
    x, src = node.tensor(0), node.tensor(1)
    return src if src.shape == x.shape else broadcast_to(src, x.shape)


def _alias(node: _Node) -> Tensor:
    """clone, alias: the value is the input's (dropout in eval mode and ``contiguous`` arrive as clone)."""
    return node.tensor(0)


def _embedding(node: _Node) -> Scope | Opaque:
    """``embedding(weight, indices)``: rows of the weight at the indices (an opaque gather when
    they are known only at run time; ``padding_idx`` matters for training only)."""
    indices = node.const(1)
    chosen = node.tensor(1) if indices is None else indices
    return gather(node.tensor(0), chosen, 0, lambda values: node.weight("indices", values))


def _index(node: _Node) -> Scope | Opaque:
    """``index(x, [None, ..., idx, ...])``, ``x[:, :, idx]``: one index tensor is a gather along
    its axis (a view where constant indices step evenly). Several index tensors (numpy's joint
    advanced indexing, ``x[:, i, j]``) are one gather of a view that merges their axes, at the
    flat positions they name (a constant where all are, else a definition: ``_flat_positions``);
    where those axes are not adjacent the merged one goes first, as numpy places them."""
    chosen = [(axis, fx) for axis, fx in enumerate(node.arg(1)) if fx is not None]
    data = node.tensor(0)
    values = [_numpy(node.build.constants[fx.name]) if fx.name in node.build.constants else None for _, fx in chosen]
    if len(chosen) == 1:
        ((axis, fx),) = chosen
        indices = node.build.tensor(fx) if values[0] is None else values[0]
        return gather(data, indices, axis, lambda found: node.weight("indices", found))
    axes = [axis for axis, _ in chosen]
    sizes = [data.shape[axis] for axis in axes]
    for axis, size, value in zip(axes, sizes, values):
        array = np.asarray(value if value is not None else 0).astype(np.int64)
        outside = (array < -size) | (array >= size)
        if outside.any():
            raise node.error(f"index {int(array[outside].flat[0])} is out of range for axis {axis} (size {size})")
    place = axes[0] if axes == list(range(axes[0], axes[0] + len(axes))) else 0
    merged = node.build.intermediate(f"{node.name}_merged", _merged_axes(data, axes, place))
    if all(v is not None for v in values):
        arrays = [np.asarray(v).astype(np.int64) % size for v, size in zip(np.broadcast_arrays(*values), sizes)]
        flat = np.ravel_multi_index(tuple(arrays), sizes)
        return gather(merged, flat, place, lambda found: node.weight("indices", found))
    indices = [node.build.tensor(fx) if v is None else v for (_, fx), v in zip(chosen, values)]
    constant = lambda found: node.weight("indices", found)  # noqa: E731
    positions = node.build.intermediate(f"{node.name}_positions", _flat_positions(indices, sizes, constant))
    return gather(merged, positions, place, constant)


def _flat_positions(indices: Sequence[Tensor | np.ndarray], sizes: Sequence[int], constant: Callable) -> Scope:
    """Where joint index tensors, some known only at run time (GPT-2's sequence classification:
    ``logits[arange(b), last]``), point in their axes merged row-major: ``sum_k stride_k *
    idx_k``, broadcast, a negative run-time index counted from its axis's end."""
    total, stride = None, 1
    for index, size in reversed(list(zip(indices, sizes))):
        if isinstance(index, Tensor):
            index = add(index, mul(compare("less", index, 0.0), float(size)))
        else:
            index = constant((np.asarray(index).astype(np.int64) % size).astype(np.float32))
        term = index if stride == 1 else mul(index, float(stride))
        total = term if total is None else add(term, total)
        stride *= size
    return total


def _index_select(node: _Node) -> Scope | Opaque:
    """``index_select(x, dim, index)``: a gather along ``dim`` (XGLM's sinusoidal positions
    under torch.compile, where the table and the positions are graph inputs)."""
    indices = node.const(2)
    chosen = node.tensor(2) if indices is None else indices
    return gather(node.tensor(0), chosen, node.arg(1), lambda found: node.weight("indices", found))


def _merged_axes(data: Tensor, axes: Sequence[int], place: int) -> Scope:
    """``data`` with ``axes`` merged into one axis (row-major) at position ``place`` among the
    others: a view whose reads are quasi-affine (``m / stride % size``)."""
    others = [axis for axis in range(data.rank) if axis not in axes]
    order = others[:place] + [None] + others[place:]
    its = iterators([math.prod(data.shape[a] for a in axes) if a is None else data.shape[a] for a in order])
    m = its[place].var
    reads: dict[int, Index] = {axis: its[order.index(axis)].var for axis in others}
    stride = 1
    for position, axis in reversed(list(enumerate(axes))):
        index = m if stride == 1 else m // stride
        reads[axis] = index % data.shape[axis] if position else index
        stride *= data.shape[axis]
    return Scope(its, (), data[tuple(reads[axis] for axis in range(data.rank))])


def _split(node: _Node) -> None:
    """split_with_sizes: nothing of its own; each ``getitem`` of it is a slice."""
    return None


def _getitem(node: _Node) -> Tensor | Scope:
    """``getitem(result, k)``: part k of a split (a slice of its input), or output 0 of batch
    norm or max pooling; their other outputs (indices, statistics) are refused."""
    source, part = node.arg(0), node.arg(1)
    if _op_key(source) == "aten.split_with_sizes.default":  # (torch's split decomposes to it)
        sizes, dim = source.args[1], source.args[2] if len(source.args) > 2 else 0
        start = sum(sizes[:part])
        return _slice(_AsOnnx(node, [source.args[0]], starts=[start], ends=[start + sizes[part]], axes=[dim]))
    if part != 0:
        raise node.error(f"output #{node.arg(1)} of {_op_key(node.arg(0))} is not supported")
    return node.tensor(0)


# --------------------------------------------------------------------------------------------
# Handlers: layout and pooling (onnx_frontend's, through _AsOnnx)


def _view(node: _Node) -> Scope:
    """view, unsqueeze, squeeze: a reshape to the shape torch gives the result."""
    return _reshaped(node, node.tensor(0), node.shape)


def _as_strided(node: _Node) -> Tensor | Scope:
    """``as_strided(x, size, stride, offset)`` of a contiguous x (its elements in row-major
    order, as a program holds them): element ``i`` reads x's flat position ``offset + sum_k
    stride_k * i_k``, split back into x's axes (quasi-affine reads, simplified on the box).
    Decompositions leave it (adaptive pooling of a 1x1 result, in Swin's classifier), most often
    x itself."""
    x, size, stride = node.tensor(0), node.arg(1), node.arg(2)
    offset, given = node.arg(3) or 0, node.fx.args[0].meta.get("val")
    if given is None or not given.is_contiguous() or given.storage_offset():
        raise node.error("as_strided of a tensor that is not contiguous reads torch's storage, which a program lacks")
    its = iterators(size)
    flat = affine_index({it.name: step for it, step in zip(its, stride) if it.size > 1}, offset)
    last = offset + sum((n - 1) * step for n, step in zip(size, stride))
    if min(stride, default=0) < 0:
        raise node.error(f"as_strided with a negative stride {tuple(stride)} is not supported")
    if last >= math.prod(x.shape):
        raise node.error(f"as_strided reads position {last}, past the {math.prod(x.shape)} elements of its input")
    reads, step = [], 1
    for extent in reversed(x.shape):
        reads.insert(0, Lit(0) if extent == 1 else simplify((flat // step) % extent, its))
        step *= extent
    if tuple(size) == x.shape and all(ix == it.var for ix, it in zip(reads, its) if it.size > 1):
        return x
    return Scope(its, (), x[tuple(reads)])


def _expand(node: _Node) -> Scope:
    """Broadcast to the result's shape: a size-1 axis that grows is read at 0."""
    return broadcast_to(node.tensor(0), node.shape)


def _select(node: _Node) -> Scope:
    """``x.select(dim, index)``: the axis is read at a constant and dropped."""
    x, dim, index = node.tensor(0), node.arg(1) % node.tensor(0).rank, node.arg(2)
    index %= x.shape[dim]
    its = iterators(node.shape)
    reads = [it.var for it in its]
    reads.insert(dim, Lit(index))
    return Scope(its, (), x[tuple(reads)])


def _permute(node: _Node) -> Scope:
    return _transpose(_AsOnnx(node, [node.arg(0)], perm=[d % node.tensor(0).rank for d in node.arg(1)]))


def _cat(node: _Node) -> Scope:
    """cat; an empty part (the empty key-value cache of a first decoder step) adds nothing."""
    parts = [fx for fx in node.arg(0) if math.prod(fx.meta["val"].shape) > 0]
    return _concat(_AsOnnx(node, parts, axis=node.arg(1)))


def _slice_tensor(node: _Node) -> Scope:
    """``slice.Tensor(x, dim, start, end, step)``; None bounds are the whole axis."""
    start, end = node.arg(2), node.arg(3)
    return _slice(
        _AsOnnx(
            node,
            [node.arg(0)],
            starts=[start or 0],
            ends=[_INT64_MAX if end is None else end],
            axes=[node.arg(1)],
            steps=[node.arg(4)],
        )
    )


_INT64_MAX = 2**63 - 1


def _slice_scatter(node: _Node) -> Scope:
    """``slice_scatter(x, src, dim, start, end, step)``, what ``x[..., a:b:c] = src`` exports to:
    ``src`` at the sliced positions, ``x`` elsewhere, chosen exactly by ``select`` over a mask
    that is 1 at those positions (bounds masks read at ``(i - a) / c`` and ``(i - a) % c``)."""
    x, src = node.tensor(0), node.tensor(1)
    dim = node.arg(2) % x.rank
    positions = range(x.shape[dim])[slice(node.arg(3), node.arg(4), node.arg(5))]
    if len(positions) != src.shape[dim]:
        raise node.error(f"the slice has {len(positions)} positions along axis {dim}, src {src.shape[dim]}")
    its = iterators(x.shape)
    offset = its[dim].var - positions.start
    along = offset // positions.step if positions.step > 1 else offset
    hit = _ones((len(positions),))[along]
    if positions.step > 1:
        hit = hit * _ones((1,))[offset % positions.step]
    reads = [it.var for it in its]
    chosen = src[tuple(reads[:dim] + [along] + reads[dim + 1 :])]
    body = Binary("select", hit, chosen) + Binary("select", Num(1.0) - hit, x[tuple(reads)])
    return Scope(its, (), body)


def _constant_pad(node: _Node) -> Scope:
    """``constant_pad_nd(x, pad, value)``: torch pads (begin, end) pairs from the last axis back,
    ONNX gives all begins then all ends from the first axis."""
    rank, pad = node.tensor(0).rank, list(node.arg(1))
    begin, end = [0] * rank, [0] * rank
    for k in range(len(pad) // 2):
        begin[rank - 1 - k], end[rank - 1 - k] = pad[2 * k], pad[2 * k + 1]
    return _pad(_AsOnnx(node, [node.arg(0)], mode="constant", pads=begin + end, value=float(node.arg(2))))


def _two(value) -> list[int]:
    """A 2-D window argument as two ints: torch accepts an int or a one-element list."""
    values = [value] if isinstance(value, int) else list(value)
    return values * 2 if len(values) == 1 else values


def _window(node: _Node, kernel, stride, padding, dilation=1, ceil_mode=False, **extra) -> _AsOnnx:
    kernel = _two(kernel)
    (ph, pw) = _two(padding)
    return _AsOnnx(
        node,
        [node.arg(0)],
        kernel_shape=kernel,
        strides=_two(stride) if stride else kernel,
        pads=[ph, pw, ph, pw],
        dilations=_two(dilation),
        ceil_mode=int(bool(ceil_mode)),
        **extra,
    )


def _max_pool(node: _Node) -> Scope:
    """``max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)``; output 0."""
    return _pool("max")(_window(node, *(node.arg(k) for k in range(1, 6))))


def _avg_pool(node: _Node) -> Scope:
    """``avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)``."""
    if node.arg(6) is not None:
        raise node.error(f"divisor_override={node.arg(6)} is not supported")
    kernel, stride, padding, ceil_mode, include = (node.arg(k) for k in range(1, 6))
    return _pool("average")(_window(node, kernel, stride, padding, 1, ceil_mode, count_include_pad=int(include)))


def _adaptive_avg_pool(node: _Node) -> Scope:
    """Adaptive average pooling where the output size divides the input size: plain average
    pooling with kernel = stride = input/output (to 1x1 arrives as ``mean.dim`` instead)."""
    x, out = node.tensor(0), _two(node.arg(1))
    if x.rank != 4 or any(n % o for n, o in zip(x.shape[2:], out)):
        raise node.error(f"output size {tuple(out)} must divide the input's spatial size {x.shape[2:]}")
    kernel = [n // o for n, o in zip(x.shape[2:], out)]
    return _pool("average")(_window(node, kernel, kernel, 0))


# op overload -> handler: a Scope is a new definition, a Tensor an alias of an existing value.
SUPPORTED_OPS: dict[str, Callable[[_Node], Scope | Opaque | Tensor | None]] = {
    "aten.convolution.default": _convolution,
    _BATCH_NORM: _batch_norm,
    "aten._native_batch_norm_legit.no_stats": _batch_statistics_norm,
    "aten.addmm.default": _addmm,
    "aten.mm.default": lambda node: matmul(node.tensor(0), node.tensor(1)),
    "aten.bmm.default": lambda node: batch_matmul(node.tensor(0), node.tensor(1)),
    "aten.scaled_dot_product_attention.default": _attention,
    "aten.add.Tensor": _binary("+"),
    "aten.sub.Tensor": _binary("-"),
    "aten.mul.Tensor": _binary("*"),
    "aten.div.Tensor": _binary("/"),
    "aten.relu.default": _unary(relu),
    "aten.sigmoid.default": _unary(sigmoid),
    "aten.tanh.default": _unary(tanh),
    "aten.sin.default": _unary(sin),
    "aten.cos.default": _unary(cos),
    "aten.exp.default": _unary(exp),
    "aten.sqrt.default": _unary(sqrt),
    "aten.neg.default": lambda node: unary("neg", node.tensor(0)),
    "aten.reciprocal.default": _reciprocal,
    "aten.erf.default": _unary(erf),
    "aten.log.default": _unary(log),
    "aten.abs.default": _unary(absolute),
    "aten.floor.default": _unary(floor),
    "aten.ceil.default": _unary(ceil),
    "aten.rsqrt.default": _unary(rsqrt),
    "aten.pow.Tensor_Scalar": _binary("pow"),
    "aten.pow.Tensor_Tensor": _binary("pow"),
    "aten.minimum.default": _binary("min"),
    "aten.maximum.default": _binary("max"),
    **{f"aten.{name}.{kind}": _compare(op) for name, op in _COMPARISONS.items() for kind in ("Scalar", "Tensor")},
    "aten.where.self": _where,
    "aten.mul.Scalar": _binary("*"),
    "aten.logical_not.default": _logical_not,
    **{
        f"aten.{kind}_{op}.{overload}": _logical(op)
        for kind, overload in (("logical", "default"), ("bitwise", "Tensor"))
        for op in ("and", "or", "xor")
    },
    "aten.bitwise_not.default": _bitwise_not,
    "aten.isnan.default": _isnan,
    "aten.ne.Scalar": _not_equal,
    "aten.ne.Tensor": _not_equal,
    "aten._to_copy.default": _to_copy,
    "aten._assert_tensor_metadata.default": _no_op,
    "aten.cumsum.default": _cumsum,
    "aten.argmax.default": _argmax,
    "aten.flip.default": _flip,
    "aten.remainder.Scalar": _remainder,
    "aten.remainder.Tensor": _remainder,
    "aten.gather.default": _gather_elements,
    "aten.any.dim": _any,
    "aten.clamp.default": _clamp,
    "aten.full_like.default": _full_like,
    "aten.gelu.default": _gelu,
    "aten.native_layer_norm.default": _layer_norm,
    "aten.native_group_norm.default": _group_norm,
    "aten.upsample_nearest2d.vec": _upsample("nearest"),
    "aten.upsample_bilinear2d.vec": _upsample("linear"),
    "aten.leaky_relu.default": _leaky_relu,
    "aten.hardtanh.default": _hardtanh,
    "aten._softmax.default": _softmax,
    "aten.mean.dim": _reduce(reduce_mean),
    "aten.sum.dim_IntList": _reduce(reduce_sum),
    "aten.linalg_vector_norm.default": _vector_norm,
    "aten.view.default": _view,
    "aten.unsqueeze.default": _view,
    "aten.squeeze.dims": _view,
    "aten.expand.default": _expand,
    "aten.as_strided.default": _as_strided,
    "aten.permute.default": _permute,
    "aten.select.int": _select,
    "aten.slice.Tensor": _slice_tensor,
    "aten.slice_scatter.default": _slice_scatter,
    "aten.copy.default": _copy,
    "aten.cat.default": _cat,
    "aten.constant_pad_nd.default": _constant_pad,
    "aten.max_pool2d_with_indices.default": _max_pool,
    "aten.avg_pool2d.default": _avg_pool,
    "aten._adaptive_avg_pool2d.default": _adaptive_avg_pool,
    "aten.clone.default": _alias,
    "aten.alias.default": _alias,
    "getitem": _getitem,
    "aten.embedding.default": _embedding,
    "aten.index.Tensor": _index,
    "aten.index_select.default": _index_select,
    "aten.split_with_sizes.default": _split,
}


# --------------------------------------------------------------------------------------------
# The torch.compile backend


def rewriter_backend(gm, example_inputs, options: dict | None = None):
    """``torch.compile`` backend: the FX graph dynamo gives, translated like ``from_torch``, run
    as a program. A graph it cannot translate (an unsupported operator, dynamic shapes, anything)
    or optimize (a fault of ours) runs as it came, with a warning that says why: compiling must
    never break a model.
    ``torch.compile(..., options={"max_depth": 1, "subprogram_time_limit": 5})`` sets the search
    budget, ``"orchestration": "greedy"`` the orchestration (``BACKEND_OPTIONS`` are the
    defaults)."""
    budget = _backend_budget(options)
    try:
        _check_static(gm)
        exported = _export(gm, example_inputs)
        model = _translate(exported)
    except Exception as err:  # the original graph is always a correct answer
        warnings.warn(f"rewriter backend runs the original graph: {err}", stacklevel=2)
        return gm.forward
    try:
        return _compiled(model, exported, budget)
    except Exception as err:  # a fault of the optimizer's must not break the model either
        warnings.warn(f"rewriter backend runs the original graph: optimizing it failed: {err!r}", stacklevel=2)
        return gm.forward


def _backend_budget(options: dict | None) -> dict:
    """The search budget: ``BACKEND_OPTIONS`` with the user's options over them; a misspelt
    option is an error, not a silently default search."""
    unknown = sorted(set(options or ()) - set(BACKEND_OPTIONS))
    if unknown:
        raise TypeError(
            f"torch.compile options {unknown} are not the rewriter backend's; it takes {sorted(BACKEND_OPTIONS)}"
        )
    return {**BACKEND_OPTIONS, **(options or {})}


def _check_static(gm) -> None:
    """Dynamo hands over symbolic sizes once it has seen a shape change; a program has one shape."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value")
            if not hasattr(value, "shape"):
                raise TorchImportError(
                    f"graph input {node.name!r} is {value!r}, not a tensor: dynamic shapes are not supported "
                    "(torch.compile(..., dynamic=False) avoids them)"
                )
            _static_shape(value, f"graph input {node.name!r}")


def _compiled(model: Model, exported, budget: dict) -> Callable:
    """A callable with the graph's signature that runs the program and returns torch tensors in
    the graph's output structure, dtypes and device."""
    torch = _import_torch()
    results = exported.graph.output_node().args[0]
    dtypes = [fx.meta["val"].dtype for fx in results]
    out_spec = exported.call_spec.out_spec
    optimized = optimize_program(model.program, model.weights, **budget)

    def run(*args):
        outputs = _run_program(optimized, model, [_numpy(a) for a in args])
        device = args[0].device if args else "cpu"
        tensors = [
            torch.from_numpy(np.ascontiguousarray(o)).to(device=device, dtype=d) for o, d in zip(outputs, dtypes)
        ]
        return torch.utils._pytree.tree_unflatten(tensors, out_spec)

    return run


# How hard the torch.compile backend searches each subprogram of a graph, and how it orchestrates
# the kernels ("blp", "greedy" or "none": ``optimize_program``), unless its options say.
BACKEND_OPTIONS = {"max_depth": 2, "subprogram_time_limit": 10.0, "orchestration": "blp"}


def _run_program(optimized, model: Model, inputs: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Run the optimized program on the user inputs in call order."""
    values = model.feeds(dict(zip(model.inputs, inputs)))
    outputs = optimized(**{name: value for name, value in values.items() if name in optimized.inputs})
    return outputs if isinstance(outputs, tuple) else (outputs,)


def register() -> None:
    """Register the backend as ``torch.compile(backend="rewriter")``; a no-op when it already is
    (by an earlier call or by the package's ``torch_dynamo_backends`` entry point)."""
    torch = _import_torch()
    if BACKEND_NAME not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(rewriter_backend, name=BACKEND_NAME)
