"""Kernels and candidates: what instantiation (OLLIE 4.3) hands to code generation.

A ``Kernel`` is ``output = expr`` with the operator it matched (``match``, carrying its record)
or none (an eOperator, compiled from its scope; an opaque operation, run by a library). A ``Candidate`` is kernels in execution order,
callable on inputs (BLAS for GEMMs, the reference semantics for every other kernel: for
checking, never for speed), with an analytic ``cost`` (flops and bytes) that codegen's
measurements replace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from rewriter.ir import (
    Binary,
    Opaque,
    Scalar,
    Scope,
    Unary,
    distinct_scopes,
    nested_scopes,
    rename_tensors,
    tensor_shapes,
)
from rewriter.semantics import bound_constants, evaluate

from .operators import GemmMatch, Operator, match_operator, run_gemm

# The analytic stand-in for measured cost (seconds): a BLAS rate, a generated-kernel rate and
# memory bandwidth of a small CPU. Codegen's measurements replace ``Candidate.cost``.
BLAS_FLOPS = 5e10
EOP_OPS = 2e9
BYTES_PER_SECOND = 1e10
LAUNCH_SECONDS = 5e-6  # every kernel call costs something, however small


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``output = expr`` where expr reads inputs and earlier kernels' outputs by name."""

    kind: str  # an operator's kind ("matmul", "conv2d", ...), "eop" (an eOperator) or "opaque"
    output: str
    expr: Scope | Opaque
    match: object | None = None  # the operator's match (GemmMatch, ConvMatch, BandMatch, ...)
    weight_only: bool = False  # reads only weights: evaluated once at build time (5.4)
    # the inputs it reads that are weights (bound once): an implementation may lay them out for
    # itself when they are bound (codegen's packed matmul)
    weights: frozenset[str] = frozenset()

    @property
    def operator(self) -> Operator | None:
        """The matched operator's record, None for an eOperator."""
        return None if self.match is None else self.match.operator

    @property
    def cost(self) -> float:
        """Analytic stand-in: compute time plus the bytes the kernel reads and writes."""
        fixed = LAUNCH_SECONDS + moved_bytes(self.expr) / BYTES_PER_SECOND
        if self.kind == "opaque":
            return fixed
        if self.operator is not None:
            return self.operator.flops(self.expr) / BLAS_FLOPS + fixed
        return work(self.expr) / EOP_OPS + fixed

    def with_expr(self, expr: Scope) -> Kernel:
        """The same kernel over a renamed expression (matched again, by its own operator: the
        tensor names are in the match)."""
        if self.kind in ("eop", "opaque"):
            return Kernel(self.kind, self.output, expr, None, self.weight_only, self.weights)
        kind, match = match_operator(expr, None if self.operator is None else (self.operator,))
        return Kernel(kind, self.output, expr, match, self.weight_only, self.weights)

    def renamed(self, names: dict[str, str]) -> Kernel:
        """The same kernel reading and writing the tensors ``names`` maps to (others unchanged)."""
        moved = replace(
            self, output=names.get(self.output, self.output), weights=frozenset(names.get(w, w) for w in self.weights)
        )
        return moved.with_expr(rename_tensors(self.expr, names))

    def __str__(self) -> str:
        marks = " (weights only)" if self.weight_only else ""
        return f"{self.output} = {self.kind}{marks}: {self.expr}"


def moved_bytes(expr: Scope | Opaque) -> int:
    """Bytes a kernel reads and writes once each (4-byte elements)."""
    return 4 * (math.prod(expr.shape) + sum(math.prod(s) for s in tensor_shapes(expr).values()))


def work(expr: Scope) -> int:
    """Scalar operations a scope computes, its nested scopes (each once, as a fused eOperator
    computes them) included."""
    return sum(math.prod(it.size for it in s.iterators) * op_count(s.body) for s in (expr, *nested_scopes(expr)))


def multiply_adds(expr: Scope | Opaque) -> int:
    """Points the kernel's summations visit (every scope that sums, nested ones once): a
    product's multiply-adds, the count its arithmetic rate is measured in (2 flops each)."""
    if isinstance(expr, Opaque):
        return 0
    summing = (s for s in distinct_scopes(expr) if s.summation and s.reduce == "sum")
    return sum(math.prod(it.size for it in s.traversal + s.summation) for s in summing)


def op_count(body: Scalar) -> int:
    """Scalar operations in ``body``, each read and constant counted as one."""
    if isinstance(body, Unary):
        return 1 + op_count(body.arg)
    if isinstance(body, Binary):
        return 1 + op_count(body.lhs) + op_count(body.rhs)
    return 1


@dataclass
class Candidate:
    """A program of kernels equivalent to the expression it was derived from."""

    kernels: list[Kernel]
    source: object = field(default=None, repr=False)  # the search state it came from
    unfused: list[Kernel] | None = field(default=None, repr=False)  # before eOperator fusion (5.4)

    @property
    def output(self) -> str:
        return self.kernels[-1].output

    @property
    def cost(self) -> float:
        """The analytic stand-in: the sum of the kernels' (a compiled program measures its own)."""
        return sum(k.cost for k in self.kernels)

    def timings(self) -> list[tuple[Kernel, float]]:
        """Each kernel with its cost, as a compiled program gives its measured ones."""
        return [(k, k.cost) for k in self.kernels]

    def __call__(self, **inputs) -> np.ndarray:
        reads = set().union(*(tensor_shapes(k.expr) for k in self.kernels))
        given = {**bound_constants(reads - set(inputs)), **inputs}  # a rule's constant tables bind themselves
        values = {name: np.asarray(value, dtype=np.float64) for name, value in given.items()}
        for kernel in self.kernels:
            if isinstance(kernel.match, GemmMatch):
                values[kernel.output] = run_gemm(kernel.match, values, kernel.expr.shape)
            else:
                needed = {name: values[name] for name in tensor_shapes(kernel.expr)}
                values[kernel.output] = evaluate(kernel.expr, needed)
        return values[self.output]

    def __str__(self) -> str:
        return "\n".join(str(k) for k in self.kernels)
