"""Reference semantics: ``evaluate(expr, inputs)`` in vectorised numpy.

This is the ground truth every rule, candidate and compiled program is checked against, so it is
written for obviousness first and speed second:

* each iterator of a scope is an integer ``arange`` along its own axis of an N-d broadcast space;
* an index is evaluated on those arrays (numpy's ``//`` and ``%`` are floor division, as in the
  notation); an access gathers, reading 0 where any index falls outside the tensor;
* a sum of products is contracted with ``np.einsum`` so the full iteration space is never built;
  anything else is built and reduced;
* a scope whose intermediates would be large is evaluated in chunks of its traversal space.

Nested scopes are evaluated once per call (they are closed terms, so equal scopes share a value).
An opaque operation (``rewriter.ir.Opaque``) is computed by its numpy function in ``OPAQUE``
(``run_opaque``), which also runs it in compiled programs.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from rewriter.index import affine_coefficients, index_bounds
from rewriter.ir import (
    Access,
    Binary,
    ExpressionError,
    Iterator,
    Num,
    Opaque,
    Program,
    Scalar,
    Scope,
    Tensor,
    Unary,
    accesses,
    children,
    eval_index,
    index_vars,
    tensor_shapes,
)

from .opaque import bound_constants, run_opaque

# Largest intermediate (in elements) built at once before the traversal space is chunked.
CHUNK_ELEMENTS = 1 << 24

_ERF = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; math's is exact to double
_UNARY = {
    "neg": np.negative,
    "relu": lambda x: np.maximum(x, 0),
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sin": np.sin,
    "cos": np.cos,
    "sigmoid": lambda x: 0.5 * (1.0 + np.tanh(0.5 * x)),
    "erf": lambda x: _ERF(x).astype(np.result_type(x, np.float32)),
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "abs": np.abs,
    "floor": np.floor,
    "ceil": np.ceil,
}
_MASK = {
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
}
_BINARY = {
    "+": np.add,
    "-": np.subtract,
    "*": np.multiply,
    "/": np.divide,
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
    **{name: (lambda compare: lambda a, b: compare(a, b).astype(np.result_type(a, b)))(f) for name, f in _MASK.items()},
    "select": lambda c, x: np.where(c != 0, x, np.result_type(c, x).type(0)),
}


def evaluate(expr: Scope | Opaque | Program, inputs: Mapping[str, object], dtype=np.float64):
    """Evaluate a scope (an opaque operation, a program) on named input arrays; returns a numpy
    array. A program returns its single output, or a tuple when it has several.
    """
    if isinstance(expr, Program):
        values = _check_inputs(expr.inputs, inputs, dtype)
        evaluator = _Evaluator(values, dtype)
        for name, definition in expr.definitions:
            is_scope = isinstance(definition, Scope)
            values[name] = evaluator.scope(definition) if is_scope else run_opaque(definition, values)
        outs = tuple(values[name] for name in expr.outputs)
        return outs[0] if len(outs) == 1 else outs
    if not isinstance(expr, (Scope, Opaque)):
        raise ExpressionError(f"evaluate() takes a Scope, an Opaque or a Program, got {type(expr).__name__}")
    values = _check_inputs(tensor_shapes(expr), inputs, dtype)
    return _Evaluator(values, dtype).scope(expr) if isinstance(expr, Scope) else run_opaque(expr, values)


def _check_inputs(shapes: dict, inputs: Mapping[str, object], dtype) -> dict[str, np.ndarray]:
    inputs = {**bound_constants(set(shapes) - set(inputs)), **inputs}
    missing = sorted(set(shapes) - set(inputs))
    if missing:
        raise ExpressionError(f"missing input tensor(s): {', '.join(missing)}")
    values = {}
    for name, shape in shapes.items():
        array = np.asarray(inputs[name], dtype=dtype)
        if array.shape != tuple(shape):
            raise ExpressionError(f"input {name} has shape {array.shape}, the expression expects {tuple(shape)}")
        values[name] = array
    return values


class _Evaluator:
    def __init__(self, values: dict[str, np.ndarray], dtype):
        self.values = values
        self.dtype = dtype
        self.scopes: dict[Scope, np.ndarray] = {}
        self.padded: dict[tuple, np.ndarray] = {}  # (id of array, pads) -> zero-padded copy

    def scope(self, scope: Scope) -> np.ndarray:
        if scope not in self.scopes:
            with np.errstate(all="ignore"):
                self.scopes[scope] = self.box(scope, scope.traversal)
        return self.scopes[scope]

    # -- chunking of the traversal space
    def box(self, scope: Scope, traversal: tuple[Iterator, ...]) -> np.ndarray:
        sizes = {it.name: it.size for it in traversal + scope.summation}
        if _footprint(scope, sizes) <= CHUNK_ELEMENTS or all(it.size == 1 for it in traversal):
            return self.dense(scope, traversal)
        used = set().union(*(index_vars(ix) for a in accesses(scope.body) for ix in a.indices))
        splittable = [k for k in range(len(traversal)) if traversal[k].size > 1]
        axis = max(splittable, key=lambda k: (traversal[k].name in used, traversal[k].size))
        it = traversal[axis]
        middle = it.lo + it.size // 2
        halves = [Iterator(it.name, it.lo, middle), Iterator(it.name, middle, it.hi)]
        parts = [self.box(scope, traversal[:axis] + (half,) + traversal[axis + 1 :]) for half in halves]
        return np.concatenate(parts, axis=axis)

    def dense(self, scope: Scope, traversal: tuple[Iterator, ...]) -> np.ndarray:
        iterators = traversal + scope.summation
        rank = len(iterators)
        env = {}
        for axis, it in enumerate(iterators):
            shape = [1] * rank
            shape[axis] = it.size
            env[it.name] = np.arange(it.lo, it.hi, dtype=np.int64).reshape(shape)
        sizes = [it.size for it in iterators]
        summed = tuple(range(len(traversal), rank))
        value = np.asarray(self.reduce(scope.body, env, sizes, summed, scope.reduce), dtype=self.dtype)
        value = value.reshape(value.shape[: len(traversal)])  # the summed axes are size 1 now
        return np.array(np.broadcast_to(value, tuple(it.size for it in traversal)), order="C")  # keeps 0-d

    # -- reductions: sums of products go through einsum
    def reduce(self, body: Scalar, env, sizes, summed, kind):
        """The body reduced over the ``summed`` axes, keeping them as size-1 axes."""
        if not summed:
            return self.term(body, env)
        if kind == "max":
            full = np.broadcast_to(self.term(body, env), tuple(sizes))
            return full.max(axis=summed, keepdims=True)
        match body:
            case Binary("+" | "-" as op, lhs, rhs):
                return _BINARY[op](
                    self.reduce(lhs, env, sizes, summed, kind), self.reduce(rhs, env, sizes, summed, kind)
                )
            case Unary("neg", arg):
                return -self.reduce(arg, env, sizes, summed, kind)
            case Binary("/", lhs, rhs) if not _depends(rhs, env, summed):
                return self.reduce(lhs, env, sizes, summed, kind) / self.term(rhs, env)
        factors = [self.term(f, env) for f in _factors(body)]
        return _contract(factors, sizes, summed, self.dtype)

    def term(self, body: Scalar, env) -> np.ndarray:
        """The body on the broadcast space (size-1 axes where it does not depend on an iterator)."""
        rank = len(next(iter(env.values())).shape) if env else 0
        match body:
            case Num(value):
                return np.full([1] * rank, value, dtype=self.dtype)
            case Access(source, indices):
                if isinstance(source, Tensor):
                    array, offsets = self.values[source.name], [0] * source.rank
                else:
                    array, offsets = self.scope(source), [it.lo for it in source.traversal]
                view = _strided_view(array, offsets, indices, env, rank, self.padded)
                if view is not None:
                    return view
                return _gather(array, offsets, [eval_index(ix, env) for ix in indices], rank)
            case Unary(fn, arg):
                return _UNARY[fn](self.term(arg, env))
            case Binary(op, lhs, rhs):
                return _BINARY[op](self.term(lhs, env), self.term(rhs, env))
        raise ExpressionError(f"cannot evaluate {body!r}")


def _strided_view(array, offsets, indices, env, rank, padded_cache):
    """An affine read as a zero-copy strided view of the (zero-padded) array, or None.

    ``T[sum_v c_dv * v + k_d]`` over a box is a view with stride ``sum_d c_dv * stride_d`` along the
    axis of ``v``; padding the array by how far the indices reach outside makes every read valid.
    """
    forms = [affine_coefficients(ix) for ix in indices]
    if not forms or any(f is None for f in forms):
        return None
    # iterator -> (axis, first value, size), read off the aranges of the broadcast space
    boxes = {name: (int(np.argmax(arr.shape)), int(arr.flat[0]), arr.size) for name, arr in env.items()}
    origins, pads = [], []
    for dim, offset, (coeffs, const) in zip(array.shape, offsets, forms):
        first = const - offset + sum(c * boxes[v][1] for v, c in coeffs.items())
        spread = [c * (boxes[v][2] - 1) for v, c in coeffs.items()]
        lo = first + sum(x for x in spread if x < 0)
        hi = first + sum(x for x in spread if x > 0)
        if hi < 0 or lo >= dim:
            return np.zeros((1,) * rank, dtype=array.dtype)  # every read is padding
        pads.append((max(0, -lo), max(0, hi - dim + 1)))
        origins.append(first + pads[-1][0])
    padded_size = math.prod(d + a + b for d, (a, b) in zip(array.shape, pads))
    if padded_size > 4 * array.size + (1 << 20):
        return None  # reads reach far outside: padding would cost more than gathering
    key = (id(array), tuple(pads))
    if key not in padded_cache:
        padded_cache[key] = np.pad(array, pads) if any(a or b for a, b in pads) else np.ascontiguousarray(array)
    source = padded_cache[key]
    shape, strides = [1] * rank, [0] * rank
    for name, (axis, _, size) in boxes.items():
        step = sum(coeffs.get(name, 0) * stride for (coeffs, _), stride in zip(forms, source.strides))
        if step and size > 1:  # a size-1 iterator sits at its first value, already in `first`
            shape[axis], strides[axis] = size, step
    offset = sum(o * stride for o, stride in zip(origins, source.strides))
    return np.ndarray(shape, source.dtype, buffer=source, offset=offset, strides=strides)


def _gather(array: np.ndarray, offsets, indices, rank: int) -> np.ndarray:
    """``array[indices - offsets]`` broadcast over the space, 0 where an index is out of bounds."""
    mask = None
    clipped = []
    for dim, offset, index in zip(array.shape, offsets, indices):
        index = np.asarray(index, dtype=np.int64) - offset
        if index.ndim < rank:
            index = index.reshape((1,) * (rank - index.ndim) + index.shape)
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= dim:
            inside = (index >= 0) & (index < dim)
            mask = inside if mask is None else mask & inside
            index = np.clip(index, 0, dim - 1)
        clipped.append(index)
    if not clipped:  # a rank-0 tensor
        return np.asarray(array).reshape((1,) * rank)
    values = array[tuple(clipped)]  # every index has rank `rank`, so the gather does too
    return values if mask is None else np.where(mask, values, 0)


def _factors(body: Scalar) -> list[Scalar]:
    if isinstance(body, Binary) and body.op == "*":
        return _factors(body.lhs) + _factors(body.rhs)
    return [body]


def _depends(body: Scalar, env, axes) -> bool:
    names = [name for name, arr in env.items() if any(arr.shape[a] != 1 for a in axes)]
    return any(set(names) & index_vars(ix) for a in accesses(body) for ix in a.indices)


def _contract(factors: list[np.ndarray], sizes, summed, dtype) -> np.ndarray:
    """Sum over ``summed`` of the product of broadcast ``factors``, without building the product."""
    rank = len(sizes)
    letters = [chr(ord("a") + k) if k < 26 else chr(ord("A") + k - 26) for k in range(rank)]
    operands, subscripts, present = [], [], set()
    for factor in factors:
        axes = [k for k in range(rank) if factor.shape[k] != 1]
        operands.append(factor.reshape([factor.shape[k] for k in axes]))
        subscripts.append("".join(letters[k] for k in axes))
        present.update(axes)
    kept = [k for k in range(rank) if k not in summed and k in present]
    spec = ",".join(subscripts) + "->" + "".join(letters[k] for k in kept)
    # BLAS (einsum's optimize path) pays off when each element is reused; on a strided view
    # that is read about once (convolution windows) its copies cost more than the plain loop.
    work = math.prod(sizes[k] for k in present)
    traffic = sum(op.size for op in operands) + math.prod(sizes[k] for k in kept)
    result = np.einsum(spec, *operands, optimize="greedy" if work > 8 * traffic else False)
    # a summation axis no factor depends on multiplies the sum by its size
    scale = math.prod(sizes[k] for k in summed if k not in present)
    if scale != 1:
        result = result * scale
    shape = [sizes[k] if k in kept else 1 for k in range(rank)]
    return np.asarray(result, dtype=dtype).reshape(shape)


def _deps(body: Scalar, sizes: dict[str, int]) -> frozenset[str]:
    return frozenset(n for a in accesses(body) for ix in a.indices for n in index_vars(ix) if n in sizes)


def _viewable(access: Access, box: dict) -> bool:
    """Whether ``_strided_view`` will read ``access`` without building it: affine indices whose
    reads stay near the source (a read far outside is gathered over the whole space)."""
    if not all(affine_coefficients(ix) for ix in access.indices):
        return False
    source = access.source
    lows = [0] * len(source.shape) if isinstance(source, Tensor) else [it.lo for it in source.traversal]
    padded, size = 1, 1
    for ix, dim, low in zip(access.indices, source.shape, lows):
        lo, hi = index_bounds(ix, box)
        padded *= dim + max(0, low - lo) + max(0, hi - (low + dim - 1))
        size *= dim
    return padded <= 4 * size + (1 << 20)


def _footprint(scope: Scope, sizes: dict[str, int]) -> int:
    """Elements of the largest array evaluating the scope over ``sizes`` builds (an estimate)."""
    summed = {it.name for it in scope.summation}

    def size(names) -> int:
        return math.prod(sizes[n] for n in names)

    box = scope.box

    def term(body: Scalar) -> int:
        if isinstance(body, Access) and _viewable(body, box):
            return 0  # read through a strided view, not built
        own = size(_deps(body, sizes))
        return max([own] + [term(child) for child in children(body)])

    def reduced(body: Scalar) -> int:
        match body:
            case Binary("+" | "-", lhs, rhs):
                return max(reduced(lhs), reduced(rhs))
            case Unary("neg", arg):
                return reduced(arg)
        factors = _factors(body)
        out = size(_deps(body, sizes) - summed)
        return max([out] + [term(f) for f in factors])

    if scope.summation and scope.reduce == "sum":
        return reduced(scope.body)
    return max(term(scope.body), size(_deps(scope.body, sizes)))
