"""The e-graph: scopes in egglog, with fast text insertion and conversion back to the IR.

Three layers:

* The **encoding**: egglog-python ``Expr`` classes that mirror the IR one to one, with fixed egglog
  names, so that a term can be built in Python (for rules) or written as egglog text (for speed)::

      sort Index      (IVar String) (ILit i64) (IAdd Index Index) (ISub Index Index)
                      (IMul Index Index) (IDiv Index Index) (IMod Index Index) (INeg Index)
      sort IndexList  (IxNil) (IxCons Index IndexList)
      sort Iter       (It String i64 i64)                       ; name, lo, hi
      sort IterList   (ItNil) (ItCons Iter IterList)
      sort Tensor     (Input String String) (Nested Scope)      ; name, shape "1x7x7x512"
      sort Scalar     (Num f64) (Access Tensor IndexList) (Unary String Scalar)
                      (Binary String Scalar Scalar)             ; op: + - * / max
      sort Scope      (MkScope IterList IterList Scalar String) ; traversal, summation, body, "sum"|"max"
                      (Ref i64)                                 ; unextractable: ExpressionGraph handles

  The Scope constructor is ``MkScope`` because egglog refuses a constructor named like a sort.
  ``IDiv``/``IMod`` take an Index divisor (not an i64): the IR allows any constant index there
  (``i/(1+1)``), and the encoding is lossless. The eager rules fold constant divisors to ``ILit``.

* **Conversion**: ``to_egglog(scope)`` writes the s-expression (pure string building, memoised
  per index and iterator), ``from_egglog(text)`` reads one back (as egglog prints an extracted
  term); ``from_egglog(to_egglog(e)) == e`` for every Scope.

* ``ExpressionGraph``: an egglog ``EGraph`` (``.egraph``, the high-level egglog-python object, for
  rules written over the classes below: ``graph.register(rewrite(...).to(...))``) into which scopes
  are inserted as text through the low-level bindings (see ``bench/egraph_boundary.py`` for the
  costs): ``add`` (returns a handle ``"(Ref N)"``), ``union``, ``flush``, ``run``, ``size``,
  ``equivalent``, ``extract``, with time counters in ``graph.stats``.

``eager_rules`` is the egglog ruleset of cheap, always-safe simplifications (index constant
folding, ``x+0``, ``1*x``, ``0*x``, ``x*1.0``, ``x+0.0``). It deliberately contains no
associativity or commutativity: those blow the e-graph up.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Callable, Union

from egglog import (
    EGraph as EgglogGraph,
)
from egglog import (
    Expr,
    Ruleset,
    Schedule,
    StringLike,
    bindings,
    f64Like,
    i64,
    i64Like,
    method,
    rewrite,
    ruleset,
    vars_,
)
from egglog import (
    run as run_schedule,
)
from egglog.egraph import _CostModel  # private, but the only way to plug a Python cost model into a raw extractor

from rewriter.ir import (
    Access,
    Binary,
    ExpressionError,
    Index,
    IndexNeg,
    IndexOp,
    Iterator,
    Lit,
    Num,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
)

__all__ = [
    "IndexTerm",
    "IndexListTerm",
    "IterTerm",
    "IterListTerm",
    "TensorTerm",
    "ScalarTerm",
    "ScopeTerm",
    "CONSTRUCTORS",
    "eager_rules",
    "to_egglog",
    "from_egglog",
    "to_term",
    "ExpressionGraph",
    "GraphStats",
    "DEFAULT_BATCH_SIZE",
]

# --------------------------------------------------------------------------------------------
# The encoding


class IndexTerm(Expr, egg_sort="Index"):
    """An ``Index`` in the e-graph."""

    @method(egg_fn="IVar")
    @classmethod
    def var(cls, name: StringLike) -> IndexTerm: ...

    @method(egg_fn="ILit")
    @classmethod
    def lit(cls, value: i64Like) -> IndexTerm: ...

    @method(egg_fn="IAdd")
    @classmethod
    def add(cls, lhs: IndexTerm, rhs: IndexTerm) -> IndexTerm: ...

    @method(egg_fn="ISub")
    @classmethod
    def sub(cls, lhs: IndexTerm, rhs: IndexTerm) -> IndexTerm: ...

    @method(egg_fn="IMul")
    @classmethod
    def mul(cls, lhs: IndexTerm, rhs: IndexTerm) -> IndexTerm: ...

    @method(egg_fn="IDiv")
    @classmethod
    def div(cls, lhs: IndexTerm, rhs: IndexTerm) -> IndexTerm: ...

    @method(egg_fn="IMod")
    @classmethod
    def mod(cls, lhs: IndexTerm, rhs: IndexTerm) -> IndexTerm: ...

    @method(egg_fn="INeg")
    @classmethod
    def neg(cls, arg: IndexTerm) -> IndexTerm: ...


class IndexListTerm(Expr, egg_sort="IndexList"):
    """The indices of an access, as a cons list."""

    @method(egg_fn="IxNil")
    @classmethod
    def nil(cls) -> IndexListTerm: ...

    @method(egg_fn="IxCons")
    @classmethod
    def cons(cls, head: IndexTerm, tail: IndexListTerm) -> IndexListTerm: ...


class IterTerm(Expr, egg_sort="Iter"):
    """An ``Iterator``: name and range [lo, hi)."""

    @method(egg_fn="It")
    @classmethod
    def make(cls, name: StringLike, lo: i64Like, hi: i64Like) -> IterTerm: ...


class IterListTerm(Expr, egg_sort="IterList"):
    """Traversal or summation iterators, as a cons list."""

    @method(egg_fn="ItNil")
    @classmethod
    def nil(cls) -> IterListTerm: ...

    @method(egg_fn="ItCons")
    @classmethod
    def cons(cls, head: IterTerm, tail: IterListTerm) -> IterListTerm: ...


class TensorTerm(Expr, egg_sort="Tensor"):
    """What an access reads: an input tensor (name, shape ``"1x7x7x512"``) or a nested scope."""

    @method(egg_fn="Input")
    @classmethod
    def input(cls, name: StringLike, shape: StringLike) -> TensorTerm: ...

    @method(egg_fn="Nested")
    @classmethod
    def nested(cls, scope: ScopeTerm) -> TensorTerm: ...


class ScalarTerm(Expr, egg_sort="Scalar"):
    """A scope body."""

    @method(egg_fn="Num")
    @classmethod
    def num(cls, value: f64Like) -> ScalarTerm: ...

    @method(egg_fn="Access")
    @classmethod
    def access(cls, source: TensorTerm, indices: IndexListTerm) -> ScalarTerm: ...

    @method(egg_fn="Unary")
    @classmethod
    def unary(cls, fn: StringLike, arg: ScalarTerm) -> ScalarTerm: ...

    @method(egg_fn="Binary")
    @classmethod
    def binary(cls, op: StringLike, lhs: ScalarTerm, rhs: ScalarTerm) -> ScalarTerm: ...


class ScopeTerm(Expr, egg_sort="Scope"):
    """A ``Scope``: traversal, summation, body, reduction (``"sum"`` or ``"max"``)."""

    @method(egg_fn="MkScope")
    @classmethod
    def make(
        cls, traversal: IterListTerm, summation: IterListTerm, body: ScalarTerm, reduce: StringLike
    ) -> ScopeTerm: ...

    @method(egg_fn="Ref", unextractable=True)
    @classmethod
    def ref(cls, handle: i64Like) -> ScopeTerm:
        """``ExpressionGraph`` handles: ``(Ref N)`` is unioned with the N-th scope added."""


# Every constructor, in declaration order (sorts before the sorts that use them where possible).
CONSTRUCTORS: tuple[Callable[..., Any], ...] = (
    IndexTerm.var,
    IndexTerm.lit,
    IndexTerm.add,
    IndexTerm.sub,
    IndexTerm.mul,
    IndexTerm.div,
    IndexTerm.mod,
    IndexTerm.neg,
    IndexListTerm.nil,
    IndexListTerm.cons,
    IterTerm.make,
    IterListTerm.nil,
    IterListTerm.cons,
    TensorTerm.input,
    TensorTerm.nested,
    ScalarTerm.num,
    ScalarTerm.access,
    ScalarTerm.unary,
    ScalarTerm.binary,
    ScopeTerm.make,
    ScopeTerm.ref,
)
# The egglog names of the constructors above (what ``size`` counts).
CONSTRUCTOR_NAMES = frozenset(
    {
        "IVar",
        "ILit",
        "IAdd",
        "ISub",
        "IMul",
        "IDiv",
        "IMod",
        "INeg",
        "IxNil",
        "IxCons",
        "It",
        "ItNil",
        "ItCons",
        "Input",
        "Nested",
        "Num",
        "Access",
        "Unary",
        "Binary",
        "MkScope",
    }
)

# --------------------------------------------------------------------------------------------
# Eager native rules


def _eager_rules() -> Ruleset:
    a, b = vars_("a b", i64)
    x, y = vars_("x y", IndexTerm)
    (s,) = vars_("s", ScalarTerm)
    lit, num = IndexTerm.lit, ScalarTerm.num
    zero, one = lit(0), lit(1)
    # floor semantics for / and % (egglog's i64 / and % truncate); divisors are positive
    floor_mod = ((a % b) + b) % b
    return ruleset(
        # constant folding
        rewrite(IndexTerm.add(lit(a), lit(b))).to(lit(a + b)),
        rewrite(IndexTerm.sub(lit(a), lit(b))).to(lit(a - b)),
        rewrite(IndexTerm.mul(lit(a), lit(b))).to(lit(a * b)),
        rewrite(IndexTerm.neg(lit(a))).to(lit(i64(0) - a)),
        rewrite(IndexTerm.div(lit(a), lit(b))).to(lit((a - floor_mod) / b), b > i64(0)),
        rewrite(IndexTerm.mod(lit(a), lit(b))).to(lit(floor_mod), b > i64(0)),
        # identities
        rewrite(IndexTerm.add(x, zero)).to(x),
        rewrite(IndexTerm.add(zero, x)).to(x),
        rewrite(IndexTerm.sub(x, zero)).to(x),
        rewrite(IndexTerm.sub(x, x)).to(zero),
        rewrite(IndexTerm.mul(x, one)).to(x),
        rewrite(IndexTerm.mul(one, x)).to(x),
        rewrite(IndexTerm.mul(x, zero)).to(zero),
        rewrite(IndexTerm.mul(zero, x)).to(zero),
        rewrite(IndexTerm.div(x, one)).to(x),
        rewrite(IndexTerm.mod(x, one)).to(zero),
        rewrite(IndexTerm.neg(IndexTerm.neg(x))).to(x),
        rewrite(IndexTerm.sub(x, IndexTerm.neg(y))).to(IndexTerm.add(x, y)),
        # scalar identities (exact in floating point for finite values; x*0 is not: inf*0, -0.0)
        rewrite(ScalarTerm.binary("*", s, num(1.0))).to(s),
        rewrite(ScalarTerm.binary("*", num(1.0), s)).to(s),
        rewrite(ScalarTerm.binary("/", s, num(1.0))).to(s),
        rewrite(ScalarTerm.binary("+", s, num(0.0))).to(s),
        rewrite(ScalarTerm.binary("+", num(0.0), s)).to(s),
        rewrite(ScalarTerm.binary("-", s, num(0.0))).to(s),
        rewrite(ScalarTerm.unary("neg", ScalarTerm.unary("neg", s))).to(s),
        name="eager",
    )


eager_rules: Ruleset = _eager_rules()

# --------------------------------------------------------------------------------------------
# IR -> egglog text

_INDEX_FN = {"+": "IAdd", "-": "ISub", "*": "IMul", "/": "IDiv", "%": "IMod"}
_INDEX_OP = {fn: op for op, fn in _INDEX_FN.items()}
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _i64(value: int) -> str:
    if not _I64_MIN <= value <= _I64_MAX:
        raise ExpressionError(f"integer {value} does not fit egglog's i64")
    return str(value)


@lru_cache(maxsize=1 << 16)
def _index_text(ix: Index) -> str:
    match ix:
        case Var(name):
            return f'(IVar "{name}")'
        case Lit(value):
            return f"(ILit {_i64(value)})"
        case IndexNeg(arg):
            return f"(INeg {_index_text(arg)})"
        case IndexOp(op, lhs, rhs):
            return f"({_INDEX_FN[op]} {_index_text(lhs)} {_index_text(rhs)})"
    raise ExpressionError(f"{ix!r} is not an index expression")


@lru_cache(maxsize=1 << 14)
def _indices_text(indices: tuple[Index, ...]) -> str:
    text = "(IxNil)"
    for ix in reversed(indices):
        text = f"(IxCons {_index_text(ix)} {text})"
    return text


@lru_cache(maxsize=1 << 14)
def _iters_text(iters: tuple[Iterator, ...]) -> str:
    text = "(ItNil)"
    for it in reversed(iters):
        text = f'(ItCons (It "{it.name}" {_i64(it.lo)} {_i64(it.hi)}) {text})'
    return text


def _shape_text(shape: tuple[int, ...]) -> str:
    return '"' + "x".join(map(str, shape)) + '"'


class _Writer:
    """Writes scopes as egglog text; nested scopes found in ``handles`` are written as their handle."""

    __slots__ = ("handles",)

    def __init__(self, handles: dict[Scope, str] | None = None):
        self.handles = handles

    def scope(self, scope: Scope) -> str:
        return (
            f"(MkScope {_iters_text(scope.traversal)} {_iters_text(scope.summation)} "
            f'{self.scalar(scope.body)} "{scope.reduce}")'
        )

    def scalar(self, body: Scalar) -> str:
        match body:
            case Access(source, indices):
                if isinstance(source, Tensor):
                    tensor = f'(Input "{source.name}" {_shape_text(source.shape)})'
                else:
                    handle = self.handles.get(source) if self.handles else None
                    tensor = f"(Nested {handle or self.scope(source)})"
                return f"(Access {tensor} {_indices_text(indices)})"
            case Binary(op, lhs, rhs):
                return f'(Binary "{op}" {self.scalar(lhs)} {self.scalar(rhs)})'
            case Unary(fn, arg):
                return f'(Unary "{fn}" {self.scalar(arg)})'
            case Num(value):
                return f"(Num {value!r})"  # repr: shortest exact form; egglog reads 1e-05 and 1e+300
        raise ExpressionError(f"{body!r} is not a scalar expression")


_PLAIN_WRITER = _Writer()


def to_egglog(scope: Scope) -> str:
    """The egglog s-expression of a scope (nested scopes inline)."""
    if not isinstance(scope, Scope):
        raise ExpressionError(f"to_egglog needs a Scope, got {type(scope).__name__}")
    return _PLAIN_WRITER.scope(scope)


# --------------------------------------------------------------------------------------------
# egglog text / term DAG -> IR

_SEXPR_TOKEN = re.compile(r'\s*(?:(\()|(\))|("(?:[^"\\]|\\.)*")|([^\s()"]+))')


class _SexprReader:
    """Reads egglog's s-expression text, knowing each constructor's signature."""

    def __init__(self, text: str):
        self.text = text
        self.tokens: list[str] = []
        pos = 0
        for match in _SEXPR_TOKEN.finditer(text):
            if match.start() != pos:
                break
            pos = match.end()
            self.tokens.append(match.group(match.lastindex))  # type: ignore[arg-type]
        if text[pos:].strip():
            raise ExpressionError(f"egglog text: unexpected character at offset {pos}: {text[pos : pos + 20]!r}")
        self.pos = 0

    def next(self) -> str:
        if self.pos >= len(self.tokens):
            raise ExpressionError("egglog text ends early")
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def open(self, *names: str) -> str:
        if self.next() != "(":
            raise ExpressionError(f"egglog text: expected '(' near token {self.pos}")
        name = self.next()
        if name not in names:
            raise ExpressionError(f"egglog text: expected one of {', '.join(names)}, found {name!r}")
        return name

    def close(self) -> None:
        if self.next() != ")":
            raise ExpressionError(f"egglog text: expected ')' near token {self.pos}")

    def string(self) -> str:
        token = self.next()
        if len(token) < 2 or token[0] != '"':
            raise ExpressionError(f"egglog text: expected a string, found {token!r}")
        body = token[1:-1]
        return re.sub(r"\\(.)", r"\1", body) if "\\" in body else body

    def integer(self) -> int:
        token = self.next()
        try:
            return int(token)
        except ValueError:
            raise ExpressionError(f"egglog text: expected an integer, found {token!r}") from None

    def number(self) -> float:
        token = self.next()
        try:
            return float(token)
        except ValueError:
            raise ExpressionError(f"egglog text: expected a number, found {token!r}") from None

    # -- sorts
    def index(self) -> Index:
        name = self.open("IVar", "ILit", "INeg", "IAdd", "ISub", "IMul", "IDiv", "IMod")
        if name == "IVar":
            result: Index = Var(self.string())
        elif name == "ILit":
            result = Lit(self.integer())
        elif name == "INeg":
            result = IndexNeg(self.index())
        else:
            lhs = self.index()
            result = IndexOp(_INDEX_OP[name], lhs, self.index())
        self.close()
        return result

    def index_list(self) -> tuple[Index, ...]:
        items: list[Index] = []
        depth = 0
        while self.open("IxCons", "IxNil") == "IxCons":
            items.append(self.index())
            depth += 1
        for _ in range(depth + 1):
            self.close()
        return tuple(items)

    def iter_list(self) -> tuple[Iterator, ...]:
        items: list[Iterator] = []
        depth = 0
        while self.open("ItCons", "ItNil") == "ItCons":
            self.open("It")
            name = self.string()
            lo = self.integer()
            items.append(Iterator(name, lo, self.integer()))
            self.close()
            depth += 1
        for _ in range(depth + 1):
            self.close()
        return tuple(items)

    def scalar(self) -> Scalar:
        name = self.open("Num", "Access", "Unary", "Binary")
        if name == "Num":
            result: Scalar = Num(self.number())
        elif name == "Access":
            if self.open("Input", "Nested") == "Input":
                tensor_name = self.string()
                source: Tensor | Scope = Tensor(tensor_name, _parse_shape(self.string()))
            else:
                source = self.scope()
            self.close()
            result = Access(source, self.index_list())
        elif name == "Unary":
            fn = self.string()
            result = Unary(fn, self.scalar())
        else:
            op = self.string()
            lhs = self.scalar()
            result = Binary(op, lhs, self.scalar())
        self.close()
        return result

    def scope(self) -> Scope:
        self.open("MkScope")
        traversal = self.iter_list()
        summation = self.iter_list()
        body = self.scalar()
        reduce = self.string()
        self.close()
        return Scope(traversal, summation, body, reduce)


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split("x")) if text else ()
    except ValueError:
        raise ExpressionError(f"egglog text: bad tensor shape {text!r}") from None


def from_egglog(text: str) -> Scope:
    """The Scope of an egglog s-expression (as ``to_egglog`` writes or egglog prints one)."""
    reader = _SexprReader(text)
    scope = reader.scope()
    if reader.pos != len(reader.tokens):
        raise ExpressionError(
            f"egglog text: trailing tokens after the scope: {' '.join(reader.tokens[reader.pos : reader.pos + 5])}"
        )
    return scope


class _TermReader:
    """Converts an egglog TermDag (what extraction returns) to the IR, sharing equal sub-terms."""

    def __init__(self, termdag: bindings.TermDag):
        self.dag = termdag
        self.memo: dict[int, Any] = {}

    def app(self, term: int) -> tuple[str, list[int]]:
        node = self.dag.get(term)
        if not isinstance(node, bindings.TermApp):
            raise ExpressionError(f"extracted term {term}: expected a constructor, got {node!r}")
        return node.name, node.args

    def lit(self, term: int) -> Any:
        node = self.dag.get(term)
        if not isinstance(node, bindings.TermLit):
            raise ExpressionError(f"extracted term {term}: expected a literal, got {node!r}")
        return node.value.value  # type: ignore[union-attr]

    def index(self, term: int) -> Index:
        hit = self.memo.get(term)
        if hit is not None:
            return hit
        name, args = self.app(term)
        if name == "IVar":
            result: Index = Var(self.lit(args[0]))
        elif name == "ILit":
            result = Lit(self.lit(args[0]))
        elif name == "INeg":
            result = IndexNeg(self.index(args[0]))
        elif name in _INDEX_OP:
            result = IndexOp(_INDEX_OP[name], self.index(args[0]), self.index(args[1]))
        else:
            raise ExpressionError(f"extracted term: {name!r} is not an Index constructor")
        self.memo[term] = result
        return result

    def index_list(self, term: int) -> tuple[Index, ...]:
        items = []
        name, args = self.app(term)
        while name == "IxCons":
            items.append(self.index(args[0]))
            name, args = self.app(args[1])
        if name != "IxNil":
            raise ExpressionError(f"extracted term: {name!r} is not an IndexList constructor")
        return tuple(items)

    def iter_list(self, term: int) -> tuple[Iterator, ...]:
        items = []
        name, args = self.app(term)
        while name == "ItCons":
            it_name, it_args = self.app(args[0])
            if it_name != "It":
                raise ExpressionError(f"extracted term: {it_name!r} is not an Iter constructor")
            items.append(Iterator(self.lit(it_args[0]), self.lit(it_args[1]), self.lit(it_args[2])))
            name, args = self.app(args[1])
        if name != "ItNil":
            raise ExpressionError(f"extracted term: {name!r} is not an IterList constructor")
        return tuple(items)

    def scalar(self, term: int) -> Scalar:
        hit = self.memo.get(term)
        if hit is not None:
            return hit
        name, args = self.app(term)
        if name == "Num":
            result: Scalar = Num(self.lit(args[0]))
        elif name == "Access":
            src_name, src_args = self.app(args[0])
            if src_name == "Input":
                source: Tensor | Scope = Tensor(self.lit(src_args[0]), _parse_shape(self.lit(src_args[1])))
            elif src_name == "Nested":
                source = self.scope(src_args[0])
            else:
                raise ExpressionError(f"extracted term: {src_name!r} is not a Tensor constructor")
            result = Access(source, self.index_list(args[1]))
        elif name == "Unary":
            result = Unary(self.lit(args[0]), self.scalar(args[1]))
        elif name == "Binary":
            result = Binary(self.lit(args[0]), self.scalar(args[1]), self.scalar(args[2]))
        else:
            raise ExpressionError(f"extracted term: {name!r} is not a Scalar constructor")
        self.memo[term] = result
        return result

    def scope(self, term: int) -> Scope:
        hit = self.memo.get(term)
        if hit is not None:
            return hit
        name, args = self.app(term)
        if name != "MkScope":
            raise ExpressionError(f"extracted term: {name!r} is not a Scope constructor")
        result = Scope(self.iter_list(args[0]), self.iter_list(args[1]), self.scalar(args[2]), self.lit(args[3]))
        self.memo[term] = result
        return result


def from_termdag(termdag: bindings.TermDag, term: int) -> Scope:
    """The Scope of a term of an egglog TermDag (what ``extract`` commands return)."""
    return _TermReader(termdag).scope(term)


# --------------------------------------------------------------------------------------------
# IR -> egglog-python expressions (for rules and checks written in Python; slower than text)


def _index_term(ix: Index) -> IndexTerm:
    match ix:
        case Var(name):
            return IndexTerm.var(name)
        case Lit(value):
            return IndexTerm.lit(value)
        case IndexNeg(arg):
            return IndexTerm.neg(_index_term(arg))
        case IndexOp(op, lhs, rhs):
            ctor = {"+": IndexTerm.add, "-": IndexTerm.sub, "*": IndexTerm.mul, "/": IndexTerm.div, "%": IndexTerm.mod}[
                op
            ]
            return ctor(_index_term(lhs), _index_term(rhs))
    raise ExpressionError(f"{ix!r} is not an index expression")


def _scalar_term(body: Scalar) -> ScalarTerm:
    match body:
        case Num(value):
            return ScalarTerm.num(value)
        case Access(source, indices):
            tensor = (
                TensorTerm.input(source.name, "x".join(map(str, source.shape)))
                if isinstance(source, Tensor)
                else TensorTerm.nested(to_term(source))
            )
            ix_list = IndexListTerm.nil()
            for ix in reversed(indices):
                ix_list = IndexListTerm.cons(_index_term(ix), ix_list)
            return ScalarTerm.access(tensor, ix_list)
        case Unary(fn, arg):
            return ScalarTerm.unary(fn, _scalar_term(arg))
        case Binary(op, lhs, rhs):
            return ScalarTerm.binary(op, _scalar_term(lhs), _scalar_term(rhs))
    raise ExpressionError(f"{body!r} is not a scalar expression")


def _iter_list_term(iters: tuple[Iterator, ...]) -> IterListTerm:
    result = IterListTerm.nil()
    for it in reversed(iters):
        result = IterListTerm.cons(IterTerm.make(it.name, it.lo, it.hi), result)
    return result


def to_term(scope: Scope) -> ScopeTerm:
    """The egglog-python expression of a scope (for rules, ``check`` and cost models)."""
    return ScopeTerm.make(
        _iter_list_term(scope.traversal), _iter_list_term(scope.summation), _scalar_term(scope.body), scope.reduce
    )


# --------------------------------------------------------------------------------------------
# The graph

# Commands per run_program call. Measured (bench/egraph_boundary.py): egglog's parse_program and
# run_program both cost more per command as a call holds more commands, so one command per call
# is cheapest; the queue exists so that callers can defer and a later version can batch.
DEFAULT_BATCH_SIZE = 1

ScopeOrHandle = Union[Scope, str]
_SPAN = bindings.RustSpan("", 0, 0)
_REF = re.compile(r"\(Ref (\d+)\)\Z")


def _default_cost_model() -> bindings.CostModel:
    """egglog's default costs as a bindings cost model: 1 per constructor and per literal, summed
    over the tree (unextractable constructors such as Ref are skipped by the extractor)."""
    return bindings.CostModel(
        lambda _name, own, children: own + sum(children),
        lambda _name, _args: 1,
        lambda _sort, _value, elements: 1 + sum(elements),
        lambda _sort, _value: 1,
    )


@dataclass
class GraphStats:
    """Time (seconds) and counts at the Python/egglog boundary."""

    insert_seconds: float = 0.0  # text building + sending add/union commands
    run_seconds: float = 0.0  # rule runs
    extract_seconds: float = 0.0  # extraction + conversion back to the IR
    check_seconds: float = 0.0  # equivalence checks and size queries
    commands_sent: int = 0
    batches_sent: int = 0
    terms_added: int = 0  # distinct scopes given a handle
    unions: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ExpressionGraph:
    """An egglog e-graph of scopes.

    ``graph.egraph`` is the egglog-python ``EGraph``: register Python-written rules there (or with
    ``graph.register``) and run them with ``graph.run``. Scopes go in as egglog text through the
    low-level bindings (``graph.egraph._egraph``), queued and sent ``batch_size`` commands per
    call; every query flushes the queue first.

    Handles: ``add(scope)`` returns ``"(Ref N)"``, egglog text for the scope's e-class (``Ref`` is
    an unextractable ``i64 -> Scope`` constructor unioned with the scope). A handle can be used in
    any egglog text (``graph.send(f"(union {h1} {h2})")``) and as ``ScopeTerm.ref(N)`` in Python
    (``graph.expr(h)``). Handles are not egglog ``let`` bindings because every ``let`` creates an
    egglog function, and the cost of a command grows with the number of functions (measured on
    48-node terms: 0.76 ms per term for the first 4,000 lets, 1.5 ms from 16,000 to 20,000; with
    ``Ref`` 0.6-1.0 ms throughout).
    """

    def __init__(self, batch_size: int = DEFAULT_BATCH_SIZE):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.egraph = EgglogGraph()
        for constructor in CONSTRUCTORS:  # declare every sort and constructor, so text can use them
            self.egraph._callable_to_egg(constructor)
        self._raw: bindings.EGraph = self.egraph._egraph
        self._handles: dict[Scope, str] = {}
        self._scopes: list[Scope] = []  # Ref id -> the scope added under it
        self._queue: list[str] = []
        self._writer = _Writer(self._handles)
        self._literals: dict[tuple[type, Any], bindings.Value] = {}
        self.stats = GraphStats()

    # -- insertion
    def add(self, scope: Scope) -> str:
        """The handle of ``scope``'s e-class, adding the scope if it is new (queued)."""
        handle = self._handles.get(scope)
        if handle is not None:
            return handle
        start = time.perf_counter()
        if not isinstance(scope, Scope):
            raise ExpressionError(f"add needs a Scope, got {type(scope).__name__}")
        handle = f"(Ref {len(self._scopes)})"
        text = f"(union {handle} {self._writer.scope(scope)})"
        self._handles[scope] = handle
        self._scopes.append(scope)
        self.stats.terms_added += 1
        self.stats.insert_seconds += time.perf_counter() - start
        self._enqueue(text)
        return handle

    def add_all(self, scopes: Any) -> list[str]:
        """``add`` for each scope; the handles in order."""
        return [self.add(scope) for scope in scopes]

    def handle(self, scope: Scope) -> str | None:
        """The handle of a scope already added, or None."""
        return self._handles.get(scope)

    def scope_of(self, handle: str) -> Scope:
        """The scope that was added under ``handle`` (not necessarily the e-class's best)."""
        match = _REF.match(handle)
        if not match or int(match.group(1)) >= len(self._scopes):
            raise ExpressionError(f"{handle!r} is not a handle of this graph")
        return self._scopes[int(match.group(1))]

    def union(self, a: ScopeOrHandle, b: ScopeOrHandle) -> None:
        """Assert that ``a`` and ``b`` are equal. Each is a Scope (added first), a handle, or
        egglog text of a Scope term."""
        ha, hb = self._ref(a), self._ref(b)
        if ha != hb:
            self.stats.unions += 1
            self._enqueue(f"(union {ha} {hb})")

    def send(self, text: str) -> list:
        """Flush, then run raw egglog commands; returns their outputs."""
        self.flush()
        start = time.perf_counter()
        try:
            outputs = self._raw.run_program(*self._raw.parse_program(text))
        finally:
            self.stats.insert_seconds += time.perf_counter() - start
        self.stats.commands_sent += 1
        self.stats.batches_sent += 1
        return outputs

    def flush(self) -> None:
        """Send every queued command, ``batch_size`` per call."""
        while self._queue:
            self._send_batch()

    def _ref(self, x: ScopeOrHandle) -> str:
        if isinstance(x, Scope):
            return self.add(x)
        if isinstance(x, str) and (x.startswith("(") or x.startswith("$")):
            return x
        raise ExpressionError(f"expected a Scope, a handle or egglog term text, got {x!r}")

    def _handle_of(self, x: ScopeOrHandle) -> str:
        """A ``(Ref N)`` handle for x: scopes are added, other term text gets a fresh Ref."""
        ref = self._ref(x)
        if _REF.match(ref):
            return ref
        handle = f"(Ref {len(self._scopes)})"
        self._scopes.append(None)  # type: ignore[arg-type]  # a Ref with no IR scope of ours
        self._enqueue(f"(union {handle} {ref})")
        return handle

    def _enqueue(self, command: str) -> None:
        self._queue.append(command)
        if len(self._queue) >= self.batch_size:
            self._send_batch()

    def _send_batch(self) -> None:
        batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
        text = "\n".join(batch)
        start = time.perf_counter()
        try:
            self._raw.run_program(*self._raw.parse_program(text))
        except bindings.EggSmolError as err:
            raise ExpressionError(
                f"egglog refused a batch of {len(batch)} command(s): {err}\nfirst: {batch[0][:300]}"
            ) from err
        finally:
            self.stats.insert_seconds += time.perf_counter() - start
            self.stats.commands_sent += len(batch)
            self.stats.batches_sent += 1

    # -- rules
    def register(self, *rules: Any) -> None:
        """Register egglog-python rules, rewrites or actions on the underlying e-graph."""
        self.flush()
        self.egraph.register(*rules)

    def run(self, rules: Ruleset | Schedule | str | None = None, iterations: int = 1) -> Any:
        """Run native egglog rules ``iterations`` times: a Ruleset (default: ``eager_rules``), a
        Schedule (``eager_rules.saturate()``, repeated ``iterations`` times), or the egglog name of
        a ruleset declared in text (``""``: egglog's default ruleset, where ``register`` puts rules
        given without a ruleset). Returns egglog's run report (the bindings' report for a name)."""
        self.flush()
        start = time.perf_counter()
        try:
            if rules is None:
                rules = eager_rules
            if isinstance(rules, str):
                command = f"(run {rules} {iterations})" if rules else f"(run {iterations})"
                (output,) = self._raw.run_program(*self._raw.parse_program(command))
                return output.report
            if isinstance(rules, Ruleset):
                return self.egraph.run(run_schedule(rules) * iterations)
            if isinstance(rules, Schedule):
                return self.egraph.run(rules * iterations if iterations != 1 else rules)
            raise TypeError(f"cannot run {rules!r}: expected a Ruleset, a Schedule or a ruleset name")
        finally:
            self.stats.run_seconds += time.perf_counter() - start

    # -- queries
    def function_sizes(self) -> dict[str, int]:
        """Rows of every egglog function (constructors, ``Ref``, and what rules add)."""
        self.flush()
        start = time.perf_counter()
        (output,) = self._raw.run_program(bindings.PrintSize(_SPAN, None))
        self.stats.check_seconds += time.perf_counter() - start
        return dict(output.sizes)

    def size(self, classes: bool = True) -> tuple[int, int | None]:
        """``(e-nodes, e-classes)`` of the term language (the constructors above, not ``Ref``).

        e-nodes come from egglog's ``print-size`` (cheap). egglog exposes no e-class count; with
        ``classes=True`` it is counted as the distinct outputs of those constructors' rows in a
        frozen copy of the e-graph (linear in its size; see bench/egraph_boundary.py);
        ``classes=False`` skips that and returns ``(nodes, None)``."""
        sizes = self.function_sizes()
        nodes = sum(n for name, n in sizes.items() if name in CONSTRUCTOR_NAMES)
        if not classes:
            return nodes, None
        start = time.perf_counter()
        frozen = self._raw.freeze()
        outputs = set()
        for name, function in frozen.functions.items():
            if name in CONSTRUCTOR_NAMES:
                outputs.update(row.output for row in function.rows if not row.subsumed)
        self.stats.check_seconds += time.perf_counter() - start
        return nodes, len(outputs)

    def eclass(self, x: ScopeOrHandle) -> bindings.Value | None:
        """The canonical e-class id (an egglog Value) of a scope or a handle, or None when the
        scope is not in the e-graph. Never adds anything: a scope without a handle is looked up
        node by node (it may be there because a native rule built it)."""
        self.flush()
        if isinstance(x, Scope):
            handle = self._handles.get(x)
            if handle is None:
                return self._lookup_scope(x)
            x = handle
        match = _REF.match(x) if isinstance(x, str) else None
        if not match:
            raise ExpressionError(f"eclass needs a Scope or a (Ref N) handle, got {x!r}")
        return self._raw.lookup_function("Ref", [self._literal(bindings.Int, int(match.group(1)))])

    def lookup(self, scope: Scope) -> bindings.Value | None:
        """The e-class of ``scope`` if the e-graph holds it (with or without a handle), else None."""
        return self.eclass(scope)

    def _literal(self, kind: type, value: Any) -> bindings.Value:
        key = (kind, value)
        cached = self._literals.get(key)
        if cached is None:
            cached = self._literals[key] = self._raw.eval_expr(bindings.Lit(_SPAN, kind(value)))[1]
        return cached

    def _lookup_scope(self, scope: Scope) -> bindings.Value | None:
        """Bottom-up ``lookup_function`` over the scope's nodes (about 1 us a node)."""
        look, lit = self._raw.lookup_function, self._literal
        memo: dict[Any, Any] = {}

        class Missing(Exception):
            pass

        def node(name: str, args: list) -> bindings.Value:
            value = look(name, args)
            if value is None:
                raise Missing
            return value

        def index(ix: Index) -> bindings.Value:
            hit = memo.get(ix)
            if hit is None:
                match ix:
                    case Var(name):
                        hit = node("IVar", [lit(bindings.String, name)])
                    case Lit(value):
                        hit = node("ILit", [lit(bindings.Int, value)])
                    case IndexNeg(arg):
                        hit = node("INeg", [index(arg)])
                    case IndexOp(op, lhs, rhs):
                        hit = node(_INDEX_FN[op], [index(lhs), index(rhs)])
                memo[ix] = hit
            return hit

        def iters(its: tuple[Iterator, ...]) -> bindings.Value:
            value = node("ItNil", [])
            for it in reversed(its):
                item = node("It", [lit(bindings.String, it.name), lit(bindings.Int, it.lo), lit(bindings.Int, it.hi)])
                value = node("ItCons", [item, value])
            return value

        def scalar(body: Scalar) -> bindings.Value:
            match body:
                case Num(value):
                    return node("Num", [lit(bindings.Float, value)])
                case Access(source, indices):
                    if isinstance(source, Tensor):
                        tensor = node(
                            "Input",
                            [lit(bindings.String, source.name), lit(bindings.String, "x".join(map(str, source.shape)))],
                        )
                    else:
                        tensor = node("Nested", [scope_value(source)])
                    ixs = node("IxNil", [])
                    for ix in reversed(indices):
                        ixs = node("IxCons", [index(ix), ixs])
                    return node("Access", [tensor, ixs])
                case Unary(fn, arg):
                    return node("Unary", [lit(bindings.String, fn), scalar(arg)])
                case Binary(op, lhs, rhs):
                    return node("Binary", [lit(bindings.String, op), scalar(lhs), scalar(rhs)])
            raise ExpressionError(f"{body!r} is not a scalar expression")

        def scope_value(sc: Scope) -> bindings.Value:
            handle = self._handles.get(sc)
            if handle is not None and sc is not scope:
                return self.eclass(handle)  # type: ignore[return-value]
            return node(
                "MkScope", [iters(sc.traversal), iters(sc.summation), scalar(sc.body), lit(bindings.String, sc.reduce)]
            )

        try:
            return scope_value(scope)
        except Missing:
            return None

    def equivalent(self, a: ScopeOrHandle, b: ScopeOrHandle) -> bool:
        """Whether ``a`` and ``b`` are in one e-class. Scopes and handles are looked up without
        adding anything (a scope not in the e-graph is equivalent to nothing); other egglog term
        text is compared with an egglog ``check`` (slow for big terms: ~9 ms for 48 nodes)."""
        self.flush()
        start = time.perf_counter()
        try:
            if (isinstance(a, Scope) or _REF.match(a)) and (isinstance(b, Scope) or _REF.match(b)):
                va, vb = self.eclass(a), self.eclass(b)
                if isinstance(a, str) and va is None or isinstance(b, str) and vb is None:
                    raise ExpressionError(f"unknown handle {a if va is None else b}")
                return va is not None and va == vb
            ha = self._handles.get(a) or self._writer.scope(a) if isinstance(a, Scope) else self._ref(a)
            hb = self._handles.get(b) or self._writer.scope(b) if isinstance(b, Scope) else self._ref(b)
            if ha == hb:
                return True
            try:
                self._raw.run_program(*self._raw.parse_program(f"(check (= {ha} {hb}))"))
            except bindings.EggSmolError as err:
                if "Check failed" in str(err):
                    return False
                raise
            return True
        finally:
            self.stats.check_seconds += time.perf_counter() - start

    def extract(self, x: ScopeOrHandle, cost_model: Any = None, include_cost: bool = False) -> Any:
        """The cheapest scope of ``x``'s e-class (adding ``x`` if it is a new scope).

        ``cost_model``: None (egglog's default: every constructor costs 1 and every literal 1,
        summed over the tree); an egglog-python cost model ``f(egraph, expr, children_costs)`` (see
        ``egglog.CostModel``; Python is called per e-node, slow); or a ``bindings.CostModel`` over
        egglog names. With ``include_cost`` returns ``(scope, cost)``."""
        handle = self._handle_of(x)
        self.flush()
        start = time.perf_counter()
        try:
            if cost_model is None:
                (output,) = self._raw.run_program(*self._raw.parse_program(f"(extract {handle})"))
                termdag, term, cost = output.termdag, output.term, output.cost
            else:
                if isinstance(cost_model, bindings.CostModel):
                    model = cost_model
                else:
                    model = _CostModel(cost_model, self.egraph).to_bindings_cost_model()
                extractor = bindings.Extractor(["Scope"], self._raw, model)
                termdag = bindings.TermDag()
                cost, term = extractor.extract_best(self._raw, termdag, self.eclass(handle), "Scope")
            scope = from_termdag(termdag, term)
        finally:
            self.stats.extract_seconds += time.perf_counter() - start
        return (scope, cost) if include_cost else scope

    def extract_many(self, xs: Any, cost_model: Any = None, include_cost: bool = False) -> list:
        """``extract`` for many e-classes at once: one extractor for the whole e-graph, then each
        root. egglog's ``extract`` command rebuilds its costs over the whole e-graph on every
        call (measured ~2 us per e-node per call), so use this when extracting more than a few.
        The default cost model here is Python (egglog's default, node count over the tree)."""
        handles = [self._handle_of(x) for x in xs]
        self.flush()
        start = time.perf_counter()
        try:
            if cost_model is None:
                model = _default_cost_model()
            elif isinstance(cost_model, bindings.CostModel):
                model = cost_model
            else:
                model = _CostModel(cost_model, self.egraph).to_bindings_cost_model()
            extractor = bindings.Extractor(["Scope"], self._raw, model)
            results = []
            for handle in handles:
                termdag = bindings.TermDag()
                cost, term = extractor.extract_best(self._raw, termdag, self.eclass(handle), "Scope")
                scope = from_termdag(termdag, term)
                results.append((scope, cost) if include_cost else scope)
        finally:
            self.stats.extract_seconds += time.perf_counter() - start
        return results

    def serialize(self) -> dict:
        """The whole e-graph as egglog serialises it: ``{"nodes": {id: {"op", "children",
        "eclass", ...}}, ...}`` (children are node ids; extraction works on their e-classes)."""
        self.flush()
        return json.loads(self._raw.serialize([]).to_json())

    def expr(self, x: ScopeOrHandle) -> ScopeTerm:
        """The egglog-python expression ``ScopeTerm.ref(N)`` of a scope's e-class (adding the
        scope if new), for ``graph.egraph.check(eq(graph.expr(a)).to(...))`` and rules."""
        handle = self._handle_of(x)
        self.flush()
        return ScopeTerm.ref(int(_REF.match(handle).group(1)))  # type: ignore[union-attr]

    def __len__(self) -> int:
        """Scopes added (distinct handles)."""
        return len(self._handles)
