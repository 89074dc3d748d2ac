"""A matrix product over a weight, the weight laid out once: in panels (``packed_call``), or
k-major with the product computed transposed (``transposed_call``, below).

For a matched ``C[b, m, n] = A[b, m, :] @ B[b, :, n]`` (a ``GemmMatch``) whose B is a model
weight (``Kernel.weights``), the weight is copied once, when the program's weights are bound, into
panels of ``PANEL`` columns, ``P[b, j, k, l] = B[b, k, PANEL*j + l]`` (zero past the last
column), so that each step of the sum reads one contiguous vector and the whole weight streams
from memory in order. A is laid out k-major, ``T[b, k, m] = A[b, m, k]`` (rows past m zero), by a
small transposition kernel on every call, so that the rows of a register tile at one step of the
sum are one contiguous run too. The product is then the scope

    C[b, m, j, l] = S k ; T[b, k, m] * P[b, j, k, l]        (C is the output, padded to whole panels)

compiled by TVM like any other (``compile_scope``: lanes along l, a register tile of rows of m
sharing each panel vector). Where C's padded rows would spill past the output (197 rows in
tiles of 8), a program plans the output's buffer with room for them (``room``, ``Step.room``)
and C is written there, not into a buffer of its own copied out: ViT-Base, 105.96 to 103.73 ms
a run (one process, interleaved, 15 rounds). This is how onnxruntime's MLAS runs a MatMul with a
constant weight (it packs A too); the BLAS call (numpy's) copies the weight into its own panels
on every call.
Reading A as it lies instead, the tile's rows sit K floats apart: with K = 3072 they map to one
set of the 8-way L1 cache and evict each other. Measured here (AMD EPYC, 2 cores, float32, ms per
product, weights cold: enough copies to overflow the L3 cache, in turn), M x K @ K x N:

    =============== ====== ===== ================== ==============
    shape            BLAS   A as  k-major A (incl.   onnxruntime
                            it    transposition)     (2 threads)
                            lies
    =============== ====== ===== ================== ==============
    32x3072 @ 768    1.32   1.46  0.81               0.91
    32x768 @ 3072    1.35   0.94  0.74               0.82
    32x768 @ 768     0.36   0.24  0.20               0.22
    197x3072 @ 768   5.00   4.66  4.58               4.69
    =============== ====== ===== ================== ==============

A panel is two vectors wide (32 columns of float32), so each row of the register tile is two
vectors sharing one broadcast read of T. Against one-vector panels, on a later machine (AMD Zen 5,
``bench/products_vs_mlas.py``, weights cold, ms): 197x3072 @ 768 2.76 to 2.22 (onnxruntime 2.10),
197x768 @ 3072 2.77 to 2.16 (2.10), 32x3072 @ 768 0.51 to 0.46 (0.57).

Which implementation wins depends on the shape, so they are raced.

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

PANEL = 32  # columns per panel: two AVX-512 vectors of float32 (a register tile row two vectors wide)
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
        self.transpose = _transposition(self.a_batch, m, k, self.rows, str(dtype))
        self.a_buffer = aligned_empty((self.a_batch, m, k), dtype)  # A where its view is not contiguous
        self.t_buffer = aligned_empty((self.a_batch, k, self.rows), dtype)  # A k-major, rows past m zero
        self.c_buffer = aligned_empty((batches, self.rows, self.panels, PANEL), dtype)
        # C lands in the output as it lies: no copy (where the output is aligned)
        self.direct = (self.rows, self.panels * PANEL) == (m, n) and tuple(match.out_strides[1:]) == (n, 1)
        self.direct &= batches == 1 or match.out_strides[0] == m * n
        # or past its end, where the program leaves room there (``room``): C's rows past m spill over
        whole = batches == 1 and self.panels * PANEL == n and tuple(match.out_strides[1:]) == (n, 1)
        self.room = self.c_buffer.size if whole and not self.direct else 0

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

    def __call__(self, values: dict, out: np.ndarray, room: np.ndarray | None = None) -> None:
        """C into ``out``; with ``room`` (memory that begins where ``out`` does and that the
        caller lets the call write ``self.room`` elements of), C's padded rows too, with no copy."""
        panels = values.get(self.name)
        if panels is None:  # not bound: B changes from call to call
            panels = self.prepare(values)[self.name]
        a = operand_view(values, self.match.a)[: self.a_batch]
        if not (a.flags.c_contiguous and is_aligned(a)):
            self.a_buffer[...] = a
            a = self.a_buffer
        t = self.t_buffer
        self.transpose.run({"A": a[0] if self.a_batch == 1 else a}, t[0] if self.a_batch == 1 else t)
        arguments = {"T": t[0] if self.a_batch == 1 else t, "P": panels[0] if self.b_batch == 1 else panels}
        if self.direct and is_aligned(out):
            self.kernel.run(arguments, out.reshape(self.c_buffer.shape))
            return
        if self.room and room is not None and room.size >= self.room and is_aligned(room):
            self.kernel.run(arguments, room[: self.room].reshape(self.c_buffer.shape))
            return
        self.kernel.run(arguments, self.c_buffer)
        product = self.c_buffer.reshape(self.batches, self.rows, self.panels * PANEL)[:, : self.m, : self.n]
        target = np.lib.stride_tricks.as_strided(
            out.reshape(-1), product.shape, tuple(s * out.itemsize for s in self.match.out_strides)
        )
        np.copyto(target, product)


