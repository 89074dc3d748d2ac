"""Index simplification (an eager clean-up; OLLIE 4.2 relies on it after every substitution)."""

from rewriter.index import simplify
from rewriter.ir import Access, Scope, accesses, map_accesses
from rewriter.search.dsl import rule


@rule("index simplification", section="4.2", kind="eager")
def simplify_indices(scope: Scope):
    """Bring every index of the scope to its simplest form over the scope's box:

        A[t-r+r-1]  =>  A[t-1]        (2*p+q)/2  =>  p   when 0 <= q < 2

    Equal by integer arithmetic on the box, so the value cannot change. Eager: substitutions
    leave such indices behind and the fingerprints read better without them.
    """
    ranges = scope.box
    simpler = {ix: simplify(ix, ranges) for access in accesses(scope.body) for ix in access.indices}
    if all(new == ix for ix, new in simpler.items()):
        return  # most scopes are simple already: build nothing
    yield scope.with_body(map_accesses(scope.body, lambda a: Access(a.source, tuple(simpler[ix] for ix in a.indices))))
