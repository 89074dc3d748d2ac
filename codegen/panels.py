"""A convolution whose weight is a model weight: the weight laid out once in panels of output
channels, and the convolution computed directly over them (no column matrix).

For a matched convolution without groups (a ``ConvMatch``), ``out[.., f, ..] = S c, r, s ;
X[..] * W[f, c, r, s]`` with W a weight (``Kernel.weights``), W is copied once, when the
program's weights are bound, into panels of p output channels,
``P[j, c, r, s, l] = W[p*j + l, c, r, s]`` (zero past the last channel), and the convolution
is the scope

    O[j, <the output's other iterators>, l] = S c, r, s ; X[..] * P[j, c, r, s, l]

compiled by TVM like any other (``compile_scope``: lanes along l, so each step of the sum
reads one vector of the weight, contiguous, and broadcasts one input element; a register tile
of rows that share the input element), followed by a small TVM kernel that transposes O into
the output's layout; for an eOperator with the convolution inside it, that kernel computes the
eOperator's epilogue too (``epilogue.LaidOut``). This is the direct convolution of
onnxruntime's MLAS (NCHWc), with the blocking on the weight only: the input and the output keep
the model's layout. Measured here
(``bench/products_vs_mlas.py``: AMD EPYC, 2 cores, float32, weights cold, ms), ResNet-50's 3x3
convolutions, C -> C channels at H x H, padding 1, batch 1, NCHW:

    ============= ====== ===== ====== ===========
    C, H          im2col TVM   panels onnxruntime
    ============= ====== ===== ====== ===========
    64, 56         1.70   1.24  2.50   1.06
    128, 28        1.47   2.91  1.16   1.06
    256, 14        1.75   1.89  1.09   1.08
    512, 7         2.11   1.99  1.24   1.26
    ============= ====== ===== ====== ===========

With 64 output channels the register tile runs along the 4 panels, too few rows. The
implementations are raced.

A panel is as wide as the register tile's rows (``channels_per_panel``): ``LINE`` channels (a
64-byte line of float32) where the tile's rows are that wide, else one vector. With AVX2's 8
lanes, a tile one vector wide over 16-channel panels loaded each line of the weight for half of
it, and the other half again in the next tile. Measured on AMD EPYC (Zen 3), weights warm, ms:

    =========== ========== ========= ===========================
    C, H        16 lanes   8 lanes   onnxruntime (NCHW in, out)
    =========== ========== ========= ===========================
    256, 14      1.90-1.93  1.66      1.60-1.69
    512, 7       2.08       1.78      1.68-2.03
    128, 28      1.52       1.60      1.66
    64, 56       2.42       2.77      2.58
    =========== ========== ========= ===========================

At 28 and 56 columns the tile's rows are two vectors wide (4 rows of 16 lanes), at 14 and 7 one
(7 rows of 8). On AVX-512 a vector is the line: panels of 16 either way.

``panels_call(kernel, dtype)`` returns the call, or None where the convolution has groups, its
weight is no weight, or an iterator does not start at 0. The call's ``prepare(values)`` gives
the panels to keep with the program's constants (``bind``); without them it lays out W itself
on every call (slower).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from rewriter.index import affine_coefficients
from rewriter.ir import Access, Binary, Scope, Tensor, index_vars, parse
from rewriter.lower import ConvMatch, Kernel, inner_product

from .epilogue import LaidOut
from .native import arguments
from .tvm_kernel import aligned_copy, aligned_empty, compile_scope, is_aligned, native_lanes, tile_vectors

LINE = 16  # output channels in a 64-byte line of float32: the widest panel


def panels_name(tensor: str, order: Sequence[int], width: int) -> str:
    """The constant holding ``tensor``'s panels ``width`` channels wide, its axes taken in
    ``order`` (the channel's first): named by the order and width too, since another kernel may
    lay the same weight out another way (see ``packed.packed_name``)."""
    return f"{tensor}.conv_panels{''.join(map(str, order))}w{width}"


def panels_call(kernel: Kernel, dtype: str):
    """``(values, out) -> None`` for the convolution ``kernel``, or an eOperator with one inside
    it and its epilogue around it (``inner_product``: the epilogue computed where the product
    is laid out into the output, ``epilogue.LaidOut``), over its weight's panels; or None."""
    found = inner_product(kernel)
    if found is None:
        return None
    position, product = found
    match, scope = product.match, product.expr
    if not isinstance(match, ConvMatch) or match.weight not in product.weights or match.input in product.weights:
        return None
    if not isinstance(scope, Scope) or any(it.lo != 0 for it in scope.iterators):
        return None
    body = scope.body
    if not (isinstance(body, Binary) and body.op == "*"):
        return None
    sides = (body.lhs, body.rhs)
    if not all(isinstance(side, Access) and isinstance(side.source, Tensor) for side in sides):
        return None
    reads = {side.source.name: side for side in sides}
    x, w = reads[match.input], reads[match.weight]
    weight_axes = [_single_iterator(ix) for ix in w.indices]  # the weight: one iterator per dimension
    read_by_x = set().union(*(index_vars(ix) for ix in x.indices))
    channels = [it.name for it in scope.traversal if it.name in weight_axes]
    summed = [it.name for it in scope.summation]
    if None in weight_axes or len(channels) != 1 or channels[0] in read_by_x:
        return None  # groups (a traversal iterator both read), or a weight read other than W[f, c, r, s]
    if sorted(weight_axes) != sorted(channels + summed):
        return None
    return _Panels(kernel.expr, position, scope, x, w, channels[0], weight_axes, np.dtype(dtype))


def _single_iterator(ix) -> str | None:
    """The iterator an index is, where it is one iterator with coefficient 1 and offset 0."""
    form = affine_coefficients(ix)
    if form is None or form[1] != 0 or len(form[0]) != 1:
        return None
    (name, coefficient), *_ = form[0].items()
    return name if coefficient == 1 else None


class _Panels:
    """The call; its buffer (the product in panels) is allocated once."""

    def __init__(
        self,
        expr: Scope,
        position: tuple[int, ...],
        scope: Scope,
        x: Access,
        w: Access,
        channel: str,
        weight_axes: list[str],
        dtype: np.dtype,
    ):
        self.input, self.weight, self.dtype = x.source.name, w.source.name, dtype
        sizes = {it.name: it.size for it in scope.iterators}
        self.channels = sizes[channel]
        summed = [it.name for it in scope.summation]
        # W's axes in the panels' order: the channel, then the summed iterators in scope order
        self.order = [weight_axes.index(channel)] + [weight_axes.index(n) for n in summed]
        self.summed_shape = tuple(sizes[n] for n in summed)
        self.width = channels_per_panel(lambda width: self._product(scope, x, channel, width), str(dtype))
        self.panels = math.ceil(self.channels / self.width)
        product = self._product(scope, x, channel, self.width)
        self.product = compile_scope(product, dtype=str(dtype))
        buffer = aligned_empty(product.shape, dtype)
        self.laid_out = LaidOut(expr, position, _product_indices(scope, channel, self.width), buffer)
        self.native = (  # run natively where the panels are bound (a program's constants)
            (
                self.product.function,
                (*arguments(self.product, X=self.input, P=self.name), buffer),
                self.product.views,
            ),
            self.laid_out.native,
        )

    def _product(self, scope: Scope, x: Access, channel: str, width: int) -> Scope:
        """The convolution over panels ``width`` channels wide, P[j, <summed>, l]."""
        others = [it for it in scope.traversal if it.name != channel]
        summed = [it.name for it in scope.summation]
        panels, panel, lane = math.ceil(self.channels / width), _fresh("j", scope), _fresh("l", scope)
        return parse(
            f"L {', '.join([f'{panel}:{panels}', *map(str, others), f'{lane}:{width}'])} ; "
            f"S {', '.join(map(str, scope.summation))} ; "
            f"X[{', '.join(map(str, x.indices))}] * P[{', '.join([panel, *summed, lane])}]",
            {"X": x.source.shape, "P": (panels, *self.summed_shape, width)},
        )

    @property
    def name(self) -> str:
        return panels_name(self.weight, self.order, self.width)

    def prepare(self, values: dict) -> dict[str, np.ndarray]:
        """W's panels (none where ``values`` lacks W), to keep with the program's constants."""
        if self.weight not in values:
            return {}
        weight = np.asarray(values[self.weight]).transpose(self.order)
        wide = np.zeros((self.panels * self.width, *self.summed_shape), self.dtype)  # zero past the last channel
        wide[: self.channels] = weight
        panels = wide.reshape(self.panels, self.width, *self.summed_shape)
        return {self.name: aligned_copy(np.moveaxis(panels, 1, -1), self.dtype)}

    def __call__(self, values: dict, out: np.ndarray) -> None:
        panels = values.get(self.name)
        if panels is None:  # not bound: W changes from call to call
            panels = self.prepare(values)[self.name]
        x = values[self.input]
        if not is_aligned(x):
            x = aligned_copy(x, self.dtype)
        self.product.run({"X": x, "P": panels}, self.laid_out.buffer)
        self.laid_out(values, out)


def channels_per_panel(product: Callable[[int], Scope], dtype: str) -> int:
    """Channels per panel for the convolution ``product(width)`` over panels that wide: a line
    (``LINE``) where the register tile's rows span it, else one vector of this CPU."""
    lanes = native_lanes(dtype)
    if lanes >= LINE or tile_vectors(product(LINE), dtype) * lanes >= LINE:
        return LINE
    return lanes


def _product_indices(scope: Scope, channel: str, width: int) -> list[str]:
    """Where the output's element at the scope's iterators lies in the product in panels."""
    others = [it.name for it in scope.traversal if it.name != channel]
    return [f"{channel}/{width}", *others, f"{channel}%{width}"]


def _fresh(stem: str, scope: Scope) -> str:
    """An iterator name the scope does not use."""
    taken = {it.name for it in scope.iterators}
    return next(f"{stem}{k}" for k in range(len(taken) + 1) if f"{stem}{k}" not in taken)
