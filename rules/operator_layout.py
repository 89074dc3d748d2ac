"""Guided layout for operator matching (OLLIE section 5.2, iterator mismatches)."""

from itertools import permutations

from rewriter.ir import Access, Binary, Scope, Tensor, Var, index_vars
from rewriter.search.dsl import rule, substitute_traversal


def _dim_order(access: Access, name: str) -> int:
    return next((d for d, ix in enumerate(access.indices) if name in index_vars(ix)), len(access.indices))


def _indexed(access: Access) -> set:
    return set().union(*(index_vars(ix) for ix in access.indices))


@rule("operator layout", section="5.2", kind="guided", targets=True)
def layout_for_operator(scope: Scope, target):
    """Re-order a scope's traversal so the target operator's iterator groups become contiguous
    (OLLIE 5.2, GUIDEDDERIVE(E, T): the iterator mapping function is read off T's table):

        L x, n, y ; S c ; A[n, x, y, c] * K[..]   =>   L x, n, y ; { L n, x, y ; S c ; ... }[n, x, y]

    ``target`` is the operator's iterator mapping table: each traversal iterator goes to the
    group of the operands it indexes (``target.group_of``); inside a group the order is the
    dimension order of the first operand the group indexes, so that operand can be read in
    place. The groups that index both operands (a batch) come first, then the other output
    groups in every order (a Matmul's (m, n) and (n, m)). A variable substitution by a
    permutation; nested, traversal merging folds it into the reading scope.
    """
    body = scope.body
    if not (isinstance(body, Binary) and body.op == "*"):
        return
    x, y = body.lhs, body.rhs
    if not all(isinstance(t, Access) and isinstance(t.source, Tensor) for t in (x, y)):
        return
    in_x, in_y = _indexed(x), _indexed(y)
    groups: dict[str, list] = {g.name: [] for g in target.groups}
    for it in scope.traversal:
        group = target.group_of(it.name in in_x, it.name in in_y, True)
        if group is None:
            return  # an iterator the target has no place for
        groups[group.name].append(it)
    batch = [g for g in target.groups if g.output and g.input and g.weight]
    others = [g for g in target.groups if g.output and g not in batch]
    if not any(groups[g.name] for g in others):
        return
    for g in target.groups:
        groups[g.name].sort(key=lambda it: _dim_order(x if g.input else y, it.name))
    identity = {it.name: Var(it.name) for it in scope.traversal}
    for order in permutations(others):
        traversal = tuple(it for g in (*batch, *order) for it in groups[g.name])
        if traversal != scope.traversal:
            yield substitute_traversal(scope, traversal, identity, identity)
