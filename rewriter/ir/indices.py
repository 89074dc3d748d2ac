"""Index expressions: integer expressions of iterators (OLLIE section 3).

``Var``, ``Lit``, ``IndexNeg`` and ``IndexOp`` (``+ - * / %``); Python operators build trees
(``h + r - 1``). ``/`` is floor division and ``%`` its remainder, by positive constants only; a
multiplication needs a constant on one side, so every index is quasi-affine. An index prints in
the notation (``str(ix)``) and ``rewriter.ir.parse`` reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from .errors import ExpressionError
from .notation import ATOM, INDEX_OPS, NEG, PRECEDENCE, as_int, cached_hash, check_name, wrap


class Index:
    """An integer expression of iterators. Python operators build trees: ``h + r - 1``."""

    __slots__ = ()

    def __add__(self, other: IndexLike) -> Index:
        if isinstance(other, int) and other == 0:
            return self
        if isinstance(other, int) and other < 0:
            return IndexOp("-", self, Lit(-other))
        return IndexOp("+", self, as_index(other))

    def __radd__(self, other: IndexLike) -> Index:
        return IndexOp("+", as_index(other), self)

    def __sub__(self, other: IndexLike) -> Index:
        if isinstance(other, int) and other == 0:
            return self
        if isinstance(other, int) and other < 0:
            return IndexOp("+", self, Lit(-other))
        return IndexOp("-", self, as_index(other))

    def __rsub__(self, other: IndexLike) -> Index:
        return IndexOp("-", as_index(other), self)

    def __mul__(self, other: IndexLike) -> Index:
        return IndexOp("*", self, as_index(other))

    def __rmul__(self, other: IndexLike) -> Index:
        return IndexOp("*", as_index(other), self)

    def __floordiv__(self, other: IndexLike) -> Index:
        return IndexOp("/", self, as_index(other))

    def __mod__(self, other: IndexLike) -> Index:
        return IndexOp("%", self, as_index(other))

    def __neg__(self) -> Index:
        return IndexNeg(self)

    def __str__(self) -> str:
        return format_index(self)


@dataclass(frozen=True, eq=True)
class Var(Index):
    """An iterator used in an index."""

    __hash__ = cached_hash

    name: str

    def __post_init__(self) -> None:
        check_name("iterator", self.name)


@dataclass(frozen=True)
class Lit(Index):
    """An integer constant in an index."""

    __hash__ = cached_hash

    value: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", as_int(self.value, "an index constant"))


@dataclass(frozen=True)
class IndexNeg(Index):
    __hash__ = cached_hash

    arg: Index


@dataclass(frozen=True)
class IndexOp(Index):
    """``lhs op rhs``; ``*`` needs a constant side, ``/`` and ``%`` a positive constant divisor."""

    __hash__ = cached_hash

    op: str
    lhs: Index
    rhs: Index

    def __post_init__(self) -> None:
        if self.op not in INDEX_OPS:
            raise ExpressionError(f"unknown index operator {self.op!r}")
        for side in (self.lhs, self.rhs):
            if not isinstance(side, Index):
                raise ExpressionError(f"index operand {side!r} is not an index expression")
        if self.op == "*" and index_vars(self.lhs) and index_vars(self.rhs):
            raise ExpressionError(
                f"non-affine index {self}: it multiplies iterators "
                f"{sorted(index_vars(self.lhs))} and {sorted(index_vars(self.rhs))}"
            )
        if self.op in "/%":
            if index_vars(self.rhs):
                raise ExpressionError(f"non-affine index {self}: the divisor must be a constant")
            divisor = constant_value(self.rhs)
            if divisor == 0:
                raise ExpressionError(f"division by zero in index {self}")
            if divisor < 0:
                raise ExpressionError(f"non-positive divisor {divisor} in index {self}")


IndexLike = Union[Index, int]


def as_index(value: IndexLike | str) -> Index:
    """An ``Index`` from an Index, an int or an iterator name."""
    if isinstance(value, Index):
        return value
    if isinstance(value, str):
        return Var(value)
    return Lit(as_int(value, "an index"))


@lru_cache(maxsize=1 << 16)
def index_vars(ix: Index) -> frozenset[str]:
    """The iterator names an index reads (cached: the search asks about the same indices often)."""
    match ix:
        case Var(name):
            return frozenset((name,))
        case Lit():
            return frozenset()
        case IndexNeg(arg):
            return index_vars(arg)
        case IndexOp(_, lhs, rhs):
            return index_vars(lhs) | index_vars(rhs)
    raise ExpressionError(f"{ix!r} is not an index expression")


def eval_index(ix: Index, env: dict) -> object:
    """Evaluate an index on ints or integer numpy arrays (floor semantics for / and %)."""
    match ix:
        case Var(name):
            return env[name]
        case Lit(value):
            return value
        case IndexNeg(arg):
            return -eval_index(arg, env)  # type: ignore[operator]
        case IndexOp(op, lhs, rhs):
            a, b = eval_index(lhs, env), eval_index(rhs, env)
            if op == "+":
                return a + b  # type: ignore[operator]
            if op == "-":
                return a - b  # type: ignore[operator]
            if op == "*":
                return a * b  # type: ignore[operator]
            if op == "/":
                return a // b  # type: ignore[operator]
            return a % b  # type: ignore[operator]
    raise ExpressionError(f"{ix!r} is not an index expression")


def constant_value(ix: Index) -> int:
    """The value of an index without iterators."""
    if index_vars(ix):
        raise ExpressionError(f"index {ix} is not a constant")
    return int(eval_index(ix, {}))  # type: ignore[arg-type]


def substitute_index(ix: Index, mapping: dict[str, Index]) -> Index:
    """``ix`` with each iterator named in ``mapping`` replaced by its index expression."""
    match ix:
        case Var(name):
            return mapping.get(name, ix)
        case Lit():
            return ix
        case IndexNeg(arg):
            return IndexNeg(substitute_index(arg, mapping))
        case IndexOp(op, lhs, rhs):
            return IndexOp(op, substitute_index(lhs, mapping), substitute_index(rhs, mapping))
    raise ExpressionError(f"{ix!r} is not an index expression")


# --------------------------------------------------------------------------------------------
# Printing


def _precedence(ix: Index) -> int:
    match ix:
        case IndexOp(op, _, _):
            return PRECEDENCE[op]
        case IndexNeg():
            return NEG
        case Lit(value) if value < 0:
            return NEG
    return ATOM


def format_index(ix: Index) -> str:
    match ix:
        case Var(name):
            return name
        case Lit(value):
            return str(value)
        case IndexNeg(arg):
            # "-(2)" keeps IndexNeg(Lit(2)) apart from Lit(-2), which prints "-2"
            text = format_index(arg)
            return "-" + (f"({text})" if _precedence(arg) <= NEG or isinstance(arg, Lit) else text)
        case IndexOp(op, lhs, rhs):
            prec = PRECEDENCE[op]
            left = wrap(format_index(lhs), _precedence(lhs), prec)
            right = wrap(format_index(rhs), _precedence(rhs), prec + 1)
            return f"{left}{op}{right}"
    raise TypeError(f"not an index: {ix!r}")
