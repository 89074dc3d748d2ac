"""The expression IR: OLLIE's tensor algebra expressions (paper section 3).

Everything here is an immutable, hashable dataclass, validated when it is built, and prints in the
project's text notation (``str(obj)``), which ``rewriter.parse`` reads back to an equal object.

    Index    integer expressions of iterators: Var, Lit, IndexNeg, IndexOp (+ - * / %)
    Scalar   the body of a scope: Num, Access, Unary, Binary
    Scope    L traversal ; S summation ; body   (a scope can be read like a tensor: scope[i, j])
    Program  a DAG of named scopes connected by tensors

Index division ``/`` is floor division and ``%`` its remainder, by positive constants only; a
multiplication needs a constant on one side, so every index is quasi-affine. A read outside a
tensor's bounds gives 0.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from dataclasses import dataclass
from typing import Iterable, Iterator as PyIterator, Union

from .errors import ExpressionError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")
# Words the notation reserves: the scope keywords and the function names.
KEYWORDS = frozenset({"L", "S", "M", "return"})


def _check_name(kind: str, name: object) -> None:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ExpressionError(f"{kind} name {name!r} is not an identifier")
    if name in KEYWORDS or name in UNARY_FUNCTIONS or name in BINARY_FUNCTIONS:
        raise ExpressionError(f"{kind} name {name!r} is a reserved word of the notation")


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers are fine; floats and everything else are not
        if hasattr(value, "__index__") and not isinstance(value, bool):
            return int(value.__index__())  # type: ignore[union-attr]
        raise ExpressionError(f"{what} must be an integer, got {value!r}")
    return value


def _cached_hash(self) -> int:
    """Hash of a frozen IR node, computed once: trees are hashed often (memo and e-graph keys)."""
    cached = self.__dict__.get("_hash")
    if cached is None:
        cached = hash((type(self).__name__, *(getattr(self, name) for name in self.__dataclass_fields__)))
        object.__setattr__(self, "_hash", cached)
    return cached


# --------------------------------------------------------------------------------------------
# Index expressions


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
        from .printer import format_index

        return format_index(self)


@dataclass(frozen=True, eq=True)
class Var(Index):
    """An iterator used in an index."""

    __hash__ = _cached_hash

    name: str

    def __post_init__(self) -> None:
        _check_name("iterator", self.name)


@dataclass(frozen=True)
class Lit(Index):
    """An integer constant in an index."""

    __hash__ = _cached_hash

    value: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _as_int(self.value, "an index constant"))


@dataclass(frozen=True)
class IndexNeg(Index):
    __hash__ = _cached_hash

    arg: Index


INDEX_OPS = ("+", "-", "*", "/", "%")


@dataclass(frozen=True)
class IndexOp(Index):
    """``lhs op rhs``; ``*`` needs a constant side, ``/`` and ``%`` a positive constant divisor."""

    __hash__ = _cached_hash

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
    return Lit(_as_int(value, "an index"))


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


# --------------------------------------------------------------------------------------------
# Scalar bodies

# name -> numpy implementation; the single place to add a function to the notation.
UNARY_FUNCTIONS = {
    "neg": "negative",
    "relu": "relu",
    "exp": "exp",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "sqrt": "sqrt",
}
BINARY_FUNCTIONS = {"max": "maximum"}
ARITHMETIC = ("+", "-", "*", "/")


def _as_scalar(value: object) -> Scalar:
    if isinstance(value, Scalar):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Num(float(value))
    raise ExpressionError(f"{value!r} is not a scalar expression")


class Scalar:
    """A scalar expression: the body of a scope. Python operators build trees."""

    __slots__ = ()

    def __add__(self, other):
        return Binary("+", self, _as_scalar(other))

    def __radd__(self, other):
        return Binary("+", _as_scalar(other), self)

    def __sub__(self, other):
        return Binary("-", self, _as_scalar(other))

    def __rsub__(self, other):
        return Binary("-", _as_scalar(other), self)

    def __mul__(self, other):
        return Binary("*", self, _as_scalar(other))

    def __rmul__(self, other):
        return Binary("*", _as_scalar(other), self)

    def __truediv__(self, other):
        return Binary("/", self, _as_scalar(other))

    def __rtruediv__(self, other):
        return Binary("/", _as_scalar(other), self)

    def __neg__(self):
        return Unary("neg", self)

    def __str__(self) -> str:
        from .printer import format_scalar

        return format_scalar(self)


@dataclass(frozen=True)
class Num(Scalar):
    """A finite numeric constant."""

    __hash__ = _cached_hash

    value: float

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            if not hasattr(self.value, "__float__"):
                raise ExpressionError(f"constant {self.value!r} is not a number")
        value = float(self.value)  # type: ignore[arg-type]
        if not math.isfinite(value):
            raise ExpressionError(f"constant {value} is not finite")
        object.__setattr__(self, "value", value)


@dataclass(frozen=True)
class Tensor:
    """An input tensor: a name and a shape. ``T[i, j]`` builds an Access."""

    __hash__ = _cached_hash

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_name("tensor", self.name)
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Iterable):
            raise ExpressionError(f"tensor {self.name}: shape {self.shape!r} is not a tuple of sizes")
        shape = tuple(_as_int(d, f"tensor {self.name}: a dimension") for d in self.shape)
        for axis, size in enumerate(shape):
            if size <= 0:
                raise ExpressionError(f"tensor {self.name}: dimension {axis} has size {size}, must be positive")
        object.__setattr__(self, "shape", shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __getitem__(self, indices) -> Access:
        return Access(self, indices)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Access(Scalar):
    """``source[indices]``: a read of an input tensor or of a nested scope (0 out of bounds)."""

    __hash__ = _cached_hash

    source: Union[Tensor, "Scope"]
    indices: tuple[Index, ...]

    def __post_init__(self) -> None:
        raw = self.indices if isinstance(self.indices, tuple) else (self.indices,)
        if len(raw) == 1 and isinstance(raw[0], (list, tuple)):
            raw = tuple(raw[0])
        indices = []
        for position, ix in enumerate(raw):
            try:
                indices.append(as_index(ix))
            except ExpressionError as err:
                raise ExpressionError(f"{_source_name(self.source)}, index {position}: {err}") from None
        object.__setattr__(self, "indices", tuple(indices))
        if not isinstance(self.source, (Tensor, Scope)):
            raise ExpressionError(f"cannot read from {self.source!r}: not a tensor or a scope")
        rank = len(self.source.shape)
        if rank != len(indices):
            raise ExpressionError(
                f"{_source_name(self.source)} has {rank} dimension(s) but is read with "
                f"{len(indices)} index(es)"
            )


def _source_name(source: object) -> str:
    if isinstance(source, Tensor):
        return f"tensor {source.name}"
    return "nested scope"


@dataclass(frozen=True)
class Unary(Scalar):
    """``fn(arg)`` for a function of UNARY_FUNCTIONS; ``neg`` prints as ``-arg``."""

    __hash__ = _cached_hash

    fn: str
    arg: Scalar

    def __post_init__(self) -> None:
        if self.fn not in UNARY_FUNCTIONS:
            raise ExpressionError(f"unknown function {self.fn!r}; known: {', '.join(sorted(UNARY_FUNCTIONS))}")
        object.__setattr__(self, "arg", _as_scalar(self.arg))


@dataclass(frozen=True)
class Binary(Scalar):
    """``lhs op rhs`` for ``+ - * /``, or ``max(lhs, rhs)``."""

    __hash__ = _cached_hash

    op: str
    lhs: Scalar
    rhs: Scalar

    def __post_init__(self) -> None:
        if self.op not in ARITHMETIC and self.op not in BINARY_FUNCTIONS:
            raise ExpressionError(f"unknown scalar operator {self.op!r}")
        object.__setattr__(self, "lhs", _as_scalar(self.lhs))
        object.__setattr__(self, "rhs", _as_scalar(self.rhs))


def unary(fn: str, arg: Scalar) -> Unary:
    return Unary(fn, arg)


def smax(a: Scalar | float, b: Scalar | float) -> Binary:
    """Element-wise maximum of two scalars."""
    return Binary("max", _as_scalar(a), _as_scalar(b))


# --------------------------------------------------------------------------------------------
# Scopes


@dataclass(frozen=True)
class Iterator:
    """An iterator and its range [lo, hi); prints ``x:hi`` when lo is 0, else ``x:lo..hi``."""

    __hash__ = _cached_hash

    name: str
    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_name("iterator", self.name)
        object.__setattr__(self, "lo", _as_int(self.lo, f"iterator {self.name}: range start"))
        object.__setattr__(self, "hi", _as_int(self.hi, f"iterator {self.name}: range end"))
        if self.hi <= self.lo:
            raise ExpressionError(
                f"iterator {self.name} has an empty range {self.lo}..{self.hi}" + (" (negative size)" if self.hi < self.lo else "")
            )

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def var(self) -> Var:
        return Var(self.name)

    def __str__(self) -> str:
        return f"{self.name}:{self.hi}" if self.lo == 0 else f"{self.name}:{self.lo}..{self.hi}"


REDUCTIONS = {"sum": "S", "max": "M"}


@dataclass(frozen=True)
class Scope:
    """``L traversal ; S summation ; body``: OLLIE's scope.

    The traversal iterators, in order, are the dimensions of the result (their ranges its extent);
    the summation iterators are reduced (``reduce="sum"``, printed ``S``, or ``"max"``, printed
    ``M``) and their order carries no meaning. A scope is closed: its body reads only its own
    iterators, and a scope nested in another is read at indices of the outer iterators.
    """

    __hash__ = _cached_hash

    traversal: tuple[Iterator, ...]
    summation: tuple[Iterator, ...]
    body: Scalar
    reduce: str = "sum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "traversal", tuple(self.traversal))
        object.__setattr__(self, "summation", tuple(self.summation))
        object.__setattr__(self, "body", _as_scalar(self.body))
        if self.reduce not in REDUCTIONS:
            raise ExpressionError(f"unknown reduction {self.reduce!r}; known: {', '.join(REDUCTIONS)}")
        if not self.summation:
            object.__setattr__(self, "reduce", "sum")  # nothing is reduced: one canonical form
        seen: set[str] = set()
        for it in self.traversal + self.summation:
            if not isinstance(it, Iterator):
                raise ExpressionError(f"{it!r} is not an Iterator")
            if it.name in seen:
                raise ExpressionError(f"duplicate iterator {it.name!r} in scope 'L {', '.join(map(str, self.traversal))}'")
            seen.add(it.name)
        _check_body(self.body, seen)
        tensor_shapes(self)  # raises when a tensor name is used with two shapes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(it.size for it in self.traversal)

    @property
    def iterators(self) -> tuple[Iterator, ...]:
        return self.traversal + self.summation

    def __getitem__(self, indices) -> Access:
        return Access(self, indices)

    def __str__(self) -> str:
        from .printer import format_scope

        return format_scope(self)


def _check_body(body: Scalar, bound: set[str]) -> None:
    for access in accesses(body):
        for position, ix in enumerate(access.indices):
            unbound = index_vars(ix) - bound
            if unbound:
                raise ExpressionError(
                    f"unbound iterator {sorted(unbound)[0]!r} in index {position} ({ix}) of "
                    f"{_source_name(access.source)}"
                )


def children(body: Scalar) -> tuple[Scalar, ...]:
    match body:
        case Unary(_, arg):
            return (arg,)
        case Binary(_, lhs, rhs):
            return (lhs, rhs)
    return ()


def accesses(body: Scalar) -> PyIterator[Access]:
    """The accesses of a body, left to right, not entering nested scopes."""
    if isinstance(body, Access):
        yield body
    for child in children(body):
        yield from accesses(child)


def tensor_shapes(expr: Scope | Program) -> dict[str, tuple[int, ...]]:
    """Input tensor name -> shape, over nested scopes too; refuses one name with two shapes."""
    if isinstance(expr, Program):
        return expr.inputs
    shapes: dict[str, tuple[int, ...]] = {}
    for access in accesses(expr.body):
        inner = {access.source.name: access.source.shape} if isinstance(access.source, Tensor) else tensor_shapes(access.source)
        for name, shape in inner.items():
            if shapes.setdefault(name, shape) != shape:
                raise ExpressionError(f"tensor {name} is used with two shapes, {shapes[name]} and {shape}")
    return shapes


def nested_scopes(expr: Scope) -> PyIterator[Scope]:
    """Every scope nested in ``expr`` (innermost first), not ``expr`` itself."""
    for access in accesses(expr.body):
        if isinstance(access.source, Scope):
            yield from nested_scopes(access.source)
            yield access.source


# --------------------------------------------------------------------------------------------
# Programs


@dataclass(frozen=True)
class Program:
    """Named scopes in execution order; a later scope reads an earlier one as a Tensor by name."""

    __hash__ = _cached_hash

    definitions: tuple[tuple[str, Scope], ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "definitions", tuple((n, e) for n, e in self.definitions))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        defined: dict[str, tuple[int, ...]] = {}
        inputs: dict[str, tuple[int, ...]] = {}
        for name, expr in self.definitions:
            _check_name("tensor", name)
            if not isinstance(expr, Scope):
                raise ExpressionError(f"definition of {name} is not a Scope")
            if name in defined or name in inputs:
                raise ExpressionError(f"tensor {name} is defined twice" if name in defined else f"tensor {name} is read before it is defined")
            for tensor, shape in tensor_shapes(expr).items():
                if tensor in defined and defined[tensor] != shape:
                    raise ExpressionError(f"{name} reads {tensor} with shape {shape}, but {tensor} has shape {defined[tensor]}")
                if tensor not in defined and inputs.setdefault(tensor, shape) != shape:
                    raise ExpressionError(f"tensor {tensor} is used with two shapes, {inputs[tensor]} and {shape}")
            defined[name] = expr.shape
        if not self.outputs:
            raise ExpressionError("a program needs at least one output")
        for out in self.outputs:
            if out not in defined:
                raise ExpressionError(f"output {out!r} is not defined by the program")
        object.__setattr__(self, "_inputs", inputs)

    @property
    def inputs(self) -> dict[str, tuple[int, ...]]:
        return dict(self._inputs)  # type: ignore[attr-defined]

    def __str__(self) -> str:
        from .printer import format_program

        return format_program(self)


# --------------------------------------------------------------------------------------------
# Substitution of iterators (rules use it to rename, substitute and inline)


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
            inner = Scope(source.traversal, source.summation, replace_reads(source.body, name, make), source.reduce)
            return Access(inner, access.indices)
        return make(access.indices) if source.name == name else access

    return map_accesses(body, read)


def rename_tensors(scope: Scope, names: dict[str, str]) -> Scope:
    """``scope`` reading tensor ``names[t]`` wherever it read ``t`` (all at once, nested scopes
    included), so swapping two names works."""

    def read(access: Access) -> Scalar:
        source = access.source
        if isinstance(source, Scope):
            return Access(rename_tensors(source, names), access.indices)
        return Tensor(names[source.name], source.shape)[access.indices] if source.name in names else access

    return Scope(scope.traversal, scope.summation, map_accesses(scope.body, read), scope.reduce)


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
