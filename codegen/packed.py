"""A matrix product whose right operand is a weight: the weight laid out once in panels.

For a matched ``C[b, m, n] = A[b, m, :] @ B[b, :, n]`` (a ``GemmMatch``) whose B is a model
weight (``Kernel.weights``), the weight is copied once, when the program's weights are bound, into
panels of ``PANEL`` columns, ``P[b, j, k, l] = B[b, k, PANEL*j + l]`` (zero past the last
column), so that each step of the sum reads one contiguous vector and the whole weight streams
from memory in order. The product is then the scope

    C[b, m, j, l] = S k ; A[b, m, k] * P[b, j, k, l]        (C is the output, padded to whole panels)

compiled by TVM like any other (``compile_scope``: lanes along l, a register tile of rows of m
sharing each panel vector), with A copied into a buffer of whole row tiles (``ROWS``). This is how
onnxruntime's MLAS runs a MatMul with a constant weight; the BLAS call (numpy's) copies the
weight into its own panels on every call. Measured here (AMD EPYC, 2 cores, float32, 12 weights
in turn, ms per product): 197x768 @ 768x3072 BLAS 5.20, TVM on the weight as it lies 10.9, this
4.55; 32x768 @ 768x3072 BLAS 1.51, TVM 0.92, this 1.09. Which wins depends on the shape, so
all three are raced.

``packed_call(kernel, dtype)`` returns the call, or None where B is not a weight. The call's
``prepare(values)`` gives the panels of B to keep with the program's constants (``bind``); the
call packs B itself (every call, slower) only where they are missing.
"""

from __future__ import annotations

import math

import numpy as np

from rewriter.ir import parse
from rewriter.lower import GemmMatch, Kernel, operand_view

from .tvm_kernel import TvmKernel, aligned_empty, compile_scope, is_aligned

PANEL = 16  # columns per panel: one AVX-512 vector of float32
ROWS = 8  # A's rows are padded to a multiple of this (the register tile needs whole tiles)


def packed_name(tensor: str) -> str:
    """The constant holding ``tensor``'s panels."""
    return f"{tensor}.panels"


def packed_call(kernel: Kernel, dtype: str):
    """``(values, out) -> None`` for the matmul ``kernel`` with its weight in panels, or None."""
    match = kernel.match
    if not isinstance(match, GemmMatch) or match.b.tensor not in kernel.weights or match.a.tensor == match.b.tensor:
        return None
    return _Packed(match, np.dtype(dtype))


class _Packed:
    """The call; its buffers (A in whole row tiles, C in whole panels) are allocated once."""

    def __init__(self, match: GemmMatch, dtype: np.dtype):
        self.match, self.dtype = match, dtype
        batches, m, k = match.a.shape
        n = match.b.shape[2]
        self.m, self.k, self.n = m, k, n
        self.rows = m if m <= ROWS else math.ceil(m / ROWS) * ROWS
        self.panels = math.ceil(n / PANEL)
        # an operand broadcast over the batch (stride 0) is kept once
        self.a_batch = 1 if match.a.strides[0] == 0 else batches
        self.b_batch = 1 if match.b.strides[0] == 0 else batches
        self.batches = batches
        self.kernel = _compile(self.a_batch, self.b_batch, batches, self.rows, k, self.panels, str(dtype))
        self.a_buffer = _aligned_zeros((self.a_batch, self.rows, k), dtype)  # rows past m stay 0
        self.c_buffer = aligned_empty((batches, self.rows, self.panels, PANEL), dtype)
        # C lands in the output as it lies: no copy (where the output is aligned)
        self.direct = (self.rows, self.panels * PANEL) == (m, n) and tuple(match.out_strides[1:]) == (n, 1)
        self.direct &= batches == 1 or match.out_strides[0] == m * n

    @property
    def name(self) -> str:
        return packed_name(self.match.b.tensor)

    def prepare(self, values: dict) -> dict[str, np.ndarray]:
        """B's panels (none where ``values`` lacks B), to keep with the program's constants."""
        if self.match.b.tensor not in values:
            return {}
        b = operand_view(values, self.match.b)[: self.b_batch]
        wide = np.zeros((self.b_batch, self.k, self.panels * PANEL), self.dtype)  # zero past column n
        wide[:, :, : self.n] = b
        panels = aligned_empty((self.b_batch, self.panels, self.k, PANEL), self.dtype)
        panels[...] = wide.reshape(self.b_batch, self.k, self.panels, PANEL).transpose(0, 2, 1, 3)
        return {self.name: panels}

    def __call__(self, values: dict, out: np.ndarray) -> None:
        panels = values.get(self.name)
        if panels is None:  # not bound: B changes from call to call
            panels = self.prepare(values)[self.name]
        a = operand_view(values, self.match.a)[: self.a_batch]
        if self.rows != self.m or not is_aligned(a):
            self.a_buffer[:, : self.m] = a
            a = self.a_buffer
        arguments = {"A": a[0] if self.a_batch == 1 else a, "P": panels[0] if self.b_batch == 1 else panels}
        if self.direct and is_aligned(out):
            self.kernel.run(arguments, out.reshape(self.c_buffer.shape))
            return
        self.kernel.run(arguments, self.c_buffer)
        product = self.c_buffer.reshape(self.batches, self.rows, self.panels * PANEL)[:, : self.m, : self.n]
        target = np.lib.stride_tricks.as_strided(
            out.reshape(-1), product.shape, tuple(s * out.itemsize for s in self.match.out_strides)
        )
        np.copyto(target, product)


def _aligned_zeros(shape, dtype) -> np.ndarray:
    array = aligned_empty(shape, dtype)
    array[...] = 0
    return array


def _compile(a_batch: int, b_batch: int, batches: int, rows: int, k: int, panels: int, dtype: str) -> TvmKernel:
    """The product over panels as a scope, compiled (and cached on disk) like any other."""
    a = "A[b, m, k]" if a_batch > 1 else "A[m, k]"
    p = "P[b, j, k, l]" if b_batch > 1 else "P[j, k, l]"
    shapes = {
        "A": (a_batch, rows, k) if a_batch > 1 else (rows, k),
        "P": (b_batch, panels, k, PANEL) if b_batch > 1 else (panels, k, PANEL),
    }
    scope = parse(f"L b:{batches}, m:{rows}, j:{panels}, l:{PANEL} ; S k:{k} ; {a} * {p}", shapes)
    return compile_scope(scope, dtype=dtype)
