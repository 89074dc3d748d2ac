"""cuBLAS calls for row-major strided GEMMs, and what such a call computes (numpy).

The code generator matches ``C[b, i, j] = sum_l A[b, i, l] * B[b, l, j]`` with every operand a
strided view of its buffer (offset, 3-d shape, strides in elements). cuBLAS reads
column-major matrices with one unit stride and a leading dimension, so ``gemm_call`` picks the
orientation that needs no copy: where C's columns are contiguous it computes ``Cᵀ = Bᵀ Aᵀ``
(C row-major is Cᵀ column-major), where its rows are, ``C = A B``; each operand is passed as
stored or transposed, whichever of its strides is 1. Operands no orientation fits (no unit
stride, or a leading dimension shorter than a column) get None: the kernel is generated instead.

``emulate`` is the call's meaning on flat numpy buffers, so the specification is tested on
machines without a GPU.
"""

from __future__ import annotations

import numpy as np

from .format import GemmCall

INT32 = 2**31 - 1


def _stored(rows: int, cols: int, row_stride: int, col_stride: int) -> tuple[bool, int] | None:
    """How cuBLAS reads the matrix X (rows×cols, X[r, c] at r*row_stride + c*col_stride):
    (transposed, ld) with X = op(stored), or None. Stored as is: unit row stride, ld the column
    stride; stored transposed: unit column stride, ld the row stride."""
    if rows == 1 or row_stride == 1:
        ld = col_stride if cols > 1 else rows
        if ld >= rows:
            return False, max(ld, 1)
    if cols == 1 or col_stride == 1:
        ld = row_stride if rows > 1 else cols
        if ld >= cols:
            return True, max(ld, 1)
    return None


def gemm_call(output: str, a, b, out_strides: tuple[int, int, int], label: str = "") -> GemmCall | None:
    """The cuBLAS call computing ``out[bt, i, j] = A[bt, i, :] @ B[bt, :, j]`` in place, or None.
    ``a`` and ``b`` are operands: ``tensor`` (the buffer's name), ``offset``, 3-d ``shape`` and
    ``strides`` in elements (``rewriter.lower.Operand``)."""
    batch, m, k = a.shape
    n = b.shape[2]
    (sab, sam, sak), (sbb, sbk, sbn), (scb, scm, scn) = a.strides, b.strides, out_strides
    if batch == 1:
        sab = sbb = scb = 0
    elif scb == 0:
        return None  # every batch would write the same output
    # C row-major with contiguous columns is Cᵀ column-major (ldc = row stride): Cᵀ = Bᵀ Aᵀ
    c_t = _stored(n, m, scn, scm)
    if c_t is not None and not c_t[0]:
        first, second = _stored(n, k, sbn, sbk), _stored(k, m, sak, sam)
        if first and second:
            return _call(output, (n, m, k), (b, sbb, first), (a, sab, second), (c_t[1], scb), batch, label)
    c = _stored(m, n, scm, scn)
    if c is not None and not c[0]:
        first, second = _stored(m, k, sam, sak), _stored(k, n, sbk, sbn)
        if first and second:
            return _call(output, (m, n, k), (a, sab, first), (b, sbb, second), (c[1], scb), batch, label)
    return None


def _call(output, mnk, first, second, c, batch, label) -> GemmCall | None:
    (fa, f_stride, (f_t, f_ld)), (sb, s_stride, (s_t, s_ld)) = first, second
    ldc, stride_c = c
    m, n, k = mnk
    numbers = (m, n, k, f_ld, s_ld, ldc, batch, fa.offset, sb.offset)
    if max(numbers) > INT32 or min(f_stride, s_stride, stride_c) < 0:
        return None
    return GemmCall(
        output,
        f_t,
        s_t,
        m,
        n,
        k,
        fa.tensor,
        fa.offset,
        f_ld,
        f_stride,
        sb.tensor,
        sb.offset,
        s_ld,
        s_stride,
        0,
        ldc,
        stride_c,
        batch,
        label=label,
    )


def _matrices(flat: np.ndarray, offset: int, stride: int, ld: int, rows: int, cols: int, batch: int) -> np.ndarray:
    """The ``batch`` stored column-major matrices (rows×cols, leading dimension ld) as a view."""
    size = flat.itemsize
    last = offset + (batch - 1) * stride + (rows - 1) + (cols - 1) * ld
    if offset < 0 or last >= flat.size:
        raise IndexError(f"a GEMM operand reads elements {offset}..{last} of a buffer of {flat.size}")
    return np.lib.stride_tricks.as_strided(flat[offset:], (batch, rows, cols), (stride * size, size, ld * size))


def emulate(call: GemmCall, buffers: dict[str, np.ndarray]) -> None:
    """Run ``call`` on flat numpy buffers as cuBLAS would (writes ``buffers[call.output]``)."""
    a_rows, a_cols = (call.k, call.m) if call.transa else (call.m, call.k)
    b_rows, b_cols = (call.n, call.k) if call.transb else (call.k, call.n)
    a = _matrices(buffers[call.a].reshape(-1), call.a_offset, call.stride_a, call.lda, a_rows, a_cols, call.batch)
    b = _matrices(buffers[call.b].reshape(-1), call.b_offset, call.stride_b, call.ldb, b_rows, b_cols, call.batch)
    out = buffers[call.output].reshape(-1)
    c = _matrices(out, call.c_offset, call.stride_c, call.ldc, call.m, call.n, call.batch)
    op_a = a.transpose(0, 2, 1) if call.transa else a
    op_b = b.transpose(0, 2, 1) if call.transb else b
    c[...] = np.matmul(op_a, op_b)
