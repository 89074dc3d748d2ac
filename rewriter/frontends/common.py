"""What the front-ends share: the imported ``Model``, identifiers for foreign tensor names,
batch-norm folding, and small IR helpers for element-wise definitions.

Batch normalization in inference mode is ``x*scale + shift`` per channel; where a convolution is
its only producer and every parameter is known at build time, it folds into the convolution's
weight (scaled along the output-channel axis) and bias (OLLIE 5.4: compile-time evaluation).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from rewriter.ir import (
    BINARY_FUNCTIONS,
    KEYWORDS,
    UNARY_FUNCTIONS,
    Binary,
    ExpressionError,
    Iterator,
    Lit,
    Num,
    Opaque,
    Program,
    Scope,
    Tensor,
    Var,
)
from rewriter.ir.builders import (
    FLOAT32_MAX,
    absolute,
    ceil,
    compare,
    floor,
    maximum,
    mul,
    reduce_max,
    sub,
    where,
)
from rewriter.semantics import evaluate


class FrontendError(ExpressionError):
    """A model a front-end cannot translate; the message names the file, node or tensor."""


@dataclass(frozen=True, eq=False)
class Model:
    """An imported model.

    ``program`` reads the graph inputs and the weights as named tensors; ``weights`` maps program
    tensor names to values (only the constants the program reads, batch norms folded in);
    ``inputs`` maps the model's input names to their static shapes; ``outputs`` are the model's
    output names, in order (``program.outputs`` are their program names); ``names`` maps every
    model value name the program uses to its program tensor name (those names need not be
    identifiers); ``integers`` names the inputs of integer or boolean type (token ids, masks),
    float data in the program.
    """

    program: Program
    weights: dict[str, np.ndarray]
    inputs: dict[str, tuple[int, ...]]
    outputs: tuple[str, ...]
    names: dict[str, str]
    proto: object = field(default=None, repr=False)  # the onnx.ModelProto it was imported from, if any
    integers: frozenset[str] = frozenset()

    def feeds(self, inputs: Mapping[str, object]) -> dict[str, object]:
        """The program's input tensors for ``evaluate``: ``inputs`` (by model name) and the weights.
        Every model input is asked for; one the program has no tensor for (an empty one, with a
        size-0 axis) is left out."""
        missing = sorted(set(self.inputs) - set(inputs))
        if missing:
            raise FrontendError(f"missing model input(s): {', '.join(missing)}")
        return {**self.weights, **{self.names[name]: inputs[name] for name in self.inputs if name in self.names}}

    def run(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Evaluate the program (reference semantics) on inputs by model name; outputs by model name."""
        values = evaluate(self.program, self.feeds(inputs))
        values = values if isinstance(values, tuple) else (values,)
        return dict(zip(self.outputs, values))

    def original(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        """The original model's outputs by name: onnxruntime's for an ONNX model where it is
        installed (the ONNX semantics, and fast at full size, where the reference semantics of a
        naive ConvTranspose is slow), else ``run``'s."""
        try:
            import onnxruntime  # optional: the reference semantics stand in without it
        except ImportError:
            return self.run(inputs)
        if self.proto is None:
            return self.run(inputs)
        session = onnxruntime.InferenceSession(self.proto.SerializeToString(), providers=["CPUExecutionProvider"])
        types = {arg.name: _ORT_TYPES.get(arg.type, np.float32) for arg in session.get_inputs()}
        feeds = {name: np.asarray(inputs[name], dtype=types.get(name, np.float32)) for name in self.inputs}
        return dict(zip(self.outputs, session.run(list(self.outputs), feeds)))


# onnxruntime's input types -> numpy's (the program reads every input as float data)
_ORT_TYPES = {f"tensor({t})": np.dtype(t) for t in ("float16", "double", "int8", "int16", "int32", "int64", "uint8")}
_ORT_TYPES |= {"tensor(float)": np.dtype(np.float32), "tensor(bool)": np.dtype(bool)}


# --------------------------------------------------------------------------------------------
# Names


RESERVED = KEYWORDS | set(UNARY_FUNCTIONS) | set(BINARY_FUNCTIONS)


def fresh(name: str, taken) -> str:
    """``name``, or ``name_2``, ``name_3``, ... whichever is not in ``taken``."""
    candidate, k = name, 1
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    return candidate


class Names:
    """Foreign value names -> distinct identifiers of the notation (ONNX allows any string)."""

    def __init__(self):
        self.ids: dict[str, str] = {}
        self.taken: set[str] = set()

    def __call__(self, foreign: str) -> str:
        if foreign not in self.ids:
            self.ids[foreign] = self.fresh(foreign)
        return self.ids[foreign]

    def fresh(self, text: str) -> str:
        base = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9_]", "_", text)).strip("_") or "t"
        if base[0].isdigit():
            base = f"t{base}"
        if base in RESERVED:
            base = f"{base}_"
        name = fresh(base, self.taken)
        self.taken.add(name)
        return name


