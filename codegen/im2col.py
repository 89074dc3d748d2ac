"""A matched convolution as one (batched) BLAS call: its input windows copied into a column
matrix (im2col).

A convolution kernel ``L <traversal> ; S <summed> ; X[...] * W[...]`` (the Conv2d record of
``rewriter.lower.operators``, or any record whose match is a ``ConvMatch``) is a matrix product
once every window of ``X`` is laid out as a column:

    col[g, (summed), (X's traversal)] = X[...]            a strided copy (zero padding where it reads outside)
    out[g, (W's traversal), (X's traversal)] = W[g, (W's traversal), (summed)] @ col[g]

where g are the group iterators (a grouped or depthwise convolution's channel groups: read by X,
W and the output), a batch of GEMMs. This is what CPU convolution libraries do. Every buffer (the
padded input, the column matrix, the product when the output's layout needs a copy) is allocated
once per kernel and reused: temporaries allocated on every call made the same convolution take
2 or 4.5 ms from one call to the next in one process.

``im2col_call(kernel, dtype)`` returns the call, or None for a kernel whose iterators do not
split that way (a summed iterator read by one operand only, a weight read outside its bounds).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from rewriter.ir import Scope
from rewriter.lower import ConvMatch, Kernel

from .strided import StridedRead, strided_read
from .tvm_kernel import aligned_empty


def im2col_call(kernel: Kernel, dtype: str) -> Callable[[dict, np.ndarray], None] | None:
    """``(values, out) -> None`` computing the convolution ``kernel`` as im2col + GEMMs, or None."""
    scope: Scope = kernel.expr
    match = kernel.match
    if not isinstance(match, ConvMatch) or match.input == match.weight:
        return None
    reads = {side.source.name: side for side in (scope.body.lhs, scope.body.rhs)}
    box = scope.box
    x, w = strided_read(reads[match.input], box), strided_read(reads[match.weight], box)
    if x is None or w is None or w.padded:
        return None
    sizes = {it.name: it.size for it in scope.iterators}
    in_x, in_w = x.iterators, w.iterators
    traversal = [it.name for it in scope.traversal]
    groups = [n for n in traversal if n in in_x and n in in_w]
    rows = [n for n in traversal if n in in_w and n not in in_x]  # M: the weight's own iterators
    columns = [n for n in traversal if n not in in_w]  # N: the windows' positions
    if any(sizes[n] > 1 and not (n in in_x and n in in_w) for n in (it.name for it in scope.summation)):
        return None  # a sum over one operand only is no GEMM
    if any(sizes[n] > 1 and n not in in_x for n in columns):
        return None  # an output iterator neither operand reads: a broadcast, not a convolution
    # K in the weight's own order, so the weight matrix is usually a view, not a copy
    depth = sorted(
        (it.name for it in scope.summation),
        key=lambda n: next((d for d, (coeffs, _) in enumerate(w.forms) if n in coeffs), len(w.forms)),
    )
    return _Im2col(x, w, box, traversal, groups, rows, depth, columns, np.dtype(dtype))


class _Im2col:
    """The call; its buffers are allocated on the first call and reused."""

    def __init__(self, x: StridedRead, w: StridedRead, box: dict, traversal, groups, rows, depth, columns, dtype):
        self.x, self.w, self.box, self.dtype = x, w, box, dtype
        self.groups, self.rows, self.depth, self.columns = groups, rows, depth, columns
        size = lambda names: [box[i][1] - box[i][0] for i in names]  # noqa: E731
        self.g, self.m, self.k, self.n = (math.prod(size(names)) for names in (groups, rows, depth, columns))
        nonunit = lambda names: [i for i in names if box[i][1] - box[i][0] > 1]  # noqa: E731
        if nonunit(traversal) == nonunit(groups + rows + columns):
            self.order = "mn"  # out is (G, M, N) as it lies
        elif nonunit(traversal) == nonunit(groups + columns + rows):
            self.order = "nm"  # out is (G, N, M): the products transposed
        else:
            self.order = "copy"  # the products are copied into out's layout
        self.axes = [traversal.index(i) for i in groups + rows + columns]
        self.product_shape = size(groups + rows + columns)
        self.windows_shape = size(groups + depth + columns)
        self.buffers: dict = {}

    def _buffer(self, name: str, shape) -> np.ndarray:
        if name not in self.buffers:
            self.buffers[name] = aligned_empty(shape, self.dtype)
        return self.buffers[name]

    def __call__(self, values: dict, out: np.ndarray) -> None:
        box = self.box
        x = self.x.pad(values[self.x.tensor], self.buffers, self.dtype)
        col = self._buffer("col", (self.g, self.k, self.n))
        np.copyto(col.reshape(self.windows_shape), self.x.view(x, self.groups + self.depth + self.columns, box))
        weights = self.w.view(values[self.w.tensor], self.groups + self.rows + self.depth, box)
        weights = weights.reshape(self.g, self.m, self.k)
        if self.order == "mn":
            np.matmul(weights, col, out=out.reshape(self.g, self.m, self.n))
        elif self.order == "nm":
            np.matmul(col.transpose(0, 2, 1), weights.transpose(0, 2, 1), out=out.reshape(self.g, self.n, self.m))
        else:
            product = self._buffer("product", (self.g, self.m, self.n))
            np.matmul(weights, col, out=product)
            np.copyto(out.transpose(self.axes), product.reshape(self.product_shape))
