"""The check behind variable substitution: is phi a bijection with the given inverse?

Decided exactly with islpy over the iterator box, never by sampling.
"""

from __future__ import annotations

import islpy as isl

from rewriter.ir import ExpressionError, Iterator, Scope, Var, box, substitute_index

from .algebra import index_bounds, simplify
from .sets import isl_box, isl_index, isl_name


def check_substitution(scope: Scope, new_traversal: tuple[Iterator, ...], forward: dict, inverse: dict) -> None:
    """Refuse (ExpressionError) unless phi maps the old box into the new one and phi^-1 . phi = id."""
    old = scope.traversal
    names = [it.name for it in old]
    if set(forward) != {it.name for it in new_traversal}:
        raise ExpressionError(f"substitution: phi must give every new iterator, got {sorted(forward)}")
    if set(inverse) != set(names):
        raise ExpressionError(
            f"substitution: phi^-1 must give every old traversal iterator {names}, got {sorted(inverse)}"
        )
    ranges = box(old)
    if _proved_cheaply(ranges, new_traversal, forward, inverse):
        return
    space = f"[{', '.join(isl_name(n) for n in names)}]"
    # phi(x) must lie in the new box for every x in the old box
    outside = " or ".join(
        f"{isl_index(forward[it.name])} < {it.lo} or {isl_index(forward[it.name])} >= {it.hi}" for it in new_traversal
    )
    if outside and not isl.Set(f"{{ {space} : {isl_box(old)} and ({outside}) }}").is_empty():
        raise ExpressionError(
            f"substitution: phi sends points of the box {isl_box(old)} outside the new box {isl_box(new_traversal)}"
        )
    # phi^-1(phi(x)) must be x for every x in the old box (so phi is injective there)
    phi = {name: ix for name, ix in forward.items()}
    wrong = " or ".join(f"{isl_index(substitute_index(inverse[name], phi))} != {isl_name(name)}" for name in names)
    if wrong and not isl.Set(f"{{ {space} : {isl_box(old)} and ({wrong}) }}").is_empty():
        raise ExpressionError(
            f"substitution: the given inverse does not undo phi on {isl_box(old)}: phi is not a bijection with that inverse"
        )


def _proved_cheaply(ranges, new_traversal, forward, inverse) -> bool:
    """Range inference and range-aware simplification often prove both conditions outright."""
    for it in new_traversal:
        lo, hi = index_bounds(forward[it.name], ranges)
        if lo < it.lo or hi >= it.hi:
            return False
    return all(simplify(substitute_index(inverse[name], forward), ranges) == Var(name) for name in ranges)
