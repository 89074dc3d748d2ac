"""Index simplification (an eager clean-up; OLLIE 4.2 relies on it after every substitution)."""

from rewriter.dsl import rule
from rewriter.indexing import simplify
from rewriter.ir import Access, Binary, Scope, Unary


@rule("index simplification", section="4.2", kind="eager")
def simplify_indices(scope: Scope):
    """Bring every index of the scope to its simplest form over the scope's box:

        A[t-r+r-1]  =>  A[t-1]        (2*p+q)/2  =>  p   when 0 <= q < 2

    Equal by integer arithmetic on the box, so the value cannot change. Eager: substitutions
    leave such indices behind and the fingerprints read better without them.
    """
    ranges = {it.name: (it.lo, it.hi) for it in scope.iterators}
    body = _simplified(scope.body, ranges)
    if body != scope.body:
        yield Scope(scope.traversal, scope.summation, body, scope.reduce)


def _simplified(body, ranges):
    match body:
        case Access(source, indices):
            return Access(source, tuple(simplify(ix, ranges) for ix in indices))
        case Unary(fn, arg):
            return Unary(fn, _simplified(arg, ranges))
        case Binary(op, lhs, rhs):
            return Binary(op, _simplified(lhs, ranges), _simplified(rhs, ranges))
    return body
