"""The expression IR: OLLIE's tensor algebra expressions (paper section 3).

Everything here is an immutable, hashable dataclass, validated when it is built, and prints in the
project's text notation (``str(obj)``), which ``rewriter.ir.parse`` reads back to an equal object.

    Index    integer expressions of iterators (``rewriter.ir.indices``)
    Scalar   the body of a scope: Num, Access, Unary, Binary
    Scope    L traversal ; S summation ; body   (a scope can be read like a tensor: scope[i, j])
    Opaque   op(inputs; attributes): what scopes cannot express (a gather by indices known only
             at run time), run by a library; a definition of a program, never nested
    Program  a DAG of named definitions (scopes, opaque operations) connected by tensors

A read outside a tensor's bounds gives 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Union
from typing import Iterator as PyIterator

from .errors import ExpressionError
from .indices import Index, Var, as_index, format_index, index_vars
from .notation import (
    ARITHMETIC,
    ATOM,
    BINARY_FUNCTIONS,
    NEG,
    PRECEDENCE,
    REDUCTIONS,
    UNARY_FUNCTIONS,
    as_int,
    cached_hash,
    check_name,
    format_number,
    wrap,
)

Box = dict  # iterator name -> (lo, hi), half-open


def box(iterators: Iterable["Iterator"]) -> Box:
    """``{name: (lo, hi)}`` of iterators: the ranges index algebra and rules work over."""
    return {it.name: (it.lo, it.hi) for it in iterators}


# --------------------------------------------------------------------------------------------
# Scalar bodies


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
        return format_scalar(self)


@dataclass(frozen=True)
class Num(Scalar):
    """A finite numeric constant."""

    __hash__ = cached_hash

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

    __hash__ = cached_hash

    name: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_name("tensor", self.name)
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Iterable):
            raise ExpressionError(f"tensor {self.name}: shape {self.shape!r} is not a tuple of sizes")
        shape = tuple(as_int(d, f"tensor {self.name}: a dimension") for d in self.shape)
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

    __hash__ = cached_hash

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
                f"{_source_name(self.source)} has {rank} dimension(s) but is read with {len(indices)} index(es)"
            )


def _source_name(source: object) -> str:
    if isinstance(source, Tensor):
        return f"tensor {source.name}"
    return "nested scope"


@dataclass(frozen=True)
class Unary(Scalar):
    """``fn(arg)`` for a function of UNARY_FUNCTIONS; ``neg`` prints as ``-arg``."""

    __hash__ = cached_hash

    fn: str
    arg: Scalar

    def __post_init__(self) -> None:
        if self.fn not in UNARY_FUNCTIONS:
            raise ExpressionError(f"unknown function {self.fn!r}; known: {', '.join(sorted(UNARY_FUNCTIONS))}")
        object.__setattr__(self, "arg", _as_scalar(self.arg))


@dataclass(frozen=True)
class Binary(Scalar):
    """``lhs op rhs`` for ``+ - * /``, or ``max(lhs, rhs)``."""

    __hash__ = cached_hash

    op: str
    lhs: Scalar
    rhs: Scalar

    def __post_init__(self) -> None:
        if self.op not in ARITHMETIC and self.op not in BINARY_FUNCTIONS:
            raise ExpressionError(f"unknown scalar operator {self.op!r}")
        object.__setattr__(self, "lhs", _as_scalar(self.lhs))
        object.__setattr__(self, "rhs", _as_scalar(self.rhs))


def smax(a: Scalar | float, b: Scalar | float) -> Binary:
    """Element-wise maximum of two scalars."""
    return Binary("max", _as_scalar(a), _as_scalar(b))


# --------------------------------------------------------------------------------------------
# Scopes


@dataclass(frozen=True)
class Iterator:
    """An iterator and its range [lo, hi); prints ``x:hi`` when lo is 0, else ``x:lo..hi``."""

    __hash__ = cached_hash

    name: str
    lo: int
    hi: int

    def __post_init__(self) -> None:
        check_name("iterator", self.name)
        object.__setattr__(self, "lo", as_int(self.lo, f"iterator {self.name}: range start"))
        object.__setattr__(self, "hi", as_int(self.hi, f"iterator {self.name}: range end"))
        if self.hi <= self.lo:
            raise ExpressionError(
                f"iterator {self.name} has an empty range {self.lo}..{self.hi}"
                + (" (negative size)" if self.hi < self.lo else "")
            )

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def var(self) -> Var:
        return Var(self.name)

    def __str__(self) -> str:
        return f"{self.name}:{self.hi}" if self.lo == 0 else f"{self.name}:{self.lo}..{self.hi}"


@dataclass(frozen=True)
class Scope:
    """``L traversal ; S summation ; body``: OLLIE's scope.

    The traversal iterators, in order, are the dimensions of the result (their ranges its extent);
    the summation iterators are reduced (``reduce="sum"``, printed ``S``, or ``"max"``, printed
    ``M``) and their order carries no meaning. A scope is closed: its body reads only its own
    iterators, and a scope nested in another is read at indices of the outer iterators.
    """

    __hash__ = cached_hash

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
                raise ExpressionError(
                    f"duplicate iterator {it.name!r} in scope 'L {', '.join(map(str, self.traversal))}'"
                )
            seen.add(it.name)
        _check_body(self.body, seen)
        tensor_shapes(self)  # raises when a tensor name is used with two shapes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(it.size for it in self.traversal)

    @property
    def iterators(self) -> tuple[Iterator, ...]:
        return self.traversal + self.summation

    @property
    def box(self) -> Box:
        """``{name: (lo, hi)}`` of every iterator, traversal and summation."""
        return box(self.iterators)

    def with_body(self, body: Scalar) -> Scope:
        """The same iterators and reduction over another body."""
        return Scope(self.traversal, self.summation, body, self.reduce)

    def with_traversal(self, traversal: Iterable[Iterator]) -> Scope:
        """The same summation and body over other traversal ranges."""
        return Scope(tuple(traversal), self.summation, self.body, self.reduce)

    def __getitem__(self, indices) -> Access:
        return Access(self, indices)

    def __str__(self) -> str:
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


def tensor_shapes(expr: Scope | Opaque | Program) -> dict[str, tuple[int, ...]]:
    """Input tensor name -> shape, over nested scopes too; refuses one name with two shapes.
    Computed once per node (nodes are immutable; programs and rules ask often)."""
    if isinstance(expr, Program):
        return expr.inputs
    cached = expr.__dict__.get("_tensor_shapes")
    if cached is None:
        cached = _tensor_shapes(expr)
        object.__setattr__(expr, "_tensor_shapes", cached)
    return dict(cached)


def _tensor_shapes(expr: Scope | Opaque) -> dict[str, tuple[int, ...]]:
    reads = (
        [{t.name: t.shape} for t in expr.inputs]
        if isinstance(expr, Opaque)
        else (
            {access.source.name: access.source.shape}
            if isinstance(access.source, Tensor)
            else tensor_shapes(access.source)
            for access in accesses(expr.body)
        )
    )
    shapes: dict[str, tuple[int, ...]] = {}
    for inner in reads:
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


def distinct_scopes(expr: Scope) -> list[Scope]:
    """``expr`` and every scope nested in it, each once (outermost first): a scope read twice,
    as a softmax's exponentials are by its sum and by its quotient, is entered once, where
    ``nested_scopes`` walks it at every read (a fused kernel of a few primitives nests hundreds
    of such reads)."""
    seen, order = {expr}, [expr]
    for scope in order:  # grows as it goes
        for access in accesses(scope.body):
            if isinstance(access.source, Scope) and access.source not in seen:
                seen.add(access.source)
                order.append(access.source)
    return order


# --------------------------------------------------------------------------------------------
# Opaque operations


def _gather_shape(data: Tensor, indices: Tensor, axis: int) -> tuple[int, ...]:
    return data.shape[:axis] + indices.shape + data.shape[axis + 1 :]


def _gather_elements_shape(data: Tensor, indices: Tensor, axis: int) -> tuple[int, ...]:
    if indices.rank != data.rank:
        raise ExpressionError(
            f"gather_elements: indices {indices.name} must have the rank of {data.name} ({data.rank})"
        )
    return indices.shape


# op -> (its input roles, its integer attributes, its output shape from inputs and attributes)
OPAQUE_OPS = {
    "gather": (("data", "indices"), ("axis",), _gather_shape),
    "gather_elements": (("data", "indices"), ("axis",), _gather_elements_shape),
}


@dataclass(frozen=True)
class Opaque:
    """``op(inputs; attributes)``: a program definition the scope language cannot express,
    computed by a library (``rewriter.semantics.run_opaque``). ``gather(W, ids; axis=0)`` reads
    ``W`` at the integer-valued entries of ``ids`` along ``axis`` (ONNX Gather: negative indices
    count from the end), where ``ids`` is known only at run time (token embeddings);
    ``gather_elements(X, I; axis=1)`` reads ``X`` at ``I``'s entries along ``axis`` and at I's own
    position along the other axes (ONNX GatherElements, torch's gather). The optimizer derives
    the scopes around it; it runs as written."""

    __hash__ = cached_hash

    op: str
    inputs: tuple[Tensor, ...]
    attributes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.op not in OPAQUE_OPS:
            raise ExpressionError(f"unknown opaque operation {self.op!r}; known: {', '.join(sorted(OPAQUE_OPS))}")
        roles, names, shape = OPAQUE_OPS[self.op]
        inputs = tuple(self.inputs)
        if len(inputs) != len(roles) or not all(isinstance(t, Tensor) for t in inputs):
            raise ExpressionError(f"{self.op} takes {len(roles)} tensors ({', '.join(roles)}), got {inputs!r}")
        given = dict(self.attributes)
        if sorted(given) != sorted(names):
            raise ExpressionError(
                f"{self.op} takes the attributes {', '.join(names)}, got {', '.join(given) or 'none'}"
            )
        values = {n: as_int(given[n], f"{self.op}: attribute {n}") for n in names}
        if "axis" in values:
            rank = inputs[0].rank
            if not -rank <= values["axis"] < rank:
                raise ExpressionError(
                    f"{self.op}: axis {values['axis']} is out of range for {inputs[0].name} of rank {rank}"
                )
            values["axis"] %= rank
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "attributes", tuple((n, values[n]) for n in names))
        object.__setattr__(self, "_shape", shape(*inputs, *(values[n] for n in names)))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape  # type: ignore[attr-defined]

    def attribute(self, name: str) -> int:
        return dict(self.attributes)[name]

    def __str__(self) -> str:
        settings = ", ".join(f"{n}={v}" for n, v in self.attributes)
        return f"{self.op}({', '.join(t.name for t in self.inputs)}{'; ' + settings if settings else ''})"


Definition = Union[Scope, Opaque]


# --------------------------------------------------------------------------------------------
# Programs


@dataclass(frozen=True)
class Program:
    """Named definitions (scopes, opaque operations) in execution order; a later one reads an
    earlier one as a Tensor by name."""

    __hash__ = cached_hash

    definitions: tuple[tuple[str, Definition], ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "definitions", tuple((n, e) for n, e in self.definitions))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        defined: dict[str, tuple[int, ...]] = {}
        inputs: dict[str, tuple[int, ...]] = {}
        for name, expr in self.definitions:
            check_name("tensor", name)
            if not isinstance(expr, (Scope, Opaque)):
                raise ExpressionError(f"definition of {name} is not a Scope or an Opaque operation")
            if name in defined or name in inputs:
                raise ExpressionError(
                    f"tensor {name} is defined twice"
                    if name in defined
                    else f"tensor {name} is read before it is defined"
                )
            for tensor, shape in tensor_shapes(expr).items():
                if tensor in defined and defined[tensor] != shape:
                    raise ExpressionError(
                        f"{name} reads {tensor} with shape {shape}, but {tensor} has shape {defined[tensor]}"
                    )
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
        return format_program(self)


# --------------------------------------------------------------------------------------------
# Printing (the notation; ``rewriter.ir.parse`` reads it back)


def _scalar_precedence(body: Scalar) -> int:
    match body:
        case Binary(op, _, _) if op in PRECEDENCE:
            return PRECEDENCE[op]
        case Unary("neg", _):
            return NEG
        case Num(value) if value < 0 or str(value).startswith("-"):
            return NEG
    return ATOM


def format_scalar(body: Scalar) -> str:
    match body:
        case Num(value):
            return format_number(value)
        case Access(source, indices):
            name = source.name if isinstance(source, Tensor) else "{ " + format_scope(source) + " }"
            return f"{name}[{', '.join(format_index(ix) for ix in indices)}]"
        case Unary("neg", arg):
            text = format_scalar(arg)
            return "-" + (f"({text})" if _scalar_precedence(arg) <= NEG or isinstance(arg, Num) else text)
        case Unary(fn, arg):
            return f"{fn}({format_scalar(arg)})"
        case Binary(op, lhs, rhs) if op in PRECEDENCE:
            prec = PRECEDENCE[op]
            left = wrap(format_scalar(lhs), _scalar_precedence(lhs), prec)
            right = wrap(format_scalar(rhs), _scalar_precedence(rhs), prec + 1)
            return f"{left} {op} {right}"
        case Binary(fn, lhs, rhs):
            return f"{fn}({format_scalar(lhs)}, {format_scalar(rhs)})"
    raise TypeError(f"not a scalar: {body!r}")


def format_scope(scope: Scope) -> str:
    """The paper's notation of a scope, written once per scope (fingerprints compare texts)."""
    text = scope.__dict__.get("_text")
    if text is None:
        parts = ["L " + ", ".join(map(str, scope.traversal)) if scope.traversal else "L"]
        if scope.summation:
            parts.append(REDUCTIONS[scope.reduce] + " " + ", ".join(map(str, scope.summation)))
        parts.append(format_scalar(scope.body))
        text = " ; ".join(parts)
        object.__setattr__(scope, "_text", text)
    return text


def format_program(program: Program) -> str:
    lines = [f"{name} = {expr}" for name, expr in program.definitions]
    lines.append("return " + ", ".join(program.outputs))
    return "\n".join(lines)
