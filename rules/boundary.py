"""Boundary relaxing and tightening (OLLIE section 4.2, Table 1)."""

from rewriter.dsl import rule
from rewriter.indexing import index_bounds, padding_support
from rewriter.ir import Iterator, Scope, nested_reads, replace_subterm


def _with_box(scope: Scope, box: dict) -> Scope:
    traversal = tuple(Iterator(it.name, *box[it.name]) for it in scope.traversal)
    return Scope(traversal, scope.summation, scope.body, scope.reduce)


def _rebuild(scope: Scope, access, inner: Scope) -> Scope:
    body = replace_subterm(scope.body, access, inner[access.indices])
    return Scope(scope.traversal, scope.summation, body, scope.reduce)


@rule("boundary tightening", section="4.2")
def tighten_boundary(scope: Scope):
    """Shrink a nested scope's ranges to where it can be non-zero (OLLIE 4.2, E5 -> E6):

        { L t:a..b ; f }[i]   =>   { L t:a'..b' ; f }[i]

    where [a', b') is the smallest range outside of which f reads only padding (islpy computes
    the support). Reads of the dropped points gave 0 before and give 0 after.
    """
    for access in nested_reads(scope.body):
        inner = access.source
        support = padding_support(inner)
        box = {it.name: (it.lo, it.hi) for it in inner.traversal}
        if support != box and all(hi > lo for lo, hi in support.values()):
            yield _rebuild(scope, access, _with_box(inner, support))


@rule("boundary relaxing", section="4.2")
def relax_boundary(scope: Scope):
    """Grow a nested scope's ranges to cover every point the outer scope reads (OLLIE 4.2):

        { L t:a..b ; f }[i]   =>   { L t:a'..b' ; f }[i]    with [a', b') the hull of [a, b) and i

    Sound only where f is 0 on the added points (they read only padding): then the reads that
    used to fall outside the box and give 0 still give 0. Once every read is inside the box,
    traversal merging can inline the scope.
    """
    outer = {it.name: (it.lo, it.hi) for it in scope.iterators}
    for access in nested_reads(scope.body):
        inner = access.source
        box = {it.name: (it.lo, it.hi) for it in inner.traversal}
        grown = dict(box)
        for it, ix in zip(inner.traversal, access.indices):
            lo, hi = index_bounds(ix, outer)
            grown[it.name] = (min(it.lo, lo), max(it.hi, hi + 1))
        if grown == box:
            continue
        relaxed = _with_box(inner, grown)
        support = padding_support(relaxed)
        if all(box[n][0] <= lo and hi <= box[n][1] for n, (lo, hi) in support.items()):
            yield _rebuild(scope, access, relaxed)
