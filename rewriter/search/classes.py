"""The search's e-classes: which scopes are known equal, and each scope as an e-node.

A rule rewrites one scope into an equal one; a nested scope and its rewrite are then one e-class
(equal tensors over the same box). ``ScopeClasses`` keeps these classes as a union-find over
canonical forms (``rewriter.search.fingerprint``). ``enode(scope)`` is the scope with every scope
it reads replaced by its e-class: a placeholder tensor named after the class. Two scopes with the
same e-node differ only in which member of a nested class they read, so they are congruent, and
a rule that sees nested scopes only as tensors of their box (``shallow``) gives both the same
results up to that member: the search applies it once per e-node and lets congruence share the
results (egglog's e-graph holds the same unions for extraction).
"""

from __future__ import annotations

from rewriter.ir import Access, Scope, Tensor, map_accesses, nested_reads

from .fingerprint import canonical

PLACEHOLDER = "eclass_"  # a placeholder's name: this prefix and the class number


class ScopeClasses:
    """A union-find over canonical scopes: ``union`` when a rule proves two equal, ``enode`` for
    the key a shallow rule is applied under."""

    def __init__(self) -> None:
        self._parent: dict[Scope, Scope] = {}
        self._number: dict[Scope, int] = {}

    def find(self, scope: Scope) -> Scope:
        """The representative of the canonical ``scope``'s class (a new class if unseen)."""
        parent = self._parent.setdefault(scope, scope)
        if parent is scope:
            return scope
        root = self.find(parent)
        self._parent[scope] = root  # path compression
        return root

    def union(self, a: Scope, b: Scope) -> None:
        """Record that the canonical scopes ``a`` and ``b`` are equal."""
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self._parent[rb] = ra

    def number(self, scope: Scope) -> int:
        """The class of the canonical ``scope``, as a number that stays its class's."""
        return self._number.setdefault(self.find(scope), len(self._number))

    def classes(self) -> list[list[Scope]]:
        """Every class, as its canonical members (the representative first)."""
        groups: dict[Scope, list[Scope]] = {}
        for scope in list(self._parent):
            groups.setdefault(self.find(scope), []).append(scope)
        return [sorted(members, key=lambda m: m is not root) for root, members in groups.items()]

    def enode(self, scope: Scope) -> Scope:
        """``scope`` canonical, its nested reads reading their classes' placeholders instead."""
        form = canonical(scope)
        if not nested_reads(form.body):
            return form

        def placeholder(access: Access) -> Access:
            if not isinstance(access.source, Scope):
                return access
            tensor = Tensor(f"{PLACEHOLDER}{self.number(access.source)}", access.source.shape)
            return Access(tensor, access.indices)

        return canonical(form.with_body(map_accesses(form.body, placeholder)))
