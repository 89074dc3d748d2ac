"""A matched band matmul (G2BMM, GBMM: Longformer attention) as blocked batched GEMMs (BLAS).

    G2BMM   out[.., i, w] = sum_k X[.., i, k] * Y[.., i + D*w + c, k]
    GBMM    out[.., i, n] = sum_w X[.., i, w] * Y[.., i + D*w + c, n]

The rows i of one residue q modulo the dilation D read rows of Y of that residue only: a block
of T rows ``q + D*s`` (s0 <= s < s0 + T) reads the T + W - 1 rows ``q + D*s + base`` (s0 <= s <
s0 + T + W - 1) of Y, W the band's width: strided matrices that BLAS reads in place. So for each
residue and each block, one batched matmul computes the block:

* G2BMM: ``P = X_block @ Y_window^T`` (T x (T+W-1)), and the band is the diagonal strip
  ``P[t, t + u]``, a strided view copied into the output;
* GBMM: the block's band is scattered into the strip of a zero T x (T+W-1) matrix ``B``
  (``B[t, t + u] = X[t, u]``), and ``B @ Y_window`` is the block's output.

A block computes (T+W-1)/W times the band's flops, on BLAS. An operand is copied only where it
reads padding (into a zero-bordered buffer) or its dimensions are not BLAS-ready; every buffer
(padded operands, the strip matrix, the products) is allocated on the first call and reused, as
``codegen.im2col`` does. ``band_call(kernel, dtype)`` returns the call, or None for a kernel
whose iterators do not split into batch, row, band and one more group.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from rewriter.ir import Scope
from rewriter.lower import BandMatch, Kernel

from .strided import StridedRead, strided_read
from .tvm_kernel import aligned_empty

MIN_BLOCK = 8  # rows per block at least: fewer makes GEMMs too small to pay for their calls

ROW = "__row__"  # the iterator over Y's rows read by the window, in the order a row reads them


def band_call(kernel: Kernel, dtype: str) -> Callable[[dict, np.ndarray], None] | None:
    """``(values, out) -> None`` computing the band matmul ``kernel`` as blocked GEMMs, or None."""
    scope: Scope = kernel.expr
    match = kernel.match
    if not isinstance(match, BandMatch) or match.x == match.y:
        return None
    reads = {side.source.name: side for side in (scope.body.lhs, scope.body.rhs)}
    box = dict(scope.box)
    sizes = {it.name: it.size for it in scope.iterators}
    rows, width = sizes[match.row], sizes[match.band]
    x, y = strided_read(reads[match.x], box), strided_read(reads[match.y], box)
    if x is None or y is None:
        return None
    windows = [d for d, (coeffs, _) in enumerate(y.forms) if match.row in coeffs or match.band in coeffs]
    if len(windows) != 1:
        return None  # the row or the band read elsewhere too: not one window
    (window,) = windows
    # Y's window dimension through one iterator ROW: the first row read is the window's value
    # at the first row and band offset; a row at t, band offset u reads ROW = t + D*u
    coeffs, const = y.forms[window]
    base = const + sum(c * box[n][0] for n, c in coeffs.items())
    box[ROW] = (0, rows + match.dilation * (width - 1))
    y = strided_read(reads[match.y], box, {window: ({ROW: 1}, base)})
    return _plan(scope, match, x, y, box, sizes, np.dtype(dtype))


def _plan(scope: Scope, match: BandMatch, x: StridedRead, y: StridedRead, box, sizes, dtype):
    traversal = [it.name for it in scope.traversal]
    summation = [it.name for it in scope.summation]
    in_x, in_y = x.iterators, y.iterators
    batch = [n for n in traversal if n in in_x and n in in_y and n != match.row]
    if match.summed:  # GBMM: X reads the band; Y's own iterators are the output's last group
        inner_x, inner_y = [match.band], [n for n in traversal if n in in_y and n not in in_x]
        rest = [n for n in summation if n != match.band]
    else:  # G2BMM: both read the summed iterators; the band is the output's last dimension
        inner_x = inner_y = [n for n in summation if sizes[n] > 1]
        rest = [n for n in summation if sizes[n] == 1]
    last = inner_y if match.summed else [match.band]
    batch += [n for n in traversal if n not in batch + [match.row] + last]  # extent 1: a batch of one
    if any(sizes[n] > 1 for n in rest) or any(sizes[n] > 1 and not (n in in_x and n in in_y) for n in batch):
        return None
    return _Band(match, x, y, box, traversal, batch, inner_x, inner_y, last, dtype)


class _Band:
    """The call; its buffers are allocated on the first call and reused."""

    def __init__(self, match: BandMatch, x, y, box, traversal, batch, inner_x, inner_y, last, dtype):
        size = lambda names: tuple(box[n][1] - box[n][0] for n in names)  # noqa: E731
        self.match, self.x, self.y, self.box, self.dtype = match, x, y, box, dtype
        self.batch, self.inner_x, self.inner_y = batch, inner_x, inner_y
        self.rows, self.width, self.dilation = size([match.row])[0], size([match.band])[0], match.dilation
        per_residue = -(-self.rows // self.dilation)  # rows of the most numerous residue
        self.block = min(per_residue, max(MIN_BLOCK, self.width))
        self.strip = self.block + self.width - 1  # the rows of Y one block reads, at most
        self.batch_shape = size(batch)
        self.kx, self.ky = math.prod(size(inner_x)), math.prod(size(inner_y))
        self.out_axes = [traversal.index(n) for n in batch + [match.row] + last]
        self.last_shape = size(last)
        self.buffers: dict = {}

    def _buffer(self, name: str, shape, zeros: bool = False) -> np.ndarray:
        if name not in self.buffers:
            self.buffers[name] = aligned_empty(shape, self.dtype)
            if zeros:  # the strip matrix off its band: never written
                self.buffers[name][...] = 0
        return self.buffers[name]

    def _matrices(self, read: StridedRead, values: dict, row: str, inner: list) -> np.ndarray:
        """``read`` as (batch, rows, K) matrices: a view where BLAS can read it in place (the
        inner iterators one unit-stride dimension), else a copy into a reused buffer."""
        nb = len(self.batch)
        view = read.view(read.pad(values[read.tensor], self.buffers, self.dtype), self.batch + [row] + inner, self.box)
        shape = view.shape[: nb + 1] + (math.prod(view.shape[nb + 1 :]),)
        if _unit_stride_rows(view, nb + 1):
            return np.lib.stride_tricks.as_strided(view, shape, view.strides[: nb + 1] + (view.itemsize,))
        copied = self._buffer(("matrices", read.tensor), shape)
        np.copyto(copied.reshape(view.shape), view)
        return copied

    def __call__(self, values: dict, out: np.ndarray) -> None:
        nb, d, t, match = len(self.batch), self.dilation, self.block, self.match
        x = self._matrices(self.x, values, match.row, self.inner_x)
        y = self._matrices(self.y, values, ROW, self.inner_y)
        target = out.transpose(self.out_axes)  # (batch, row, band or Y's own iterators)
        product = self._buffer("product", self.batch_shape + (t, self.ky if match.summed else self.strip))
        strip = self._buffer("strip", self.batch_shape + (t, self.strip), zeros=True) if match.summed else product
        # the band of a block: strip[j, j + u] for row j and band offset u
        band = np.lib.stride_tricks.as_strided(
            strip, self.batch_shape + (t, self.width), strip.strides[:nb] + (sum(strip.strides[nb:]), strip.strides[-1])
        )
        every = (slice(None),) * nb
        for q in range(min(d, self.rows)):  # rows q, q + D, q + 2D, ... read Y rows of residue q
            count = len(range(q, self.rows, d))
            for start in range(0, count, t):
                n = min(t, count - start)
                first = q + d * start
                rows = every + (slice(first, first + d * (n - 1) + 1, d),)
                window = y[every + (slice(first, first + d * (n + self.width - 2) + 1, d),)]
                if match.summed:
                    np.copyto(band[every + (slice(0, n),)], x[rows])
                    result = product[every + (slice(0, n),)]
                    np.matmul(strip[every + (slice(0, n), slice(0, n + self.width - 1))], window, out=result)
                    target[rows] = result.reshape(self.batch_shape + (n,) + self.last_shape)
                else:
                    result = product[every + (slice(0, n), slice(0, n + self.width - 1))]
                    np.matmul(x[rows], np.swapaxes(window, -1, -2), out=result)
                    target[rows] = band[every + (slice(0, n),)]


def _unit_stride_rows(view: np.ndarray, axis: int) -> bool:
    """Whether the axes from ``axis`` on merge into one of unit stride, and rows do not overlap."""
    stride = view.itemsize
    for size, step in zip(reversed(view.shape[axis:]), reversed(view.strides[axis:])):
        if size > 1 and step != stride:
            return False
        stride *= size
    row = view.strides[axis - 1]
    return view.shape[axis - 1] == 1 or (row > 0 and row % view.itemsize == 0 and row >= stride)
