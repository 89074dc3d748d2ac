"""A product computed in a layout of its own, laid out into the kernel's output by one pass that
computes the kernel's epilogue too.

Two implementations compute a product over a weight in a layout that suits their vector lanes
and lay it out afterwards: the transposed product (``packed.transposed_call``: ``D[fo, n, fi]``,
lanes along the weight's rows) and the convolution over panels (``panels.panels_call``:
``O[j, .., l]``, lanes along the output channels). Both serve a plain product, and an eOperator
with one product inside it (``rewriter.lower.inner_product``): a bias, an activation, a residual
sum around it. The pass that lays the product out is then the kernel's own expression with the
product read from the buffer (a nested scope that only re-indexes, which ``compile_scope``
inlines), so the epilogue costs no pass of its own: it reads the product where the layout pass
reads it anyway. For a plain product that expression is the view alone, the layout pass itself.

Measured here (AMD Zen 5, 2 cores, float32, weights cold, ms; ``bench/products_vs_mlas.py
--epilogue``, a bias and a ReLU around each convolution, all in one eOperator): TVM's kernel of
the whole eOperator, this, and onnxruntime's Conv with its bias and Relu fused: ResNet-50's
3x3 64x56x56 0.588, 0.547 (panels), 0.526; 256x14x14 0.633, 0.511, 0.519; its 1x1 1024 -> 256
at 14x14 0.452, 0.256 (transposed), 0.249; MobileNetV2's 320 -> 1280 at 7x7 0.176, 0.151,
0.143. Before, such eOperators had TVM's kernel only, or the product and its epilogue apart
(the epilogue a pass of its own: 0.07 ms at 64x56x56, in ResNet-50).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from rewriter.ir import Scope, parse, replace_at, scopes_at, tensor_shapes

from .native import OUTPUT
from .tvm_kernel import compile_scope, is_aligned, viewed


class LaidOut:
    """``expr`` with its product (the scope at ``position``) read from ``buffer`` at ``indices``
    (index expressions over the product's traversal iterators), compiled once."""

    def __init__(self, expr: Scope, position: tuple[int, ...], indices: Sequence[str], buffer: np.ndarray):
        product = dict(scopes_at(expr))[position]
        taken = set(tensor_shapes(expr))
        self.name = next(f"D{k}" for k in itertools.count() if f"D{k}" not in taken)
        view = parse(
            f"L {', '.join(map(str, product.traversal))} ; {self.name}[{', '.join(indices)}]",
            {self.name: buffer.shape},
        )
        self.kernel = compile_scope(replace_at(expr, position, view), dtype=str(buffer.dtype))
        self.buffer = buffer

    @property
    def native(self) -> tuple:
        """The pass as a native call (``native.NativeRun``): the buffer bound, the rest by name."""
        given = tuple(self.buffer if name == self.name else name for name in self.kernel.inputs)
        return (self.kernel.function, (*given, OUTPUT), self.kernel.views)

    def __call__(self, values: dict, out: np.ndarray) -> None:
        arrays = {**values, self.name: self.buffer}
        args = [arrays[name] for name in self.kernel.inputs]
        if is_aligned(out) and all(is_aligned(a) for a in args):
            self.kernel.function(*viewed([*args, out], self.kernel.views))
        else:  # (a caller's own arrays: copied aligned)
            out[...] = self.kernel(**dict(zip(self.kernel.inputs, args)))
