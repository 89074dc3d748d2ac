"""Iterator mapping tables (OLLIE 4.3.1, Table 2) and the matching step every operator shares.

A table lists an operator's iterator groups: for each group, whether its iterators index the
input, the weight and the output (an iterator the output does not index is summed). It also
lists the correlated indices ("windows") the operator reads: a convolution's input row
``stride*h + dilation*r + offset`` combines an output iterator and a kernel iterator, a band
matmul's ``i + dilation*w + offset`` a row and a band offset. This is Table 2 as data:

    input weight output | Matmul  BatchMatmul  Conv2d  G2BMM  GBMM
      x     x      x    |         b            g       bi     bi
      x            x    | m       m            nhw
            x      x    | n       n            f       w      n
      x     x           | k       k            crs     k      w

``fill(scope, table)`` is the part of OLLIE's matching (4.3.1) that is the same for every
operator: the scope's body must be a product of two tensor reads (summed, where it sums); each
iterator is filled into the group of the tensors it indexes, and each index is read as an affine
form that is either one of the table's windows (its coefficients checked) or reads at most one
iterator of extent above 1 (an extent-1 iterator is a constant). A group may hold several
iterators (OLLIE's group mismatch): whether they merge into one dimension is the operator's
business. Each operator then checks its own constraints on the result, ``Filled``
(``rewriter.lower.operators``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rewriter.index import affine_coefficients, index_bounds
from rewriter.ir import Access, Binary, ExpressionError, Scope, Tensor

OPERANDS = ("input", "weight")


@dataclass(frozen=True)
class Group:
    """One row of a table: the iterators that index exactly these tensors."""

    name: str
    input: bool
    weight: bool
    output: bool

    @property
    def summed(self) -> bool:
        return not self.output

    @property
    def where(self) -> tuple[bool, bool, bool]:
        return self.input, self.weight, self.output


@dataclass(frozen=True)
class Window:
    """A correlated index of ``operand``: ``a*o + b*i + offset`` for an iterator o of group
    ``outer`` and i of group ``inner``. A coefficient given must be exactly that; one left None
    is a parameter of the match (a convolution's stride and dilation): any positive integer."""

    operand: str  # "input" or "weight"
    outer: str
    inner: str
    outer_coefficient: int | None = None
    inner_coefficient: int | None = None

    def roles(self, coefficients: dict[str, int], group_of: dict[str, str]) -> tuple[str, str] | None:
        """(outer iterator, inner iterator) where an index reading ``coefficients`` fills this
        window, else None."""
        if len(coefficients) != 2:
            return None
        outer = [n for n in coefficients if group_of.get(n) == self.outer]
        inner = [n for n in coefficients if group_of.get(n) == self.inner and n not in outer]
        if len(outer) != 1 or len(inner) != 1:
            return None
        for name, wanted in ((outer[0], self.outer_coefficient), (inner[0], self.inner_coefficient)):
            c = coefficients[name]
            if c <= 0 or (wanted is not None and c != wanted):
                return None
        return outer[0], inner[0]


@dataclass(frozen=True)
class IteratorTable:
    """An operator's iterator mapping table: its groups and its windows."""

    groups: tuple[Group, ...]
    windows: tuple[Window, ...] = ()

    def __post_init__(self):
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ExpressionError(f"iterator table: group names repeat: {names}")
        patterns = Counter(g.where for g in self.groups)
        if any(n > 1 for n in patterns.values()):
            raise ExpressionError(f"iterator table: two groups index the same tensors: {self}")
        if any(not (g.input or g.weight) for g in self.groups):
            raise ExpressionError(f"iterator table: every group must index the input or the weight: {self}")
        for w in self.windows:
            if w.operand not in OPERANDS or {w.outer, w.inner} - set(names):
                raise ExpressionError(f"iterator table: window {w} names an unknown operand or group")

    def group_of(self, input: bool, weight: bool, output: bool) -> Group | None:
        """The group of an iterator that indexes these tensors, or None."""
        return next((g for g in self.groups if g.where == (input, weight, output)), None)

    def __str__(self) -> str:
        """Each group with the tensors its iterators index, then each window."""
        rows = [
            f"{g.name} ({', '.join(t for t, on in zip(('input', 'weight', 'output'), g.where) if on)})"
            for g in self.groups
        ]
        windows = [
            f"{w.operand}[{w.outer_coefficient or 'a'}*{w.outer} + {w.inner_coefficient or 'b'}*{w.inner} + c]"
            for w in self.windows
        ]
        return "; ".join(rows + windows)


# --------------------------------------------------------------------------------------------
# Filling a scope into a table


@dataclass(frozen=True)
class IndexForm:
    """One index of an operand: ``sum(coefficients[i] * i) + constant`` over the scope's box,
    ranging over [lo, hi] against the tensor's ``extent``; ``window`` is the table's window it
    fills (with ``roles``: its outer and inner iterators), None for a plain index."""

    coefficients: dict[str, int]
    constant: int
    lo: int
    hi: int
    extent: int
    window: Window | None = None
    roles: tuple[str, str] | None = None

    @property
    def padded(self) -> bool:
        """Whether it reads outside the tensor (zero padding)."""
        return self.lo < 0 or self.hi >= self.extent


@dataclass(frozen=True)
class Read:
    """An operand of the product: its access and each index as an ``IndexForm``."""

    access: Access
    indices: tuple[IndexForm, ...]

    @property
    def tensor(self) -> str:
        return self.access.source.name

    @property
    def padded(self) -> bool:
        return any(f.padded for f in self.indices)

    @property
    def windows(self) -> list[IndexForm]:
        return [f for f in self.indices if f.window is not None]

    @property
    def plain(self) -> list[IndexForm]:
        return [f for f in self.indices if f.window is None]


@dataclass(frozen=True)
class Filled:
    """A scope filled into a table: its operands as ``Read``s and each group's iterators (in
    the scope's order; extent-1 iterators that fit no group are constants and left out)."""

    scope: Scope
    table: IteratorTable
    input: Read
    weight: Read
    groups: dict[str, tuple[str, ...]]

    @property
    def sizes(self) -> dict[str, int]:
        return {it.name: it.size for it in self.scope.iterators}


def operand_orders(scope: Scope) -> list[tuple[Access, Access]]:
    """(input, weight) both ways round for a product of two tensor reads (summed, where it
    sums), else nothing."""
    body = scope.body
    if scope.reduce != "sum" or not (isinstance(body, Binary) and body.op == "*"):
        return []
    if not all(isinstance(t, Access) and isinstance(t.source, Tensor) for t in (body.lhs, body.rhs)):
        return []
    return [(body.lhs, body.rhs), (body.rhs, body.lhs)]


def fill(scope: Scope, table: IteratorTable) -> list[Filled]:
    """The ways ``scope`` fills ``table`` (one per order of its operands; none if it does not):
    every iterator in the group of the tensors it indexes, every index a window of the table
    or a read of at most one iterator, every window of the table found (OLLIE 4.3.1, steps 1
    and 3: fill the table, check the coefficients)."""
    return [f for x, y in operand_orders(scope) if (f := _fill(scope, table, x, y)) is not None]


def _fill(scope: Scope, table: IteratorTable, x: Access, y: Access) -> Filled | None:
    forms = {}
    for operand, access in zip(OPERANDS, (x, y)):
        forms[operand] = [affine_coefficients(ix) for ix in access.indices]
        if any(f is None for f in forms[operand]):
            return None  # a / or % in an index: no operator reads that
    reads = {op: set().union(*(set(f[0]) for f in forms[op])) for op in OPERANDS}
    output = {it.name for it in scope.traversal}
    sizes = {it.name: it.size for it in scope.iterators}
    groups: dict[str, list[str]] = {g.name: [] for g in table.groups}
    group_of: dict[str, str] = {}
    for it in scope.iterators:
        group = table.group_of(it.name in reads["input"], it.name in reads["weight"], it.name in output)
        if group is None:
            if it.size == 1:
                continue  # an extent-1 iterator is a constant: it belongs to no group
            return None
        groups[group.name].append(it.name)
        group_of[it.name] = group.name
    box = scope.box
    filled = {}
    for operand, access in zip(OPERANDS, (x, y)):
        indices = []
        for ix, form, extent in zip(access.indices, forms[operand], access.source.shape):
            index = _index_form(ix, form, extent, box, sizes, group_of, table.windows, operand)
            if index is None:
                return None
            indices.append(index)
        filled[operand] = Read(access, tuple(indices))
    found = Counter(f.window for read in filled.values() for f in read.windows)
    if found != Counter(table.windows):
        return None
    return Filled(scope, table, filled["input"], filled["weight"], {g: tuple(n) for g, n in groups.items()})


def _index_form(ix, form, extent, box, sizes, group_of, windows, operand) -> IndexForm | None:
    coefficients, constant = form
    lo, hi = index_bounds(ix, box)
    for window in windows:
        roles = window.operand == operand and window.roles(coefficients, group_of)
        if roles:
            return IndexForm(coefficients, constant, lo, hi, extent, window, roles)
    if sum(sizes[n] > 1 for n in coefficients) > 1:
        return None  # several iterators in one index, and not a window of this operator
    return IndexForm(coefficients, constant, lo, hi, extent)
