"""Exact fingerprints (OLLIE section 5.3): a canonical form of a scope, not a hash.

``canonical(scope)`` returns an equivalent Scope in which

* traversal iterators are renamed by position (``i0, i1, ...``; their order is the layout),
* summation iterators are renamed ``s0, s1, ...`` in the order that gives the smallest text,
  so reordering or renaming them changes nothing,
* ``+``, ``*`` and ``max`` chains are flattened and their operands sorted (``a - b`` is
  ``a + -b``), so commutative operand order changes nothing,
* every index is in the normal form of ``rewriter.index.algebra``,
* nested scopes are canonical themselves, so a scope-produced tensor is identified by the
  expression that makes it, whatever its iterators were called.

Input tensors keep their names (as in OLLIE). Every step preserves the value, so two scopes with
equal canonical forms are equal on all inputs: the fingerprint can key e-classes without ever
joining two different expressions. It is complete up to ``MAX_ORDERINGS`` tried orderings of
tied summation iterators; past that it stays exact but may miss a renaming.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

from rewriter.index import normalize, to_index
from rewriter.ir import (
    Access,
    Binary,
    Index,
    Iterator,
    Num,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
    accesses,
    format_scope,
    index_vars,
    substitute_index,
)

MAX_ORDERINGS = 720


def fingerprint(scope: Scope) -> str:
    """The canonical text of a scope: equal fingerprints mean equal values."""
    return format_scope(canonical(scope))


@lru_cache(maxsize=1 << 16)
def canonical(scope: Scope) -> Scope:
    traversal = tuple(_iterator(f"i{k}", it.lo, it.hi) for k, it in enumerate(scope.traversal))
    names = {it.name: f"i{k}" for k, it in enumerate(scope.traversal)}
    best: Scope | None = None
    best_text = ""
    for order in _summation_orders(scope):
        renaming = dict(names, **{it.name: f"s{k}" for k, it in enumerate(order)})
        summation = tuple(_iterator(renaming[it.name], it.lo, it.hi) for it in order)
        candidate = Scope(traversal, summation, _canonical_body(scope.body, renaming), scope.reduce)
        text = format_scope(candidate)
        if best is None or text < best_text:
            best, best_text = candidate, text
    assert best is not None
    return best


@lru_cache(maxsize=1 << 12)
def _iterator(name: str, lo: int, hi: int) -> Iterator:
    # canonical names and ranges recur in every state: one object each (checked once, equal by identity)
    return Iterator(name, lo, hi)


def _summation_orders(scope: Scope):
    """Orderings of the summation iterators worth trying: ties broken by every permutation."""
    groups: dict[tuple, list[Iterator]] = {}
    for it in scope.summation:
        groups.setdefault(_signature(scope, it), []).append(it)
    keys = sorted(groups)
    tied = [groups[k] for k in keys]
    if math.prod(math.factorial(len(g)) for g in tied) > MAX_ORDERINGS:
        yield tuple(it for g in tied for it in g)
        return
    for choice in itertools.product(*(itertools.permutations(g) for g in tied)):
        yield tuple(it for g in choice for it in g)


def _signature(scope: Scope, it: Iterator) -> tuple:
    """What a summation iterator looks like without its name: range and where it is read."""
    uses = []
    for access in accesses(scope.body):
        source = access.source.name if isinstance(access.source, Tensor) else "{}"
        for position, ix in enumerate(access.indices):
            if it.name in index_vars(ix):
                uses.append((source, position, len(index_vars(ix))))
    return (it.lo, it.hi, tuple(sorted(uses)))


def _canonical_index(ix: Index, renaming: dict[str, str]) -> Index:
    return _renamed_normal_form(ix, tuple(renaming.items()))


@lru_cache(maxsize=1 << 16)
def _renamed_normal_form(ix: Index, renaming: tuple[tuple[str, str], ...]) -> Index:
    # cached: every state repeats the indices of the one it came from, under the same renaming
    return to_index(normalize(substitute_index(ix, {k: Var(v) for k, v in renaming})))


def _canonical_body(body: Scalar, renaming: dict[str, str]) -> Scalar:
    match body:
        case Num():
            return body
        case Access(source, indices):
            source = canonical(source) if isinstance(source, Scope) else source
            return Access(source, tuple(_canonical_index(ix, renaming) for ix in indices))
        case Unary("neg", Unary("neg", inner)):
            return _canonical_body(inner, renaming)
        case Unary(fn, arg):
            return Unary(fn, _canonical_body(arg, renaming))
        case Binary("+" | "-" | "*" | "max" | "min" as op, _, _):
            chain_op = "+" if op in "+-" else op
            operands = [_canonical_body(t, renaming) for t in _chain(body, chain_op)]
            operands.sort(key=str)
            result = operands[0]
            for operand in operands[1:]:
                result = Binary(chain_op, result, operand)
            return result
        case Binary(op, lhs, rhs):
            return Binary(op, _canonical_body(lhs, renaming), _canonical_body(rhs, renaming))
    raise TypeError(body)


def _chain(body: Scalar, op: str) -> list[Scalar]:
    """Operands of an associative-commutative chain; ``a - b`` contributes ``a`` and ``-b``."""
    if isinstance(body, Binary) and (body.op == op or (op == "+" and body.op == "-")):
        right = _chain(body.rhs, op)
        if body.op == "-":
            right = [Unary("neg", t) for t in right]
        return _chain(body.lhs, op) + right
    return [body]
