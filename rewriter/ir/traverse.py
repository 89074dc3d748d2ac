"""Walking and rewriting expression trees: the operations rules and passes share.

Substitution of iterators, renaming and inlining of tensors, and positions of nested scopes
(``scopes_at`` / ``replace_at``: the root is ``()``, a nested scope is the path of access numbers,
left to right, that leads to it).
"""

from __future__ import annotations

from typing import Iterator as PyIterator

from .indices import Index, substitute_index
from .nodes import Access, Binary, Opaque, Scalar, Scope, Tensor, Unary, accesses

Position = tuple[int, ...]  # access numbers (left to right) leading from the root to a nested scope


def map_accesses(body: Scalar, fn) -> Scalar:
    """The body with each access ``a`` replaced by ``fn(a)``, left to right (nested scopes are
    not entered: ``fn`` sees their reads and decides)."""
    match body:
        case Access():
            return fn(body)
        case Unary(name, arg):
            return Unary(name, map_accesses(arg, fn))
        case Binary(op, lhs, rhs):
            lhs = map_accesses(lhs, fn)  # evaluated first: fn may count accesses
            return Binary(op, lhs, map_accesses(rhs, fn))
    return body


def replace_reads(body: Scalar, name: str, make) -> Scalar:
    """The body with every read ``name[idx]`` of a tensor (nested scopes included) replaced by
    ``make(idx)``: renaming a tensor, or inlining the scope that produces it."""

    def read(access: Access) -> Scalar:
        source = access.source
        if isinstance(source, Scope):
            return Access(source.with_body(replace_reads(source.body, name, make)), access.indices)
        return make(access.indices) if source.name == name else access

    return map_accesses(body, read)


def rename_tensors(scope: Scope | Opaque, names: dict[str, str]) -> Scope | Opaque:
    """``scope`` reading tensor ``names[t]`` wherever it read ``t`` (all at once, nested scopes
    included), so swapping two names works."""
    if isinstance(scope, Opaque):
        inputs = tuple(Tensor(names.get(t.name, t.name), t.shape) for t in scope.inputs)
        return Opaque(scope.op, inputs, scope.attributes)
    done: dict[Scope, Scope] = {}  # a nested scope read twice (a mean, by a variance too) renamed once

    def renamed(nested: Scope) -> Scope:
        if nested not in done:
            done[nested] = nested.with_body(map_accesses(nested.body, read))
        return done[nested]

    def read(access: Access) -> Scalar:
        source = access.source
        if isinstance(source, Scope):
            return Access(renamed(source), access.indices)
        return Tensor(names[source.name], source.shape)[access.indices] if source.name in names else access

    return renamed(scope)


def substitute(body: Scalar, mapping: dict[str, Index]) -> Scalar:
    """The body with iterators replaced in every index (nested scopes are closed: untouched)."""
    return map_accesses(body, lambda a: Access(a.source, tuple(substitute_index(ix, mapping) for ix in a.indices)))


def replace_subterm(body: Scalar, old: Scalar, new: Scalar) -> Scalar:
    """The body with every occurrence of the sub-term ``old`` (by identity) replaced by ``new``."""
    if body is old:
        return new
    match body:
        case Unary(fn, arg):
            return Unary(fn, replace_subterm(arg, old, new))
        case Binary(op, lhs, rhs):
            return Binary(op, replace_subterm(lhs, old, new), replace_subterm(rhs, old, new))
    return body


def nested_reads(body: Scalar) -> list[Access]:
    """The accesses of a body that read a nested scope, left to right."""
    return [a for a in accesses(body) if isinstance(a.source, Scope)]


def inline(consumer: Scope, name: str, producer: Scope) -> Scope:
    """The fusion primitive (OLLIE 4.1, the chain rule): ``consumer`` with every read of tensor
    ``name`` replaced by a read of the nested scope ``producer``. A tensor is stored from 0 and
    a scope is read in its iterators' coordinates, so each read is shifted by the producer's
    range starts."""

    def read(indices):
        return producer[tuple(ix + it.lo for ix, it in zip(indices, producer.traversal))]

    return consumer.with_body(replace_reads(consumer.body, name, read))


# --------------------------------------------------------------------------------------------
# Positions: the scopes inside an expression


def scopes_at(expr: Scope, position: Position = ()) -> PyIterator[tuple[Position, Scope]]:
    """The root scope and every nested scope, each with its position (pre-order)."""
    yield position, expr
    for number, access in enumerate(accesses(expr.body)):
        if isinstance(access.source, Scope):
            yield from scopes_at(access.source, position + (number,))


def replace_at(expr: Scope, position: Position, new: Scope) -> Scope:
    """``expr`` with the scope at ``position`` replaced by ``new``."""
    if not position:
        return new
    counter = iter(range(1 << 30))
    target, rest = position[0], position[1:]

    def rebuild(access: Access) -> Access:  # accesses are numbered left to right, as scopes_at does
        if next(counter) == target:
            return Access(replace_at(access.source, rest, new), access.indices)  # type: ignore[arg-type]
        return access

    return expr.with_body(map_accesses(expr.body, rebuild))
