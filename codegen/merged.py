"""Adjacent loops that every read takes whole, merged into one loop over views of the buffers.

A 1x1 convolution over a 7x7 image in NCHW, ``L n,f,h,w ; S c ; X[n,c,h,w] * K[f,c]``, runs its
vector lanes along w: 7 lanes where the machine has 16. But h and w are read only together, as
whole adjacent dimensions of the same sizes (of X and of the result), so the pair is one
iterator t over their row-major product, and those dimensions one dimension of a view:
``L n,f,t ; S c ; X'[n,c,t] * K[f,c]``, X' being X viewed as (N, C, 49). ``merge_loops`` finds
such pairs (traversal or summation iterators, in nested scopes too where their reader merges
with them) until none is left. A kernel compiled for the merged scope computes every element as
before; it is called on reshaped views of the same buffers (no copy). Measured here, alone, a
1x1 convolution 64 -> 256 over 56x56 with its epilogue: 0.32 ms as written, 0.25 merged.

Exact reads merge by the view: ``X[n, c, h+1, w]`` or a zero-padded window keeps its loops, as
would a tensor read once whole and once not (the view is one per tensor). A tensor read at
``s*h + k, s*w + l`` (a strided 1x1 convolution's input, s > 1) merges too, without a view: it
is read at ``s*(t/W) + k, s*(t%W) + l`` (W the columns), index arithmetic a register tile's row
does once, outside the sum. Measured here (AMD EPYC, Zen 3; ``bench/products_vs_mlas.py
--blocked --epilogue``), ResNet-50's stride-2 1x1 convolutions in NCHW8c, ms, apart against
merged: 512 -> 1024 channels to 14x14 2.14 to 1.70 (onnxruntime 1.70, 1.63); 256 -> 512 to
28x28 1.66 to 1.66; 1024 -> 2048 to 7x7 2.15 to 2.17. A strided window, ``s*h + r - 1``, stays
apart (a 3x3 convolution of stride 2, 128 channels to 28x28: 1.60 ms apart, 2.84 merged).
"""

from __future__ import annotations

import functools

from rewriter.index import affine_coefficients, normalize, to_index
from rewriter.ir import (
    Access,
    ExpressionError,
    IndexOp,
    Iterator,
    Lit,
    Scope,
    Tensor,
    Var,
    index_vars,
    map_accesses,
    substitute_index,
)

__all__ = ["merge_loops"]


def merge_loops(scope: Scope) -> Scope:
    """``scope`` with every pair of adjacent iterators that all reads take whole merged (its
    output shape merged likewise), or ``scope`` itself where no pair merges."""
    plain = _units_fixed(scope)
    merged = _merged_within(plain, outputs=True)
    return merged if merged != plain else scope


@functools.lru_cache(maxsize=4096)  # a nested scope read twice (a mean, by a variance too) merged once
def _merged_within(scope: Scope, outputs: bool) -> Scope:
    """Nested scopes' summation pairs first (their shapes are their readers'), then this
    scope's pairs: traversal ones only where ``outputs`` (the caller views the result)."""

    def nested(access: Access) -> Access:
        if isinstance(access.source, Scope):
            return Access(_merged_within(access.source, outputs=False), access.indices)
        return access

    scope = _or_none(lambda: scope.with_body(map_accesses(scope.body, nested))) or scope
    kinds = ("traversal", "summation") if outputs else ("summation",)
    while True:
        pairs = ((kind, p) for kind in kinds for p in range(len(getattr(scope, kind)) - 1))
        merged = next((m for kind, p in pairs if (m := _merged_pair(scope, kind, p)) is not None), None)
        if merged is None:
            return scope
        scope = merged


