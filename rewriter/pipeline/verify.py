"""Verification: every candidate and every compiled program is checked against the reference
semantics on random inputs before it is kept; what disagrees is logged with its rule path.

Above ``FULL_CHECK_TERMS`` scalar terms the reference is evaluated on four boxes of the output
only (both corners, where padding and boundary errors show, and two random ones), and programs
are checked there.
"""

from __future__ import annotations

import math

import numpy as np

from rewriter.index import index_bounds
from rewriter.ir import Access, Iterator, Scope, map_accesses, nested_scopes
from rewriter.lower import Candidate
from rewriter.semantics import evaluate

# Above this many scalar terms (iterations of the expression's scopes), the reference is
# evaluated on a few boxes of the output, not the whole: a naive full-size ConvTranspose sums
# over every input position for every output and takes hours in numpy.
FULL_CHECK_TERMS = 1e9
SAMPLE_POINTS = 256  # output points per sampled box


def terms(expr: Scope) -> int:
    """Scalar terms an expression computes: the points of its scopes' iteration spaces."""
    return sum(math.prod(it.size for it in s.iterators) for s in (expr, *nested_scopes(expr)))


def explain(expr: Scope, candidate) -> str:
    """The rule path that produced a candidate (Figure 6 style), then its kernels."""
    path = candidate.source.explain(expr) if candidate.source is not None else f"E1 = {expr}"
    return f"{path}\nkernels:\n" + "\n".join(f"  {k}" for k in candidate.kernels)


class Check:
    """Verification against the reference values of ``expr`` on ``inputs``; what disagrees is
    logged (its rule path) in ``rejected``. ``sampled``: the reference is evaluated on four
    boxes of the output only, and candidates are checked there."""

    def __init__(self, expr: Scope, inputs: dict, rtol: float, sampled: bool = False, rng=None):
        self.expr, self.inputs, self.rtol, self.sampled = expr, inputs, rtol, sampled
        self.rejected: list[str] = []
        everything = [tuple(slice(None) for _ in expr.traversal)]
        boxes = _boxes(expr, rng or np.random.default_rng(0)) if sampled else everything
        self.expected = [(box, evaluate(_restricted(expr, box), inputs)) for box in boxes]

    def reference(self, candidate: Candidate) -> bool:
        """The candidate's kernels, run with the reference semantics, agree."""
        return self.agrees(candidate, candidate(**self.inputs), self.rtol, "")

    def compiled(self, candidate: Candidate, program, tolerance: float) -> bool:
        """The candidate's compiled ``program`` agrees (a program that is the candidate itself
        was checked already)."""
        if program is candidate and not self.sampled:
            return True
        why = "compiled program disagrees with the reference:\n"
        return self.agrees(candidate, program(**self.inputs), tolerance, why)

    def agrees(self, candidate, got: np.ndarray, tolerance: float, why: str) -> bool:
        if got.shape == self.expr.shape and all(agrees(got[box], want, tolerance) for box, want in self.expected):
            return True
        self.rejected.append(why + explain(self.expr, candidate))
        return False


def _boxes(expr: Scope, rng) -> list[tuple[slice, ...]]:
    side = max(1, int(SAMPLE_POINTS ** (1 / max(1, len(expr.traversal)))))
    sizes = [min(side, it.size) for it in expr.traversal]
    starts = [[0] * len(sizes), [it.size - size for it, size in zip(expr.traversal, sizes)]]  # the two corners
    starts += [[int(rng.integers(0, it.size - size + 1)) for it, size in zip(expr.traversal, sizes)] for _ in range(2)]
    unique = dict.fromkeys(tuple(corner) for corner in starts)
    return [tuple(slice(start, start + size) for start, size in zip(corner, sizes)) for corner in unique]


def _restricted(expr: Scope, box: tuple[slice, ...]) -> Scope:
    """``expr`` over the part ``box`` (offsets from the low corner) of its output, its nested
    scopes narrowed to what that part reads of them."""
    traversal = tuple(
        Iterator(it.name, it.lo + (b.start or 0), it.lo + (b.stop if b.stop is not None else it.size))
        for it, b in zip(expr.traversal, box)
    )
    return _narrowed(expr.with_traversal(traversal))


def _narrowed(scope: Scope) -> Scope:
    """``scope`` with each nested scope it reads cut to the hull of the indices read (outside
    it, a read of a scope is 0: the values read do not change)."""
    ranges = scope.box

    def read(access: Access) -> Access:
        inner = access.source
        if not isinstance(inner, Scope):
            return access
        traversal = []
        for ix, it in zip(access.indices, inner.traversal):
            lo, hi = index_bounds(ix, ranges)
            lo, hi = max(lo, it.lo), min(hi + 1, it.hi)
            traversal.append(Iterator(it.name, lo, hi) if lo < hi else Iterator(it.name, it.lo, it.lo + 1))
        return Access(_narrowed(inner.with_traversal(traversal)), access.indices)

    return scope.with_body(map_accesses(scope.body, read))


def _scale(expected: np.ndarray) -> float:
    """The tolerance scale: the largest magnitude, NaN ignored."""
    return max(1.0, float(np.nanmax(np.abs(expected), initial=0.0)))


def agrees(got: np.ndarray, expected: np.ndarray, tolerance: float) -> bool:
    """Equal within ``tolerance`` (relative to the scale) wherever the reference is defined: a
    NaN there (sqrt of a negative random input) is outside the expression's domain, where
    compiled code may legitimately differ (TVM's relu(NaN) is 0)."""
    if got.shape != expected.shape:
        return False
    defined = ~np.isnan(expected)
    scale = _scale(expected)
    return bool(np.allclose(got[defined], expected[defined], rtol=tolerance, atol=tolerance * scale))
