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

Only exact reads merge: ``X[n, c, h+1, w]`` or a zero-padded window keeps its loops, as would a
tensor read once whole and once not (the view is one per tensor).
"""

from __future__ import annotations

import functools

from rewriter.index import normalize, to_index
from rewriter.ir import (
    Access,
    ExpressionError,
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
    body = _merged_reads(scope.body, a, b)
    if body is None:
        return None
    one = (*iterators[:p], Iterator(a.name, 0, a.size * b.size), *iterators[p + 2 :])
    if kind == "traversal":
        return _or_none(lambda: Scope(one, scope.summation, body, scope.reduce))
    return _or_none(lambda: Scope(scope.traversal, one, body, scope.reduce))


def _merged_reads(body, a: Iterator, b: Iterator):
    """The body reading ``a`` and ``b`` as one iterator named ``a``, or None where some read
    does not index them exactly, in adjacent dimensions of their sizes."""
    refused = []
    pair = {a.name, b.name}

    def read(access: Access) -> Access:
        uses = [q for q, ix in enumerate(access.indices) if pair & index_vars(ix)]
        if not uses:
            return access
        q, shape, source = uses[0], access.source.shape, access.source
        exact = uses == [q, q + 1] and access.indices[q : q + 2] == (Var(a.name), Var(b.name))
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