def _compile(a_batch: int, b_batch: int, batches: int, rows: int, k: int, panels: int, dtype: str) -> TvmKernel:
    """The product of k-major A and the panels as a scope, compiled (and cached on disk) like any other."""
    t = "T[b, k, m]" if a_batch > 1 else "T[k, m]"
    p = "P[b, j, k, l]" if b_batch > 1 else "P[j, k, l]"
    shapes = {
        "T": (a_batch, k, rows) if a_batch > 1 else (k, rows),
        "P": (b_batch, panels, k, PANEL) if b_batch > 1 else (panels, k, PANEL),
    }
    scope = parse(f"L b:{batches}, m:{rows}, j:{panels}, l:{PANEL} ; S k:{k} ; {t} * {p}", shapes)
    return compile_scope(scope, dtype=dtype)


def _transposition(a_batch: int, m: int, k: int, rows: int, dtype: str) -> TvmKernel:
    """``T[b, k, r] = A[b, r, k]`` over ``rows`` rows: the rows past A's m read as zero."""
    if a_batch > 1:
        scope = parse(f"L b:{a_batch}, k:{k}, r:{rows} ; A[b, r, k]", {"A": (a_batch, m, k)})
    else:
        scope = parse(f"L k:{k}, r:{rows} ; A[r, k]", {"A": (m, k)})
    return compile_scope(scope, dtype=dtype)


# --------------------------------------------------------------------------------------------
# One operand a weight: the product computed with the weight's rows innermost (lanes along them)


def kmajor_name(tensor: str) -> str:
    """The constant holding ``tensor`` k-major in panels (``U[fo, k, fi]``)."""
    return f"{tensor}.kmajor"


def transposed_call(kernel: Kernel, dtype: str):
    """``(values, out) -> None`` for the matmul ``kernel`` with one operand a weight whose output
    runs along the other operand (an NCHW 1x1 convolution: ``C[f, n] = W[f, :] @ X[:, n]``, in
    either order the matcher found), or None. The weight is laid out once k-major in panels of
    ``PANEL`` rows (one panel where ``PANEL`` does not divide them), ``U[fo, k, fi] =
    W[PANEL*fo + fi, k]``, the product computed with the weight's rows innermost,

        D[fo, n, fi] = S k ; X[k, n] * U[fo, k, fi]        (or X[n, k], as the other operand lies)

    with lanes along fi (a multiple of the vector in a model's convolutions, where the n of a
    14x14 or 7x7 image, 196 or 49, is not), and transposed into C by a small TVM kernel. Measured
    here (AMD EPYC, 2 cores, float32, ms; f x k x n), ResNet-50's 1x1 convolutions: 1024x256x196
    BLAS 0.48, the scope as it is (lanes along n) 0.85, this 0.37 (0.24 with the register tile's
    rows two vectors wide, ``tvm_kernel._tile_width``); 256x1024x196 0.51, 0.89 and 0.36; at
    n = 3136 the others stay ahead. The product alone, weights cold, k-major in one piece against
    panels (each panel's rows one run in memory): 256x1024x196 0.316 and 0.285, 2048x512x49
    0.401 and 0.304. Raced with the others. Where the output runs along f (a linear layer's),
    TVM's scope already has its lanes there: None."""
    match = kernel.match
    if not isinstance(match, GemmMatch) or match.batches != 1 or match.a.tensor == match.b.tensor:
        return None
    weights = [name for name, operand in (("a", match.a), ("b", match.b)) if operand.tensor in kernel.weights]
    if len(weights) != 1:
        return None
    rows, cols = match.out_strides[1:]  # C[m, n]'s; the other operand's free index is n or m
    along_other = cols == 1 if weights[0] == "a" else rows == 1
    return _Transposed(match, np.dtype(dtype), weights[0]) if along_other else None


