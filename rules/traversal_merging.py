"""Traversal merging (OLLIE section 4.2, Table 1)."""

from rewriter.index import index_bounds, padding_support
from rewriter.ir import Access, Iterator, Scope, nested_reads, replace_subterm, substitute
from rewriter.search.dsl import rule


@rule("traversal merging", section="4.2", kind="eager")
def merge_traversal(scope: Scope):
    """Inline a nested scope that only re-indexes a tensor (OLLIE 4.2):

        L x ; S y ; g({ L z ; T[tau(z)] }[phi(x, y)])   =>   L x ; S y ; g(T[tau(phi(x, y))])

    A scope that computes something (a sum, an addition, a constant tensor such as a ones
    vector) stays instantiated: inlining it into a summation would repeat its work per read.
    Sound when every read phi(x, y) lies inside the inner box Z (there the read is f; outside it
    would be 0 while f need not be), which is checked by exact range inference over the box of
    x and y, or when f itself is 0 wherever the reads leave Z (islpy: its padding support over
    the grown box stays inside Z). Eager: it removes the identity scopes that variable substitution leaves behind.
    """
    box = scope.box
    for access in nested_reads(scope.body):
        inner = access.source
        if inner.summation or not isinstance(inner.body, Access):
            continue  # only re-indexing scopes: inlining arithmetic would repeat it per read
        reads = [index_bounds(ix, box) for ix in access.indices]
        if all(it.lo <= lo and hi < it.hi for it, (lo, hi) in zip(inner.traversal, reads)) or _zero_outside(
            inner, reads
        ):
            mapping = {it.name: ix for it, ix in zip(inner.traversal, access.indices)}
            body = replace_subterm(scope.body, access, substitute(inner.body, mapping))
            yield scope.with_body(body)
            return


def _zero_outside(inner: Scope, reads) -> bool:
    """Whether the inner body is 0 on every point the reads reach outside its box."""
    grown = tuple(Iterator(it.name, min(it.lo, lo), max(it.hi, hi + 1)) for it, (lo, hi) in zip(inner.traversal, reads))
    support = padding_support(inner.with_traversal(grown))
    return all(it.lo <= lo and hi <= it.hi for it, (lo, hi) in zip(inner.traversal, support.values()) if lo < hi)
