"""Traversal merging (OLLIE section 4.2, Table 1)."""

from functools import lru_cache

import numpy as np

from rewriter.index import index_bounds, padding_support, read_bounds, reads_outside
from rewriter.ir import Access, Iterator, Scope, eval_index, nested_reads, replace_subterm, substitute
from rewriter.search.dsl import rule


@rule("traversal merging", section="4.2", kind="eager")
def merge_traversal(scope: Scope):
    """Inline a nested scope that only re-indexes a tensor (OLLIE 4.2):

        L x ; S y ; g({ L z ; T[tau(z)] }[phi(x, y)])   =>   L x ; S y ; g(T[tau(phi(x, y))])

    A scope that computes something (a sum, an addition, a constant tensor such as a ones
    vector) stays instantiated: inlining it into a summation would repeat its work per read.
    Sound when every read phi(x, y) lies inside the inner box Z (there the read is f; outside it
    would be 0 while f need not be), which is checked by exact range inference over the box of
    x and y, or when f itself is 0 wherever the reads leave Z (by interval arithmetic on each slab
    of the grown box outside Z where the reads are separable, else islpy: its padding support
    over the grown box stays inside Z). Eager: it removes the identity scopes that variable
    substitution leaves behind.
    """
    box = scope.box
    for access in nested_reads(scope.body):
        inner = access.source
        if inner.summation or not isinstance(inner.body, Access):
            continue  # only re-indexing scopes: inlining arithmetic would repeat it per read
        reads = tuple(index_bounds(ix, box) for ix in access.indices)
        if all(it.lo <= lo and hi < it.hi for it, (lo, hi) in zip(inner.traversal, reads)) or _zero_outside(
            inner, reads
        ):
            mapping = {it.name: ix for it, ix in zip(inner.traversal, access.indices)}
            body = replace_subterm(scope.body, access, substitute(inner.body, mapping))
            yield scope.with_body(body)
            return


@lru_cache(maxsize=1 << 14)
def _zero_outside(inner: Scope, reads: tuple) -> bool:
    """Whether the inner body is 0 on every point the reads reach outside its box (cached: the
    same nested scope is read the same way by the many states that hold it)."""
    grown = tuple(Iterator(it.name, min(it.lo, lo), max(it.hi, hi + 1)) for it, (lo, hi) in zip(inner.traversal, reads))
    exact = reads_outside(inner.body.indices, read_bounds(inner.body.source), inner.traversal, grown)
    if exact is not None:  # separable reads: decided by interval arithmetic
        return not exact
    if _read_outside(inner, grown):
        return False
    support = padding_support(inner.with_traversal(grown))
    return all(it.lo <= lo and hi <= it.hi for it, (lo, hi) in zip(inner.traversal, support.values()) if lo < hi)


_FRACTIONS = np.random.default_rng(0).random((16, 64))  # fixed draws in [0, 1): the search stays deterministic


def _read_outside(inner: Scope, grown: tuple[Iterator, ...], samples: int = 16) -> bool:
    """Whether a sampled point of the grown box outside the inner box reads its source in bounds
    (where the inner body, a single read, may be non-zero). Such a point decides the question
    exactly and costs microseconds, against a millisecond for isl's support; without one, isl
    decides. Samples: for each value an iterator takes outside the inner box, nearest and farthest,
    the other iterators drawn from the grown box."""
    if len(grown) > _FRACTIONS.shape[1]:
        return False  # isl decides
    lows, highs = np.array([it.lo for it in grown]), np.array([it.hi for it in grown])
    drawn = lows + (_FRACTIONS[:samples, : len(grown)] * (highs - lows)).astype(np.int64)
    blocks = []
    for k, (it, out) in enumerate(zip(inner.traversal, grown)):
        for value in {out.lo, it.lo - 1, it.hi, out.hi - 1} - set(range(it.lo, it.hi)):
            if out.lo <= value < out.hi:
                block = drawn.copy()
                block[:, k] = value
                blocks.append(block)
    if not blocks:
        return False
    points = np.concatenate(blocks)
    env = {it.name: points[:, k] for k, it in enumerate(grown)}
    inside = np.ones(len(points), dtype=bool)
    for ix, (lo, hi) in zip(inner.body.indices, read_bounds(inner.body.source)):
        value = eval_index(ix, env)
        inside &= (lo <= value) & (value < hi)
    return bool(inside.any())
