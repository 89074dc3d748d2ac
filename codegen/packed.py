"""A matrix product over a weight, the weight laid out once: in panels (``packed_call``), or
k-major with the product computed transposed (``transposed_call``, below).

For a matched ``C[b, m, n] = A[b, m, :] @ B[b, :, n]`` (a ``GemmMatch``) whose B is a model
weight (``Kernel.weights``), the weight is copied once, when the program's weights are bound, into
panels of ``PANEL`` columns, ``P[b, j, k, l] = B[b, k, PANEL*j + l]`` (zero past the last
column), so that each step of the sum reads one contiguous vector and the whole weight streams
from memory in order. A is read as it lies. The product is then the scope

    C[b, m, j, l] = S k ; A[b, m, k] * P[b, j, k, l]        (C is the output, in whole panels)

compiled by TVM like any other (``compile_scope``: lanes along l, a register tile of rows of m
sharing each panel vector; where no divisor of m makes a tile, the last one is guarded). This
is how onnxruntime's MLAS runs a MatMul with a constant weight; the BLAS call (numpy's) copies
the weight into its own panels on every call.

A panel is two vectors wide (32 columns of float32), so each row of the register tile is two
vectors sharing one broadcast read of A. Against one-vector panels (AMD Zen 5,
``bench/products_vs_mlas.py``, weights cold, ms): 197x3072 @ 768 2.76 to 2.22 (onnxruntime 2.10),
197x768 @ 3072 2.77 to 2.16 (2.10), 32x3072 @ 768 0.51 to 0.46 (0.57).

A was once laid out k-major first (``T[b, k, m] = A[b, m, k]``, by a small transposition kernel
on every call), since on an older machine (AMD EPYC) the tile's rows read as A lies, K floats
apart, mapped to one set of the 8-way L1 cache and evicted each other (197x3072 @ 768: 4.66 ms
as A lies, 4.58 k-major including the transposition). On this one (Zen 5, 12-way L1) A as it lies
is faster and the transposition goes: ms per call, weights cold, the two interleaved in one
process, k-major then as it lies: 197x3072 @ 768 2.55 to 2.06, 197x768 @ 3072 2.20 to 1.94,
32x3072 @ 768 0.78 to 0.68, 3136x384 @ 96 1.18 to 0.90. In a model the transposition cost more
than alone: ViT-Base's 197x3072 one took 0.31 ms where the program ran it, 0.10 ms alone.

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
    """The call; its buffers (A where its view is not contiguous, C in whole panels where the
    output is not) are allocated once."""

    def __init__(self, match: GemmMatch, dtype: np.dtype):
        self.match, self.dtype = match, dtype
        batches, m, k = match.a.shape
        n = match.b.shape[2]
        self.m, self.k, self.n = m, k, n
        self.panels = math.ceil(n / PANEL)
        # an operand broadcast over the batch (stride 0) is kept once
        self.a_batch = 1 if match.a.strides[0] == 0 else batches
        self.b_batch = 1 if match.b.strides[0] == 0 else batches
        self.batches = batches
        self.kernel = _compile(self.a_batch, self.b_batch, batches, m, k, self.panels, str(dtype))
        self.a_buffer = aligned_empty((self.a_batch, m, k), dtype)  # A where its view is not contiguous
        self.c_buffer = aligned_empty((batches, m, self.panels, PANEL), dtype)
        # C lands in the output as it lies: no copy (where the output is aligned)
        self.direct = self.panels * PANEL == n and tuple(match.out_strides[1:]) == (n, 1)
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
        if not (a.flags.c_contiguous and is_aligned(a)):
            self.a_buffer[...] = a
            a = self.a_buffer
        arguments = {"A": a[0] if self.a_batch == 1 else a, "P": panels[0] if self.b_batch == 1 else panels}
        if self.direct and is_aligned(out):
            self.kernel.run(arguments, out.reshape(self.c_buffer.shape))
            return
        self.kernel.run(arguments, self.c_buffer)
        product = self.c_buffer.reshape(self.batches, self.m, self.panels * PANEL)[:, :, : self.n]
        target = np.lib.stride_tricks.as_strided(
            out.reshape(-1), product.shape, tuple(s * out.itemsize for s in self.match.out_strides)
        )
        np.copyto(target, product)


def _compile(a_batch: int, b_batch: int, batches: int, m: int, k: int, panels: int, dtype: str) -> TvmKernel:
    """The product of A and the panels as a scope, compiled (and cached on disk) like any other."""
    a = "A[b, m, k]" if a_batch > 1 else "A[m, k]"
    p = "P[b, j, k, l]" if b_batch > 1 else "P[j, k, l]"
    shapes = {
        "A": (a_batch, m, k) if a_batch > 1 else (m, k),
        "P": (b_batch, panels, k, PANEL) if b_batch > 1 else (panels, k, PANEL),
    }
    scope = parse(f"L b:{batches}, m:{m}, j:{panels}, l:{PANEL} ; S k:{k} ; {a} * {p}", shapes)
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
