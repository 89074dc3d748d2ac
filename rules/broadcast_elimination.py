"""Broadcast elimination (an eager clean-up of OLLIE 4.2's variable substitution)."""

from rewriter.index import index_bounds
from rewriter.ir import Access, Scope, accesses, index_vars, nested_reads, replace_subterm
from rewriter.search.dsl import rule


@rule("broadcast elimination", section="4.2", kind="eager")
def eliminate_broadcast(scope: Scope):
    """Drop a nested scope's traversal iterator that its body never reads:

        L x ; g({ L z, u ; S y ; f(z) }[phi(x), psi(x)])   =>   L x ; g({ L z ; S y ; f(z) }[phi(x)])

    The nested scope repeats f along u, so every in-bounds read gives f(phi(x)); sound where
    psi(x) stays inside u's range on the whole box of x (else that read gave 0), which exact
    range inference checks. Variable substitution of a scope whose iterators were substituted
    before leaves such copies behind (G2BMM: a nested scope over (p, p1, t, t1) reading t and t1
    only), each a tensor as many times larger as u has values. A scope that reads no iterator at
    all is a constant tensor, kept whole: Korch's ones vector turns a sum into a GEMM operand.
    Eager, like traversal merging.
    """
    box = scope.box
    for access in nested_reads(scope.body):
        inner = access.source
        read = set().union(*(index_vars(ix) for a in accesses(inner.body) for ix in a.indices))
        kept = [k for k, it in enumerate(inner.traversal) if it.name in read]
        if not kept or len(kept) == len(inner.traversal):
            continue  # a constant tensor (a ones vector) is kept whole: its shape is its use
        dropped = [k for k in range(len(inner.traversal)) if k not in kept]
        if not all(_inside(access.indices[k], inner.traversal[k], box) for k in dropped):
            continue
        narrowed = inner.with_traversal(inner.traversal[k] for k in kept)
        yield scope.with_body(
            replace_subterm(scope.body, access, Access(narrowed, tuple(access.indices[k] for k in kept)))
        )
        return


def _inside(ix, it, box) -> bool:
    lo, hi = index_bounds(ix, box)
    return it.lo <= lo and hi < it.hi