# --------------------------------------------------------------------------------------------
# Batch normalization


def batch_norm_affine(gamma, beta, mean, var, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """(scale, shift) per channel of inference-mode batch normalization: y = x*scale + shift."""
    scale = np.asarray(gamma, np.float64) / np.sqrt(np.asarray(var, np.float64) + epsilon)
    return scale, np.asarray(beta, np.float64) - np.asarray(mean, np.float64) * scale


def fold_batch_norm(weight: np.ndarray, bias, scale, shift, channel_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """The convolution weight and bias that compute ``conv(x)*scale + shift`` (``bias`` may be
    0; ``channel_axis`` is the weight's output-channel axis: 0 for a convolution, 1 for a
    transposed one), in the weight's dtype."""
    shape = [1] * weight.ndim
    shape[channel_axis] = -1
    folded = weight * scale.reshape(shape)
    return folded.astype(weight.dtype), (np.asarray(bias, np.float64) * scale + shift).astype(weight.dtype)


# --------------------------------------------------------------------------------------------
# Small IR helpers


def iterators(shape: Sequence[int], prefix: str = "i") -> tuple[Iterator, ...]:
    """``i0:d0, i1:d1, ...`` over a shape."""
    return tuple(Iterator(f"{prefix}{k}", 0, size) for k, size in enumerate(shape))


def elementwise(source: Tensor | Scope, fn: Callable) -> Scope:
    """``L i0, i1, ... ; fn(source[i0, i1, ...])``."""
    its = iterators(source.shape)
    return Scope(its, (), fn(source[tuple(it.var for it in its)]))


def broadcast_to(source: Tensor, shape: Sequence[int]) -> Scope:
    """``source`` broadcast to ``shape`` as numpy does: axes line up at the end, and a size-1
    axis that grows is read at 0."""
    lead = len(shape) - source.rank
    if lead < 0 or any(size not in (1, shape[lead + k]) for k, size in enumerate(source.shape)):
        raise ExpressionError(f"{source.name} of shape {source.shape} does not broadcast to {tuple(shape)}")
    reads = tuple(
        Lit(0) if size == 1 and shape[lead + k] != 1 else Var(f"i{lead + k}") for k, size in enumerate(source.shape)
    )
    return Scope(iterators(shape), (), source[reads])


def with_extent(scope: Scope, shape: Sequence[int]) -> Scope:
    """The scope over a different output extent: reads outside the inputs are 0, so this is how
    asymmetric padding and output_padding extend (or crop) a builder's symmetric result."""
    return scope.with_traversal(Iterator(it.name, 0, size) for it, size in zip(scope.traversal, shape))


def gather_elements(
    data: Tensor, indices: Tensor | np.ndarray, axis: int, constant: Callable[[np.ndarray], Tensor]
) -> Opaque:
    """ONNX GatherElements, torch's gather: an opaque gather_elements (constant indices made a
    weight by ``constant``)."""
    if not isinstance(indices, Tensor):
        indices = constant(np.asarray(indices).astype(np.float32))
    return Opaque("gather_elements", (data, indices), (("axis", axis % data.rank),))


def arg_max(
    x: Tensor, axis: int | None, keepdims: bool, constant: Callable[[np.ndarray], Tensor], last: bool = False
) -> Scope:
    """ONNX ArgMax, torch's argmax (``axis`` None: of the flattened tensor): the position of the
    largest element along ``axis``, the first one where several are (the last with ``last``),
    as float data. The scopes' language has no positions as values, so a weight made by
    ``constant`` holds them, counted from the end for the first occurrence (``P[k] = n-1-k``),
    and the largest of those where ``x`` equals its maximum is taken::

        n-1 - max_k select(x[.., k, ..] == max(x)[.., 0, ..], P[k]) + select(1 - (..), -1)
    """
    axes = tuple(range(x.rank)) if axis is None else (axis % x.rank,)
    extents = [x.shape[a] if a in axes else 1 for a in range(x.rank)]
    count = math.prod(extents)
    flat = np.arange(count, dtype=np.float32).reshape(extents)
    positions = constant(flat if last else count - 1 - flat)
    peak = reduce_max(x, axes, keepdims=True)
    found = reduce_max(where(compare("equal", x, peak), positions, -1.0), axes, keepdims)
    return found if last else sub(float(count - 1), found)


LOGICAL = {"and": mul, "or": maximum, "xor": lambda a, b: absolute(sub(a, b))}


def logical(op: str, a: Tensor | float, b: Tensor | float) -> Scope:
    """``a and b``, ``a or b``, ``a xor b`` of masks (0/1 data), with broadcasting: ``a*b``,
    ``max(a, b)``, ``|a - b|``."""
    return LOGICAL[op](a, b)


def is_nan(x: Tensor, softmax_of: tuple[Tensor, int] | None = None) -> Scope:
    """ONNX IsNaN, torch's isnan: 1 where ``x`` is NaN. A NaN fails every comparison, so it is
    ``1 - (x <= max) - (x > max)`` (not ``x != x``, which a compiler's simplifier folds to 0).

    A program's arithmetic is finite (a -inf constant is -3.4e38, ``where``), so the NaN IEEE
    arithmetic makes of a softmax over a row that is -inf everywhere (a fully masked attention
    row) is not made; the export of attention with a boolean mask guards exactly that
    (``Where(IsNaN(Softmax(s)), 0, ..)``). Where ``x`` is a softmax of ``source`` along an axis
    (``softmax_of``), the row is NaN where the source's maximum along it is at or below
    -FLOAT32_MAX / 2: every element masked."""
    if softmax_of is None:
        return elementwise(
            x, lambda r: 1.0 - Binary("less_equal", r, Num(FLOAT32_MAX)) - Binary("greater", r, Num(FLOAT32_MAX))
        )
    source, axis = softmax_of[0], softmax_of[1] % x.rank
    peak = reduce_max(source, axis, keepdims=True)
    its = iterators(x.shape)
    row = tuple(Lit(0) if k == axis else it.var for k, it in enumerate(its))
    return Scope(its, (), Binary("less_equal", peak[row], Num(-FLOAT32_MAX / 2)))


def cast(source: Tensor, kind: str) -> Scope:
    """A cast of float data: to "bool" ``x != 0`` (a 0/1 mask), to "integer" truncation toward
    0 (where a float value loses its fraction)."""
    if kind == "bool":
        return elementwise(source, lambda read: 1.0 - Binary("equal", read, Num(0.0)))
    if kind == "integer":
        return where(compare("greater_equal", source, 0.0), floor(source), ceil(source))
    raise ExpressionError(f"cast to {kind!r}: only bool and integer casts change float data")


def gather(
    data: Tensor, indices: Tensor | np.ndarray, axis: int, constant: Callable[[np.ndarray], Tensor]
) -> Scope | Opaque:
    """ONNX Gather, torch's embedding and index_select: ``data`` at ``indices`` along ``axis``.
    Constant indices that step evenly (one index, a range, every other row) are a view, which
    the optimizer sees through; other constant indices (made a weight by ``constant``) and
    indices known only at run time are an opaque gather."""
    if not -data.rank <= axis < data.rank:
        raise ExpressionError(f"gather: axis {axis} is out of range for {data.name} of rank {data.rank}")
    axis %= data.rank
    if isinstance(indices, Tensor):
        return Opaque("gather", (data, indices), (("axis", axis),))
    size, values = data.shape[axis], np.asarray(indices).astype(np.int64)
    outside = (values < -size) | (values >= size)
    if outside.any():
        raise ExpressionError(
            f"gather: index {int(values[outside].flat[0])} is out of range for axis {axis} of {data.name} (size {size})"
        )
    flat = (values % size).ravel()
    step = int(flat[1] - flat[0]) if flat.size > 1 else 0
    if values.ndim > 1 or not np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
        return Opaque("gather", (data, constant((values % size).astype(np.float32))), (("axis", axis),))
    shape = data.shape[:axis] + values.shape + data.shape[axis + 1 :]
    its = iterators(shape)
    position = Var(f"i{axis}") * step + int(flat[0]) if values.ndim and step else Lit(int(flat[0]))
    after = range(axis + values.ndim, len(shape))
    reads = tuple(Var(f"i{k}") for k in range(axis)) + (position,) + tuple(Var(f"i{k}") for k in after)
    return Scope(its, (), data[reads])


# ONNX Resize's coordinate transformations: output coordinate o -> input coordinate, given the
# scale (output size / input size, or as the model states it) and the two sizes
_COORDINATES = {
    "half_pixel": lambda o, scale, n, m: (o + 0.5) / scale - 0.5,
    "pytorch_half_pixel": lambda o, scale, n, m: (o + 0.5) / scale - 0.5 if m > 1 else 0 * o,
    "align_corners": lambda o, scale, n, m: o * (n - 1) / (m - 1) if m > 1 else 0 * o,
    "asymmetric": lambda o, scale, n, m: o / scale,
}
_ROUNDING = {
    "floor": np.floor,
    "ceil": np.ceil,
    "round_prefer_floor": lambda v: np.ceil(v - 0.5),
    "round_prefer_ceil": lambda v: np.floor(v + 0.5),
}


def resize_weights(
    size_in: int, size_out: int, mode: str, coordinates: str, nearest: str = "floor", scale: float | None = None
) -> np.ndarray:
    """The (size_out, size_in) matrix of a 1-D resize (ONNX Resize, torch's upsampling): row o
    weighs the inputs output o reads. ``mode`` "nearest" reads one input (rounded by
    ``nearest``), "linear" two neighbours; coordinates outside the input clamp to its ends."""
    if coordinates not in _COORDINATES:
        raise ExpressionError(
            f"coordinate transformation {coordinates!r} is not supported; supported: {', '.join(_COORDINATES)}"
        )
    if mode not in ("nearest", "linear") or (mode == "nearest" and nearest not in _ROUNDING):
        raise ExpressionError(f"resize mode {mode!r} (nearest mode {nearest!r}) is not supported")
    position = _COORDINATES[coordinates](
        np.arange(size_out, dtype=np.float64), scale or size_out / size_in, size_in, size_out
    )
    rows, matrix = np.arange(size_out), np.zeros((size_out, size_in))
    if mode == "nearest":
        matrix[rows, np.clip(_ROUNDING[nearest](position), 0, size_in - 1).astype(np.int64)] = 1.0
        return matrix
    position = np.clip(position, 0, size_in - 1)
    low = np.floor(position).astype(np.int64)
    np.add.at(matrix, (rows, low), 1 - (position - low))
    np.add.at(matrix, (rows, np.minimum(low + 1, size_in - 1)), position - low)
    return matrix


def _floor_form(matrix: np.ndarray) -> tuple[int, int, int] | None:
    """(a, b, d) where the matrix reads input ``(a*o + b) / d`` (floor division) at output o
    alone, with a/d the size ratio: nearest resizing at a rational scale is a view."""
    if np.any(np.count_nonzero(matrix, axis=1) != 1) or matrix.max() != 1:  # one 1 per row
        return None
    read = matrix.argmax(axis=1)
    size_out, size_in = matrix.shape
    common = math.gcd(size_in, size_out)
    a, d = size_in // common, size_out // common
    offsets = np.arange(d)[:, None]
    fits = np.all((a * np.arange(size_out)[None, :] + offsets) // d == read[None, :], axis=1)
    return (a, int(np.argmax(fits)), d) if fits.any() else None


def resize(x: Tensor, matrices: Mapping[int, np.ndarray], constant: Callable[[np.ndarray], Tensor]) -> Scope:
    """``x`` resized along each axis of ``matrices`` (axis -> ``resize_weights``). An axis read
    at ``(a*o + b) / d`` (nearest at a rational scale) is a view; another is a product with its
    interpolation matrix (a weight made by ``constant``), one nested scope per axis, the last
    axis innermost, so each is one matrix product (separable, as bilinear interpolation is)."""
    reads: list = [Var(f"i{k}") for k in range(x.rank)]
    shape, weighted = list(x.shape), []
    for axis, matrix in sorted(matrices.items()):
        form = _floor_form(matrix)
        if form is None:
            weighted.append((axis, constant(matrix.astype(np.float32))))
            continue
        shape[axis] = matrix.shape[0]
        a, b, d = form
        scaled = Var(f"i{axis}") * a + b if (a, b) != (1, 0) else Var(f"i{axis}")
        reads[axis] = scaled // Lit(d) if d > 1 else scaled
    current = None
    for axis, weight in reversed(weighted):
        index = list(reads) if current is None else [Var(f"i{k}") for k in range(x.rank)]
        index[axis] = Var("r")
        source = x if current is None else current
        body = weight[Var(f"i{axis}"), Var("r")] * source[tuple(index)]
        shape[axis] = weight.shape[0]
        current = Scope(iterators(shape), (Iterator("r", 0, weight.shape[1]),), body)
    return current if current is not None else Scope(iterators(shape), (), x[tuple(reads)])
