"""Summation splitting (OLLIE section 4.2, Table 1)."""

from itertools import combinations

from rewriter.ir import Scope, accesses, index_vars
from rewriter.search.dsl import rule


@rule("summation splitting", section="4.2", shallow=True)
def split_summation(scope: Scope):
    """Split the summation iterators into an outer set s1 and an inner set s2 (OLLIE 4.2):

        L x ; S s1, s2 ; f   =>   L x ; S s1 ; { L s1, x' ; S s2 ; f }[s1, x']

    The inner scope instantiates the partial sums as a tensor, laid out s1 first as in Figure 6
    (``L r,s,h,w,f``); its traversal keeps only the outer iterators x' that the body reads (the
    others would only repeat values). One result per
    non-empty proper subset s1. Valid for max reductions too (a max of maxes).
    """
    used = set().union(*(index_vars(ix) for a in accesses(scope.body) for ix in a.indices))
    kept = tuple(it for it in scope.traversal if it.name in used)
    for size in range(1, len(scope.summation)):
        for outer in combinations(scope.summation, size):
            inner = tuple(it for it in scope.summation if it not in outer)
            partial = Scope(outer + kept, inner, scope.body, scope.reduce)
            read = partial[tuple(it.var for it in outer + kept)]
            yield Scope(scope.traversal, outer, read, scope.reduce)
