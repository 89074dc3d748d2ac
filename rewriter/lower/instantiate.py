"""Expression instantiation (OLLIE 4.3): every scope of an expression becomes a kernel.

``instantiate(expr)`` turns the scopes of ``expr``, innermost first, into kernels: a matched
operator where one of the records matches (``rewriter.lower.operators``, by its iterator mapping
table); failing that, the operator matched on operands re-laid out by layout eOperators that
split or merge dimensions (``rewriter.lower.layouts``, Equations (3)-(4)); else an eOperator
(the scope itself, for codegen to compile). The result is a ``Candidate``: kernels in execution
order.
"""

from __future__ import annotations

import math

from rewriter.ir import Access, Scalar, Scope, Tensor, map_accesses

from .kernels import Candidate, Kernel
from .layouts import operand_layouts, split_layouts
from .operators import GemmMatch, match_operator
from .tables import operand_orders


def instantiate(expr: Scope, relayout: bool = False, operators=None) -> Candidate:
    """Every scope of ``expr`` (innermost first) as a kernel; nested scopes become tensors.

    ``operators``: the records to match (default: the registered ``OPERATORS``), in order.
    With ``relayout``, a product that matches only as a BatchMatmul of many small batches (or
    no operator) reads its operands through layout eOperators that split their strided
    dimensions (``split_layouts``) and order their dimensions as one larger Matmul wants
    (``operand_layouts``): a copy against a better GEMM, which measurement decides (``derive``
    instantiates its best states both ways)."""
    lowering = _Lowering(None if operators is None else tuple(operators), relayout)
    root = lowering.lift(expr, {})
    lowering.emit(root, "out")
    return Candidate(lowering.kernels)


def wants_operator(scope: Scope, operators=None) -> bool:
    """Whether ``scope`` has an operator's shape (a product of two tensor reads) but no
    operator table matches it yet: what guided derivation works on."""
    return bool(operand_orders(scope)) and match_operator(scope, operators)[0] == "eop"


class _Lowering:
    """The kernels of one expression, emitted in execution order, with fresh tensor names."""

    def __init__(self, operators, relayout: bool):
        self.operators, self.relayout = operators, relayout
        self.kernels: list[Kernel] = []
        self.names = iter(f"T{k}" for k in range(1 << 30))

    def kernel(self, scope: Scope, output: str) -> Kernel:
        kind, match = match_operator(scope, self.operators)
        return Kernel(kind, output, scope, match)

    def emit(self, scope: Scope, output: str) -> None:
        """The kernel computing ``scope``; where no operator matches the operands as laid out
        but one matches them re-laid out (split dimensions), the layout eOperators come first."""
        kernel = self.kernel(scope, output)
        relaid = split_layouts(scope) if wants_operator(scope, self.operators) else None
        if relaid is not None:
            kernel = self._relaid(kernel, relaid, lambda matched: matched.kind != "eop")
        relaid = None
        if self.relayout and _batches(kernel) > 1:
            split = split_layouts(kernel.expr)
            relaid = operand_layouts(split or kernel.expr) or split
        if relaid is not None:
            kernel = self._relaid(kernel, relaid, lambda matched: _batches(matched) < _batches(kernel))
        self.kernels.append(kernel)

    def _relaid(self, kernel: Kernel, relaid: Scope, better) -> Kernel:
        """The kernel of ``relaid`` after its layout kernels, where ``better``; else ``kernel``."""
        layouts = _Lowering(self.operators, relayout=False)
        layouts.names = self.names
        matched = self.kernel(layouts.lift(relaid, {}), kernel.output)
        if not better(matched):
            return kernel
        self.kernels.extend(layouts.kernels)
        return matched

    def lift(self, scope: Scope, emitted: dict) -> Scope:
        """``scope`` with each nested scope replaced by a read of a kernel's output tensor.
        Equal nested scopes (a softmax reads its row maximum twice) share one kernel:
        ``emitted`` maps each lifted scope to the tensor that holds it."""

        def lift(access: Access) -> Scalar:
            if not isinstance(access.source, Scope):
                return access
            inner = self.lift(access.source, emitted)
            if inner not in emitted:
                emitted[inner] = next(self.names)
                self.emit(inner, emitted[inner])
            # a kernel output is stored from 0; the scope was read in iterator coordinates
            shifted = tuple(ix - it.lo for ix, it in zip(access.indices, inner.traversal))
            return Access(Tensor(emitted[inner], inner.shape), shifted)

        return scope.with_body(map_accesses(scope.body, lift))


def _batches(kernel: Kernel) -> float:
    """How many GEMMs the kernel is (infinite for one that is no GEMM)."""
    return kernel.match.batches if isinstance(kernel.match, GemmMatch) else math.inf