def _merged_pair(scope: Scope, kind: str, p: int) -> Scope | None:
    """``scope`` with its ``kind`` iterators p and p+1 merged into one, or None where a read
    takes them otherwise than whole."""
    iterators = getattr(scope, kind)
    a, b = iterators[p], iterators[p + 1]
    if a.lo or b.lo:
        return None
    # a subsampled read only where the pair is not the innermost loop: that one takes the vector
    # lanes, which read a stride-s row from a deinterleaved copy (``tvm_kernel._split``) and
    # never run along an iterator under a division
    inner = kind == "traversal" and p + 2 == len(iterators)
    body = _merged_reads(scope.body, a, b, subsampled=not inner)
    if body is None:
        return None
    one = (*iterators[:p], Iterator(a.name, 0, a.size * b.size), *iterators[p + 2 :])
    if kind == "traversal":
        return _or_none(lambda: Scope(one, scope.summation, body, scope.reduce))
    return _or_none(lambda: Scope(scope.traversal, one, body, scope.reduce))


def _merged_reads(body, a: Iterator, b: Iterator, subsampled: bool):
    """The body reading ``a`` and ``b`` as one iterator named ``a``, or None where some read
    does not index them exactly, in adjacent dimensions of their sizes (or, where
    ``subsampled``, at ``s*a + k, s*b + l``)."""
    refused = []
    pair = {a.name, b.name}

    def read(access: Access) -> Access:
        uses = [q for q, ix in enumerate(access.indices) if pair & index_vars(ix)]
        if not uses:
            return access
        q, shape, source = uses[0], access.source.shape, access.source
        exact = uses == [q, q + 1] and access.indices[q : q + 2] == (Var(a.name), Var(b.name))
        if subsampled and not exact and uses == [q, q + 1] and _subsampled(access.indices[q : q + 2], a, b, source):
            split = {a.name: IndexOp("/", Var(a.name), Lit(b.size)), b.name: IndexOp("%", Var(a.name), Lit(b.size))}
            return Access(source, tuple(substitute_index(ix, split) for ix in access.indices))
        if not exact or shape[q : q + 2] != (a.size, b.size):
            refused.append(access)
            return access
        if isinstance(source, Scope):
            source = _merged_pair(source, "traversal", q)
            if source is None:
                refused.append(access)
                return access
        else:
            source = Tensor(source.name, (*shape[:q], a.size * b.size, *shape[q + 2 :]))
        return Access(source, (*access.indices[:q], Var(a.name), *access.indices[q + 2 :]))

    body = map_accesses(body, read)
    return None if refused else body


def _subsampled(indices, a: Iterator, b: Iterator, source) -> bool:
    """Whether a tensor's two adjacent indices are ``s*a + k`` and ``s*b + l``, s > 1."""
    forms = [affine_coefficients(ix) for ix in indices]
    if not isinstance(source, Tensor) or None in forms:
        return False
    (first, _), (second, _) = forms
    stride = first.get(a.name, 0)
    return stride > 1 and first == {a.name: stride} and second == {b.name: stride}


@functools.lru_cache(maxsize=4096)
def _units_fixed(scope: Scope) -> Scope:
    """``scope`` without summation iterators of one value (a 1x1 kernel's r and s), and every
    iterator of one value read at that value (a traversal one stays a dimension), in nested
    scopes too."""

    def nested(access: Access) -> Access:
        if isinstance(access.source, Scope):
            return Access(_units_fixed(access.source), access.indices)
        return access

    body = map_accesses(scope.body, nested)
    units = {it.name: it.lo for it in scope.iterators if it.size == 1}
    if units:
        body = map_accesses(body, lambda a: Access(a.source, tuple(_at(ix, units) for ix in a.indices)))
    summation = tuple(it for it in scope.summation if it.size > 1)
    return Scope(scope.traversal, summation, body, scope.reduce if summation else "sum")


def _at(ix, values: dict[str, int]):
    if not values.keys() & index_vars(ix):
        return ix
    return to_index(normalize(substitute_index(ix, {name: Lit(value) for name, value in values.items()})))


def _or_none(make):
    try:
        return make()
    except ExpressionError:  # a tensor would be read through two views
        return None
