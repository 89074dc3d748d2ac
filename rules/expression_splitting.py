"""Expression splitting and merging (OLLIE section 4.1, Table 1; Figure 5)."""

from rewriter.dsl import rule
from rewriter.ir import Binary, Iterator, Scope, Var


@rule("expression splitting", section="4.1", kind="inter")
def split_expression(scope: Scope):
    """Split the traversal space in two independent expressions (OLLIE 4.1):

        L x:a..b ; f   =>   L x:a..b ; { L x:a..k ; f }[x] + { L x:k..b ; f }[x]

    Each half is its own scope; the sum of two reads of disjoint boxes is their concatenation,
    because a read outside a box is 0. Tried at the middle of each traversal iterator.
    """
    for position, it in enumerate(scope.traversal):
        if it.size < 2:
            continue
        middle = it.lo + it.size // 2
        halves = []
        for lo, hi in ((it.lo, middle), (middle, it.hi)):
            traversal = scope.traversal[:position] + (Iterator(it.name, lo, hi),) + scope.traversal[position + 1 :]
            halves.append(Scope(traversal, scope.summation, scope.body, scope.reduce)[tuple(t.var for t in scope.traversal)])
        yield Scope(scope.traversal, (), Binary("+", halves[0], halves[1]))


@rule("expression merging", section="4.1", kind="inter")
def merge_expressions(scope: Scope):
    """Merge two independent expressions with identical computation into one (OLLIE 4.1):

        { L x:a..k ; f }[x] + { L x:k..b ; f }[x]   =>   { L x:a..b ; f }[x]

    The reverse of splitting: the boxes must be adjacent along one iterator and equal along
    the others, and both reads must be the identity of the outer traversal.
    """
    body = scope.body
    if scope.summation or not (isinstance(body, Binary) and body.op == "+"):
        return
    left, right = body.lhs, body.rhs
    identity = tuple(Var(it.name) for it in scope.traversal)
    for a, b in ((left, right), (right, left)):
        if not (isinstance(getattr(a, "source", None), Scope) and isinstance(getattr(b, "source", None), Scope)):
            continue
        if a.indices != identity or b.indices != identity:
            continue
        first, second = a.source, b.source
        if (first.summation, first.body, first.reduce) != (second.summation, second.body, second.reduce):
            continue
        differing = [k for k, (p, q) in enumerate(zip(first.traversal, second.traversal)) if p != q]
        if len(differing) != 1:
            continue
        k = differing[0]
        p, q = first.traversal[k], second.traversal[k]
        if p.name == q.name and p.hi == q.lo:
            merged = first.traversal[:k] + (Iterator(p.name, p.lo, q.hi),) + first.traversal[k + 1 :]
            whole = Scope(merged, first.summation, first.body, first.reduce)
            yield whole if whole.traversal == scope.traversal else Scope(scope.traversal, (), whole[identity])
            return
