"""Guided layout for operator matching (OLLIE section 5.2, iterator mismatches)."""

from rewriter.ir import Access, Binary, Scope, Tensor, Var, index_vars
from rewriter.lower.operators import BATCH_MATMUL
from rewriter.search.dsl import rule, substitute_traversal


def _dim_order(access: Access, name: str) -> int:
    return next((d for d, ix in enumerate(access.indices) if name in index_vars(ix)), len(access.indices))


@rule("operator layout", section="5.2", kind="guided")
def layout_for_matmul(scope: Scope):
    """Re-order a scope's traversal so a Matmul's iterator groups become contiguous (OLLIE 5.2):

        L x, n, y ; S c ; A[n, x, y, c] * K[..]   =>   L x, n, y ; { L n, x, y ; S c ; ... }[n, x, y]

    The groups come from the BatchMatmul iterator mapping table (which operands an iterator
    indexes); inside a group the order is the operand's dimension order, so the operand can be
    read in place. Both (batch, m, n) and (batch, n, m) output orders are proposed. A variable
    substitution by a permutation; nested, traversal merging folds it into the reading scope.
    """
    body = scope.body
    if not (isinstance(body, Binary) and body.op == "*"):
        return
    x, y = body.lhs, body.rhs
    if not all(isinstance(t, Access) and isinstance(t.source, Tensor) for t in (x, y)):
        return
    in_x = set().union(*(index_vars(ix) for ix in x.indices))
    in_y = set().union(*(index_vars(ix) for ix in y.indices))
    groups: dict[str, list] = {"b": [], "m": [], "n": [], "other": []}
    for it in scope.traversal:
        group = BATCH_MATMUL.group_of(it.name in in_x, it.name in in_y, True)
        groups[group.name if group else "other"].append(it)
    if groups["other"] or not groups["m"] and not groups["n"]:
        return
    groups["b"].sort(key=lambda it: _dim_order(x, it.name))
    groups["m"].sort(key=lambda it: _dim_order(x, it.name))
    groups["n"].sort(key=lambda it: _dim_order(y, it.name))
    identity = {it.name: Var(it.name) for it in scope.traversal}
    for order in (("b", "m", "n"), ("b", "n", "m")):
        traversal = tuple(it for g in order for it in groups[g])
        if traversal != scope.traversal:
            yield substitute_traversal(scope, traversal, identity, identity)
