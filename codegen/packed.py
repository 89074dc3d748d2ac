"""A product over a weight, the weight laid out once: in panels along the product's lanes
(``packed_call``), or k-major with the product computed transposed (``transposed_call``, below).

A kernel that sums over a weight ``W`` read along its vector lanes (a Matmul's ``B[k, j]``, or
an eOperator with that product inside it and its epilogue around it: a bias, a GELU) reads W
from panels of p columns along the lanes' dimension, ``P[jo, k, l] = W[k, p*jo + l]``
(``tvm_kernel.panel_layout``; other dimensions of W kept between), copied once, when the
program's weights are bound. Each step of the sum then reads one contiguous run of the panel,
and the whole weight streams from memory in order; reading W as it lies, each step reads two
vectors N floats past the last step's. The kernel is the kernel's own scope, compiled by TVM like
any other, its schedule naming W as given in panels (``Schedule.panels``): TVM's index arithmetic
turns ``P[j / p, k, j % p]`` back into whole vectors, since a register tile's row of two
vectors (``_tile_width``) is one panel. The other operand is read as it lies. This is how
onnxruntime's MLAS runs a MatMul with a constant weight; the BLAS call (numpy's) copies the
weight into its own panels on every call. Measured here (AMD Zen 5, ``bench/products_vs_mlas.py``,
weights cold, ms): 197x3072 @ 768 2.52 as it lies, 1.95 in panels (onnxruntime 2.05).

A panel is as wide as the kernel's register tile's rows (``panels_width``), mostly two
vectors (``tvm_kernel.panel_width``: 32 columns of float32 on AVX-512, 16 on AVX2), so each row
of the tile is two vectors sharing one broadcast read of the other operand. Against one-vector
panels: 197x3072 @ 768 2.76 to 2.22 (onnxruntime 2.10), 197x768 @ 3072 2.77 to 2.16 (2.10),
32x3072 @ 768 0.51 to 0.46 (0.57). Where the tile's rows are one vector (a blocked layout's
1x1 convolution over 7x7 pixels, ``tvm_kernel._columns``), so are the panels; where they are
three (AVX2, rows that 4 divide and 6 do not: ``tvm_kernel._THREE_WIDE``), 24 columns; where
they are six (AVX-512, rows that two-vector tiles take no deeper than 8: ``tvm_kernel.wide_tile``),
96 columns. That tile is a second implementation (``packed_wide_call``), raced against the
default one, since which is faster depends on the CPU (``tvm_kernel._SIX_WIDE``).

The other operand was once laid out k-major first (``T[k, m] = A[m, k]``, by a small
transposition kernel on every call), since on an older machine (AMD EPYC) a register tile's
rows read as A lies, K floats apart, mapped to one set of the 8-way L1 cache and evicted each
other (197x3072 @ 768: 4.66 ms as A lies, 4.58 k-major including the transposition). On this
one (Zen 5, 12-way L1) A as it lies is faster and the transposition went: ms per call, weights
cold, the two interleaved in one process, k-major then as it lies: 197x3072 @ 768 2.55 to 2.06,
197x768 @ 3072 2.20 to 1.94, 32x3072 @ 768 0.78 to 0.68, 3136x384 @ 96 1.18 to 0.90. In a model
the transposition cost more than alone: ViT-Base's 197x3072 one took 0.31 ms where the program
ran it, 0.10 ms alone.

Which implementation wins depends on the shape, so they are raced.

``packed_call(kernel, dtype)`` returns the call, or None where no weight is read so. The call's
``prepare(values)`` gives the panels to keep with the program's constants (``bind``); the call
lays a weight out itself (every call, slower) only where they are missing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from rewriter.index import affine_coefficients, index_bounds, row_major
from rewriter.ir import Scope, Tensor, Var, accesses, distinct_scopes, index_vars, parse, tensor_shapes
from rewriter.lower import GemmMatch, Kernel, Operand, inner_product, operand_view

from .epilogue import LaidOut
from .native import OUTPUT, arguments
from .tvm_kernel import (
    Schedule,
    aligned_empty,
    compile_scope,
    is_aligned,
    native_lanes,
    panel_layout,
    panel_width,
    tile_vectors,
    viewed,
    wide_tile,
)


def packed_name(tensor: str, dim: int, width: int) -> str:
    """The constant holding ``tensor``'s panels ``width`` wide along dimension ``dim``. A
    program's laid-out weights share one namespace, and two kernels may lay one weight out along
    different dimensions (a 768x768 one read as ``W[k, j]`` and as ``W[j, k]``: panels of the
    same shape), or in panels of another width."""
    return f"{tensor}.panels{dim}w{width}"


def packed_call(kernel: Kernel, dtype: str, schedule: Schedule | None = None):
    """``(values, out) -> None`` for ``kernel`` with its weights read along its lanes in panels
    as wide as its register tile's rows under ``schedule`` (the default one; ``panels_width``),
    or None where it reads none so."""
    schedule = schedule or Schedule()
    width = panels_width(kernel.expr, dtype, schedule)
    found = {name: _lanes_dimension(kernel.expr, name, width) for name in sorted(kernel.weights)}
    panels = tuple((name, dim, width) for name, dim in found.items() if dim is not None)
    return _Packed(kernel, np.dtype(dtype), replace(schedule, panels=panels)) if panels else None


def packed_wide_call(kernel: Kernel, dtype: str):
    """``packed_call`` with the register tile in rows of six vectors (``tvm_kernel.wide_tile``),
    or None where that tile makes no more accumulators than the default one."""
    wide = wide_tile(kernel.expr, dtype)
    return packed_call(kernel, dtype, wide) if wide is not None else None


def panels_width(expr: Scope, dtype: str, schedule: Schedule | None = None) -> int:
    """A panel's width for ``expr``: its register tile's row under ``schedule``
    (``tvm_kernel.tile_vectors``): two vectors (``panel_width``), three where 4 rows of three
    tile it on AVX2 (a transformer's 32 tokens), six in ``wide_tile``'s rows, or one. A tile one
    vector wide over panels of two (an NCHW8c 1x1 convolution over 7x7, its rows one block of
    output channels) used half of each line of the weight it loaded and the other half in the
    next tile: measured on AMD EPYC (Zen 3, AVX2), weights cold, panels of 16 against 8
    interleaved in one process, 2048 -> 512 channels 1.09 to 0.93 ms, 512 -> 2048 1.00 to
    0.92."""
    return tile_vectors(expr, dtype, schedule=schedule) * native_lanes(dtype)


def _lanes_dimension(expr: Scope, name: str, width: int) -> int | None:
    """The dimension of tensor ``name`` that every read of it indexes by the innermost traversal
    iterator (the vector lanes) of a scope that sums, within its bounds; None where some read
    does not (a view of it, a read along another loop, one that may fall outside)."""
    found = set()
    for scope in distinct_scopes(expr):
        for access in accesses(scope.body):
            if not (isinstance(access.source, Tensor) and access.source.name == name):
                continue
            if not scope.summation or not scope.traversal or access.source.rank < 2:
                return None
            lanes = scope.traversal[-1]
            dims = [d for d, ix in enumerate(access.indices) if _runs_along(ix, lanes, width)]
            if len(dims) != 1 or sum(lanes.name in index_vars(ix) for ix in access.indices) != 1:
                return None
            for ix, size in zip(access.indices, access.source.shape):
                lo, hi = index_bounds(ix, scope.box)
                if lo < 0 or hi >= size:
                    return None
            found.add(dims[0])
    return found.pop() if len(found) == 1 else None


def _runs_along(ix, lanes, width: int) -> bool:
    """Whether index ``ix`` steps by one along iterator ``lanes`` and its vector stays in one
    panel ``width`` wide: ``j``, or ``j + 16*jo`` (a weight's rows read by a blocked layout's
    channels) where the lanes' extent divides every other step and the panel's width."""
    if ix == Var(lanes.name):
        return True
    form = affine_coefficients(ix)
    if form is None or form[0].get(lanes.name) != 1:
        return False
    steps = [c for name, c in form[0].items() if name != lanes.name] + [form[1], width]
    return lanes.lo == 0 and all(step % lanes.size == 0 for step in steps)


class _Packed:
    """The call: the kernel's own scope compiled with ``panels`` read from their layout."""

    def __init__(self, kernel: Kernel, dtype: np.dtype, schedule: Schedule):
        self.dtype, self.panels = dtype, schedule.panels
        self.compiled = compile_scope(kernel.expr, dtype=str(dtype), schedule=schedule)
        laid = {name: (dim, width) for name, dim, width in self.panels}
        self.names = [
            (packed_name(n, *laid[n]), n, laid[n]) if n in laid else (n, n, None) for n in self.compiled.inputs
        ]
        # run natively where the panels are bound (a program's constants); else from Python, laid out each call
        self.native = ((self.compiled.function, (*(given for given, _, _ in self.names), OUTPUT), self.compiled.views),)

    def prepare(self, values: dict) -> dict[str, np.ndarray]:
        """The panels of the weights ``values`` holds, to keep with the program's constants."""
        return {
            packed_name(n, d, w): panel_layout(values[n], d, self.dtype, w) for n, d, w in self.panels if n in values
        }

    def __call__(self, values: dict, out: np.ndarray) -> None:
        arguments = [
            values[given]
            if given in values
            else panel_layout(values[name], laid[0], self.dtype, laid[1])  # not bound: every call
            for given, name, laid in self.names
        ]
        self.compiled.function(*viewed([*arguments, out], self.compiled.views))


# --------------------------------------------------------------------------------------------
# One operand a weight: the product computed with the weight's rows innermost (lanes along them)


def kmajor_name(operand: Operand, role: str) -> str:
    """The constant holding the weight ``operand`` (the product's operand ``role``, "a" or "b")
    k-major in panels (``U[fo, k, fi]``): named by its view too, since another kernel may read
    the same weight through another view (see ``packed_name``)."""
    return f"{operand.tensor}.kmajor.{role}.{operand.offset}.{'.'.join(map(str, operand.strides))}"


def transposed_call(kernel: Kernel, dtype: str):
    """``(values, out) -> None`` for the matmul ``kernel`` with one operand a weight whose output
    runs along the other operand (an NCHW 1x1 convolution: ``C[f, n] = W[f, :] @ X[:, n]``, in
    either order the matcher found), or an eOperator with such a product inside it and its
    epilogue around it (``inner_product``); else None. The weight is laid out once k-major in
    panels of p = ``panel_width()`` rows (one panel where p does not divide them), ``U[fo, k, fi] =
    W[p*fo + fi, k]``, the product computed with the weight's rows innermost,

        D[fo, n, fi] = S k ; X[k, n] * U[fo, k, fi]        (or X[n, k], as the other operand lies)

    with lanes along fi (a multiple of the vector in a model's convolutions, where the n of a
    14x14 or 7x7 image, 196 or 49, is not), and laid out into the output by a small TVM kernel
    that computes the epilogue too (``epilogue.LaidOut``). Measured here (AMD EPYC, 2 cores,
    float32, ms; f x k x n), ResNet-50's 1x1 convolutions: 1024x256x196 BLAS 0.48, the scope as
    it is (lanes along n) 0.85, this 0.37 (0.24 with the register tile's rows two vectors wide,
    ``tvm_kernel._tile_width``); 256x1024x196 0.51, 0.89 and 0.36; at n = 3136 the others stay
    ahead. The product alone, weights cold, k-major in one piece against panels (each panel's
    rows one run in memory): 256x1024x196 0.316 and 0.285, 2048x512x49 0.401 and 0.304. Raced
    with the others. Where the output runs along f (a linear layer's), TVM's scope already has
    its lanes there: None."""
    found = inner_product(kernel)
    if found is None:
        return None
    position, product = found
    match = product.match
    if not isinstance(match, GemmMatch) or match.batches != 1 or match.a.tensor == match.b.tensor:
        return None
    weights = [name for name, operand in (("a", match.a), ("b", match.b)) if operand.tensor in product.weights]
    if len(weights) != 1:
        return None
    rows, cols = match.out_strides[1:]  # C[m, n]'s; the other operand's free index is n or m
    along_other = cols == 1 if weights[0] == "a" else rows == 1
    return _Transposed(kernel, position, product, np.dtype(dtype), weights[0]) if along_other else None


class _Transposed:
    """The call; its buffers (the other operand contiguous where its view is not, D) are
    allocated once."""

    def __init__(self, kernel: Kernel, position: tuple[int, ...], product: Kernel, dtype: np.dtype, weight: str):
        match = product.match
        self.match, self.dtype, self.weight = match, dtype, weight
        _, m, k = match.a.shape
        n = match.b.shape[2]
        # f: the weight's free extent, in panels of p; x: the other operand's
        self.f, self.x, self.k = (m, n, k) if weight == "a" else (n, m, k)
        f, x, p = self.f, self.x, self.panel
        self.kmajor = self._along_k_first()
        other = "X[k, n]" if self.kmajor else "X[n, k]"
        x_shape = (k, x) if self.kmajor else (x, k)
        scope = parse(
            f"L fo:{f // p}, n:{x}, fi:{p} ; S k:{k} ; {other} * U[fo, k, fi]", {"X": x_shape, "U": (f // p, k, p)}
        )
        self.product = compile_scope(scope, dtype=str(dtype))
        self.x_buffer = aligned_empty(x_shape, dtype)
        rows, cols = _free_indices(product.expr, match)
        along_f, along_x = (rows, cols) if weight == "a" else (cols, rows)
        indices = [f"({along_f}) / {p}", along_x, f"({along_f}) % {p}"]
        self.laid_out = LaidOut(kernel.expr, position, indices, aligned_empty((f // p, x, p), dtype))
        self.native = self._native(product, x_shape)

    @property
    def _other(self) -> Operand:
        return self.match.b if self.weight == "a" else self.match.a

    def _strides(self) -> tuple[int, int]:
        """The other operand's strides along k and along x, in elements."""
        rows, cols = self._other.strides[1:]  # B[k, n]'s, or A[m, k]'s
        return (rows, cols) if self.weight == "a" else (cols, rows)

    def _along_k_first(self) -> bool:
        """Whether X is read k-major (``X[k, n]``): where its tensor lies so, or runs along
        neither; ``X[n, k]`` where it runs along k. An NCHW 1x1 convolution's input lies
        k-major whichever operand the matcher made it (read the other way, it was copied
        transposed on every call: ResNet-50's 1024 x 196 input, 0.13 ms of 0.35)."""
        along_k, along_x = self._strides()
        return not (along_k == 1 and along_x != 1)

    def _view(self, values: dict) -> np.ndarray:
        """X as the product reads it: (k, x) where k-major, else (x, k); a strided view."""
        view = operand_view(values, self._other)[0]  # (k, x) for weight a, (x, k) for weight b
        return view if (self.weight == "a") == self.kmajor else view.T

    def _native(self, product: Kernel, x_shape: tuple[int, int]) -> tuple | None:
        """The product and its layout pass as native calls, where X is its tensor as it lies;
        None where a copy is made from Python."""
        other = self._other
        along_k, along_x = self._strides()
        whole = other.offset == 0 and ((along_k, along_x) if self.kmajor else (along_x, along_k)) == (x_shape[1], 1)
        if not whole or math.prod(tensor_shapes(product.expr)[other.tensor]) != math.prod(x_shape):
            return None
        return (
            (
                self.product.function,
                arguments(self.product, X=other.tensor, U=self.name) + (self.laid_out.buffer,),
                self.product.views,
            ),
            self.laid_out.native,
        )

    @property
    def panel(self) -> int:
        width = panel_width()
        return width if self.f % width == 0 else self.f

    @property
    def name(self) -> str:
        return kmajor_name(self.match.a if self.weight == "a" else self.match.b, self.weight)

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
        x = self._view(values)
        if not (x.flags.c_contiguous and is_aligned(x)):
            self.x_buffer[...] = x
            x = self.x_buffer
        self.product.run({"X": x, "U": u}, self.laid_out.buffer)
        self.laid_out(values, out)


def _free_indices(scope: Scope, match: GemmMatch) -> tuple[str, str]:
    """C[m, n]'s m and n as index expressions over the product scope's traversal iterators:
    each iterator, at its row-major stride in the scope's output, is part of whichever of m
    and n that stride lies within (batches are 1 here)."""
    _, rows, cols = match.out_strides
    terms: dict[str, list[str]] = {"m": [], "n": []}
    for it, stride in zip(scope.traversal, row_major(scope.shape)):
        if it.size == 1:
            continue
        outer, inner = ("m", "n") if rows > cols else ("n", "m")  # (a part of extent 1 has stride 0)
        part = outer if stride >= max(rows, cols) else inner
        unit = rows if part == "m" else cols
        at = it.name if it.lo == 0 else f"({it.name} - {it.lo})" if it.lo > 0 else f"({it.name} + {-it.lo})"
        terms[part].append(f"{stride // unit}*{at}")
    return " + ".join(terms["m"]) or "0", " + ".join(terms["n"]) or "0"