class _Transposed:
    """The call; its buffers (the other operand contiguous where its view is not, D) are
    allocated once. D is transposed into the output by a TVM kernel where the output is whole
    (``C[f, n]`` row-major), else copied through the output's strides."""

    def __init__(self, match: GemmMatch, dtype: np.dtype, weight: str):
        self.match, self.dtype, self.weight = match, dtype, weight
        _, m, k = match.a.shape
        n = match.b.shape[2]
        # f: the weight's free extent, in panels of p; x: the other operand's
        self.f, self.x, self.k = (m, n, k) if weight == "a" else (n, m, k)
        f, x, p = self.f, self.x, self.panel
        other = "X[k, n]" if weight == "a" else "X[n, k]"
        x_shape = (k, x) if weight == "a" else (x, k)
        product = parse(
            f"L fo:{f // p}, n:{x}, fi:{p} ; S k:{k} ; {other} * U[fo, k, fi]", {"X": x_shape, "U": (f // p, k, p)}
        )
        self.product = compile_scope(product, dtype=str(dtype))
        rows, cols = match.out_strides[1:]  # C[m, n]'s strides; D's, along n and f:
        self.d_strides = (cols, rows) if weight == "a" else (rows, cols)
        self.transpose = None  # D into an output that runs along n
        if self.d_strides == (1, x):
            transpose = parse(f"L fo:{f // p}, fi:{p}, n:{x} ; D[fo, n, fi]", {"D": (f // p, x, p)})
            self.transpose = compile_scope(transpose, dtype=str(dtype))
        self.x_buffer = aligned_empty(x_shape, dtype)
        self.d_buffer = aligned_empty((f // p, x, p), dtype)

    @property
    def panel(self) -> int:
        return PANEL if self.f % PANEL == 0 else self.f

    @property
    def name(self) -> str:
        return kmajor_name((self.match.a if self.weight == "a" else self.match.b).tensor)

    def prepare(self, values: dict) -> dict[str, np.ndarray]:
        """The weight in panels (none where ``values`` lacks it), to keep with the program's constants."""
        operand = self.match.a if self.weight == "a" else self.match.b
        if operand.tensor not in values:
            return {}
        view = operand_view(values, operand)[0]
        kmajor = view.T if self.weight == "a" else view  # U[k, f]
        panels = aligned_empty((self.f // self.panel, self.k, self.panel), self.dtype)
        panels[...] = kmajor.reshape(self.k, self.f // self.panel, self.panel).transpose(1, 0, 2)
        return {self.name: panels}

    def __call__(self, values: dict, out: np.ndarray) -> None:
        u = values.get(self.name)
        if u is None:  # not bound: the weight changes from call to call
            u = self.prepare(values)[self.name]
        x = operand_view(values, self.match.b if self.weight == "a" else self.match.a)[0]
        if not (x.flags.c_contiguous and is_aligned(x)):
            self.x_buffer[...] = x
            x = self.x_buffer
        self.product.run({"X": x, "U": u}, self.d_buffer)
        if out.size == self.f * self.x and is_aligned(out) and self.transpose is not None:
            self.transpose.run({"D": self.d_buffer}, out.reshape(self.f // self.panel, self.panel, self.x))
            return
        along_n, along_f = (s * out.itemsize for s in self.d_strides)
        shape = (self.f // self.panel, self.x, self.panel)
        target = np.lib.stride_tricks.as_strided(out.reshape(-1), shape, (self.panel * along_f, along_n, along_f))
        np.copyto(target, self.d_buffer)
