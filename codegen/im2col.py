"""A matched convolution as one BLAS call: its input windows copied into a column matrix (im2col).

A Conv2d kernel ``L <traversal> ; S <summed> ; X[...] * W[...]`` (``rewriter.instantiate.match_conv``)
is a matrix product once every window of ``X`` is laid out as a column:

    col[(summed), (X's traversal)] = X[...]            a strided copy (zero padding where it reads outside)
    out[(W's traversal), (X's traversal)] = W[(W's traversal), (summed)] @ col

This is what CPU convolution libraries do. Here every buffer (the padded input, the column
matrix, the product when the output's layout needs a copy) is allocated once per kernel and
reused: numpy's einsum path allocates its temporaries on every call, and where the allocator puts
them made the same convolution take 2 or 4.5 ms from one call to the next in one process.

``im2col_call(kernel, dtype)`` returns the call, or None for a convolution whose iterators do not
split that way (a traversal iterator read by both operands, a summed one read by only one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from rewriter.index import affine_coefficients
from rewriter.ir import Access, Scope
from rewriter.lower import Kernel

from .tvm_kernel import aligned_empty


@dataclass(frozen=True)
class _Read:
    """An operand read as a strided view over some of the scope's iterators."""

    tensor: str
    forms: tuple  # per dimension: ({iterator: coefficient}, constant)
    pads: tuple  # per dimension: (zeros before, zeros after) the tensor's extent

    def view(self, array: np.ndarray, iterators: list, box: dict) -> np.ndarray:
        """``array`` (already padded by ``pads``) over ``iterators`` in that order."""
        array = np.ascontiguousarray(array)
        unit = [s // array.itemsize for s in array.strides]
        offset = sum(
            (const + before + sum(c * box[n][0] for n, c in coeffs.items())) * u
            for (coeffs, const), (before, _), u in zip(self.forms, self.pads, unit)
        )
        strides = [
            sum(coeffs.get(n, 0) * u for (coeffs, _), u in zip(self.forms, unit)) * array.itemsize for n in iterators
        ]
        shape = [box[n][1] - box[n][0] for n in iterators]
        return np.lib.stride_tricks.as_strided(array.reshape(-1)[offset:], shape, strides, writeable=False)


def _read(access: Access, box: dict) -> _Read | None:
    forms, pads = [], []
    for ix, extent in zip(access.indices, access.source.shape):
        form = affine_coefficients(ix)
        if form is None:
            return None
        coeffs, const = form
        lo = const + sum(c * (box[n][0] if c > 0 else box[n][1] - 1) for n, c in coeffs.items())
        hi = const + sum(c * (box[n][1] - 1 if c > 0 else box[n][0]) for n, c in coeffs.items())
        forms.append((coeffs, const))
        pads.append((max(0, -lo), max(0, hi - (extent - 1))))
    return _Read(access.source.name, tuple(forms), tuple(pads))


def _operands(kernel: Kernel) -> tuple[Access, Access] | None:
    """(input, weight) reads of a matched convolution (a product of two tensor reads)."""
    body, match = kernel.expr.body, kernel.match
    if kernel.kind != "conv2d" or match is None or match.input == match.weight:
        return None
    reads = {side.source.name: side for side in (body.lhs, body.rhs)}
    return reads[match.input], reads[match.weight]


def im2col_call(kernel: Kernel, dtype: str) -> Callable[[dict, np.ndarray], None] | None:
    """``(values, out) -> None`` computing the conv2d ``kernel`` as im2col + one GEMM, or None."""
    scope: Scope = kernel.expr
    operands = _operands(kernel)
    if operands is None:
        return None
    box = {it.name: (it.lo, it.hi) for it in scope.iterators}
    x, w = (_read(a, box) for a in operands)
    if x is None or w is None or any(p != (0, 0) for p in w.pads):
        return None
    in_x = {n for coeffs, _ in x.forms for n in coeffs}
    in_w = {n for coeffs, _ in w.forms for n in coeffs}
    traversal = [it.name for it in scope.traversal]
    summed = [it.name for it in scope.summation]
    if set(summed) != in_x & in_w or set(traversal) != in_x ^ in_w:
        return None  # not one GEMM: a batch iterator shared by both, or a sum over one side only
    rows = [n for n in traversal if n in in_w]  # M: the weight's traversal iterators
    columns = [n for n in traversal if n in in_x]  # N: the windows' positions
    # K in the weight's own order, so the weight matrix is usually a view, not a copy
    depth = sorted(summed, key=lambda n: next(d for d, (coeffs, _) in enumerate(w.forms) if n in coeffs))
    return _Im2col(x, w, operands[0].source.shape, box, traversal, rows, depth, columns, np.dtype(dtype))


class _Im2col:
    """The call; its buffers are allocated on the first call and reused."""

    def __init__(self, x: _Read, w: _Read, source: tuple, box: dict, traversal, rows, depth, columns, dtype):
        self.x, self.w, self.source, self.box, self.dtype = x, w, source, box, dtype
        self.rows, self.depth, self.columns = rows, depth, columns
        size = lambda names: [box[i][1] - box[i][0] for i in names]  # noqa: E731
        self.m, self.k, self.n = (math.prod(size(names)) for names in (rows, depth, columns))
        self.padded = any(p != (0, 0) for p in x.pads)
        self.interior = tuple(slice(a, a + e) for e, (a, _) in zip(source, x.pads))
        nonunit = lambda names: [i for i in names if box[i][1] - box[i][0] > 1]  # noqa: E731
        if nonunit(traversal) == nonunit(rows + columns):
            self.order = "mn"  # out is (M, N) as it lies
        elif nonunit(traversal) == nonunit(columns + rows):
            self.order = "nm"  # out is (N, M): the product transposed
        else:
            self.order = "copy"  # the product is copied into out's layout
        self.axes = [traversal.index(i) for i in rows + columns]
        self.product_shape = size(rows + columns)
        self.windows_shape = size(depth + columns)
        self.buffers: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, shape, zeros: bool = False) -> np.ndarray:
        if name not in self.buffers:
            self.buffers[name] = aligned_empty(shape, self.dtype)
            if zeros:  # the padding: never written, always zero
                self.buffers[name][...] = 0
        return self.buffers[name]

    def __call__(self, values: dict, out: np.ndarray) -> None:
        x, box = values[self.x.tensor], self.box
        if self.padded:
            padded = self._buffer("padded", [e + a + b for e, (a, b) in zip(self.source, self.x.pads)], zeros=True)
            padded[self.interior] = x
            x = padded
        col = self._buffer("col", (self.k, self.n))
        np.copyto(col.reshape(self.windows_shape), self.x.view(x, self.depth + self.columns, box))
        weights = self.w.view(values[self.w.tensor], self.rows + self.depth, box).reshape(self.m, self.k)
        if self.order == "mn":
            np.matmul(weights, col, out=out.reshape(self.m, self.n))
        elif self.order == "nm":
            np.matmul(col.T, weights.T, out=out.reshape(self.n, self.m))
        else:
            product = self._buffer("product", (self.m, self.n))
            np.matmul(weights, col, out=product)
            np.copyto(out.transpose(self.axes), product.reshape(self.product_shape))
