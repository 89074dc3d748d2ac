"""The e-graph language, declared once: ``CONSTRUCTORS``, one row per egglog constructor.

A row gives the constructor's egglog name, its sort, the Python method rules call it by, the IR
node it stands for and its arguments (IR field -> sort or primitive). The table declares::

    sort Index      (IVar String) (ILit i64) (IAdd Index Index) (ISub Index Index)
                    (IMul Index Index) (IDiv Index Index) (IMod Index Index) (INeg Index)
    sort IndexList  (IxNil) (IxCons Index IndexList)
                    (IxRef i64)                               ; no IR node: a list written once
    sort Iter       (It String i64 i64)                       ; name, lo, hi
    sort IterList   (ItNil) (ItCons Iter IterList)
                    (ItRef i64)                               ; no IR node: a list written once
    sort Tensor     (Input String String) (Nested Scope)      ; name, shape "1x7x7x512"
    sort Scalar     (Num f64) (Access Tensor IndexList) (Unary String Scalar)
                    (Binary String Scalar Scalar)             ; op: + - * / max
    sort Scope      (MkScope IterList IterList Scalar String) ; traversal, summation, body, "sum"|"max"
                    (Ref i64)                                 ; no IR node: ExpressionGraph's handles

Everything else follows from the rows:

* the egglog-python classes rules are written over, one per sort with a classmethod per row
  (``IndexTerm.add(x, y)``, ``ScalarTerm.num(1.0)``); egglog-python declares them in an e-graph;
* ``Fold``: an IR value folded bottom-up through the rows, into egglog text (how scopes are
  inserted) or into the e-class of a term already in the e-graph (lookups);
* ``Reader``: the IR of egglog terms, from an extracted TermDag (``read_termdag``) or, in
  ``rewriter.egraph.extract``, from the serialised e-graph.

A row without an IR node (``Ref``, ``IxRef``, ``ItRef``) is a handle: unextractable, since
nothing could read it back. ``ExpressionGraph`` writes each index list and iterator list once,
unioned with ``(IxRef N)`` or ``(ItRef N)``, and then as that handle: a derivation state repeats
the lists of the states before it, and egglog's cost per command grows with the nodes written
(about 6 us each, beside about 18 us per command). The Scope
constructor is ``MkScope`` because egglog refuses a constructor named like a sort. ``IDiv`` and
``IMod`` take an Index divisor: the IR allows any constant index there (``i/(1+1)``).
"""

from __future__ import annotations

from functools import partial
from operator import attrgetter
from types import FunctionType
from typing import Any, Callable, Sequence

from egglog import Expr, StringLike, bindings, f64Like, i64Like, method

from rewriter.ir import (
    Access,
    Binary,
    ExpressionError,
    IndexNeg,
    IndexOp,
    Iterator,
    Lit,
    Num,
    Scope,
    Tensor,
    Unary,
    Var,
)

__all__ = [
    "CONSTRUCTORS",
    "SORTS",
    "Constructor",
    "Primitive",
    "Sort",
    "Fold",
    "Reader",
    "read_termdag",
    "IndexTerm",
    "IndexListTerm",
    "IterTerm",
    "IterListTerm",
    "TensorTerm",
    "ScalarTerm",
    "ScopeTerm",
]

# --------------------------------------------------------------------------------------------
# Argument kinds: egglog's primitive sorts, and the sorts of terms the table declares


class Primitive:
    """An argument egglog holds as a literal of its primitive ``sort``: what the generated
    classmethods accept, the bindings literal type, and how the IR's value becomes egglog's
    (``encode``: a shape becomes "1x7x7x512") and back (``decode``)."""

    def __init__(self, sort: str, annotation: Any, literal: type, encode=None, decode=None):
        self.sort, self.annotation, self.literal = sort, annotation, literal
        self.encode: Callable[[Any], Any] = encode or _same
        self.decode: Callable[[Any], Any] = decode or _same
        # egglog text of an IR value; repr: the shortest exact float (egglog reads 1e-05 and 1e+300)
        write = {"String": _quoted, "i64": str, "f64": repr}[sort]
        self.text: Callable[[Any], str] = (lambda value: write(encode(value))) if encode else write


def _same(value: Any) -> Any:
    return value


def _quoted(text: str) -> str:
    return f'"{text}"'


def _i64(value: int) -> int:
    if not -(2**63) <= value < 2**63:
        raise ExpressionError(f"integer {value} does not fit egglog's i64")
    return value


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split("x")) if text else ()
    except ValueError:
        raise ExpressionError(f"egglog term: bad tensor shape {text!r}") from None


STRING = Primitive("String", StringLike, bindings.String)
I64 = Primitive("i64", i64Like, bindings.Int, encode=_i64)
F64 = Primitive("f64", f64Like, bindings.Float, decode=float)  # the serialised e-graph may give 2 for 2.0
SHAPE = Primitive("String", StringLike, bindings.String, encode=lambda s: "x".join(map(str, s)), decode=_shape)


def text_app(name: str, args: list[str]) -> str:
    """egglog text of a constructor applied to argument texts."""
    return f"({name} {' '.join(args)})" if args else f"({name})"


def text_lit(kind: Primitive, value: Any) -> str:
    """egglog text of a literal (an IR value)."""
    return kind.text(value)


class Sort:
    """An egglog sort of terms; its constructors are the rows of ``CONSTRUCTORS`` that name it."""

    def __init__(self, name: str, doc: str):
        self.name, self.doc = name, doc
        self.rows: dict[str, Constructor] = {}  # egglog name -> row
        self.holds_scopes = True  # whether its terms may contain a Scope (set by _index)
        self.nil: Constructor | None = None  # a cons list's rows, for a sort whose IR values are tuples
        self.cons: Constructor | None = None
        self.handle: Constructor | None = None  # a row without an IR node that names an e-class
        # IR class -> (None, its row) or (key, rows by key(value)); a cons list's are nil and cons
        self.writers: dict[type, tuple[Callable | None, Any]] = {}
        self.term_class: Any = None  # the egglog-python class (set below the table)

    def add(self, row: Constructor) -> None:
        self.rows[row.name] = row
        if row.ir is tuple:
            self.nil, self.cons = (self.nil, row) if row.fields else (row, self.cons)
        elif row.ir is None:
            self.handle = row
        elif row.key is None:
            self.writers[row.ir] = (None, row)
        else:
            self.writers.setdefault(row.ir, (row.key, {}))[1][row.key_value] = row

    def row_of(self, value: Any) -> Constructor:
        """The row that writes ``value``, an IR value of this sort."""
        key, row = self.writers.get(type(value), _NO_WRITER)
        if key is not None:
            row = row.get(key(value))
        if row is None:
            raise ExpressionError(f"{value!r} is not an IR value of the e-graph's sort {self.name}")
        return row


Kind = Sort | Primitive
_NO_WRITER = (None, None)

# --------------------------------------------------------------------------------------------
# The table


class Constructor:
    """A row: egglog constructor ``name`` of ``sort``, the classmethod ``sort.term_class.<method>``,
    and the IR node it stands for: an ``ir`` whose fields ``args`` hold the arguments (field
    None: the node itself; ``ir`` tuple: a cons list's nil or ``head``/``tail``), ``fixed`` fields
    telling apart the rows of one IR class (IndexOp's ``op``). ``ir`` None: no IR node."""

    def __init__(self, name: str, sort: Sort, method: str, ir: type | None, args: dict, **fixed: Any):
        self.name, self.sort, self.method, self.ir, self.fixed = name, sort, method, ir, fixed
        self.fields: tuple[str | None, ...] = tuple(args)
        self.kinds: tuple[Kind, ...] = tuple(args.values())
        # the classmethod's parameters: the IR fields, or the sort's name where the node itself is the argument
        self.params = tuple(f or kind.name.lower() for f, kind in zip(self.fields, self.kinds))
        # what the writer folds (a cons list is folded whole): (getter from the IR node, kind, whether a sort)
        self.arguments = tuple((self._getter(f), k, isinstance(k, Sort)) for f, k in zip(self.fields, self.kinds))
        self.key, self.key_value = _key(fixed)
        self.build: Callable[..., Any] = _builder(self)

    def _getter(self, field: str | None) -> Callable[[Any], Any]:
        return _same if field is None else attrgetter(field)

    @property
    def term(self) -> Callable[..., Any]:
        """The egglog-python classmethod, for rules: ``CONSTRUCTORS["IAdd"].term(x, y)``."""
        return getattr(self.sort.term_class, self.method)

    def __repr__(self) -> str:
        return text_app(self.name, [k.name if isinstance(k, Sort) else k.sort for k in self.kinds])


def _key(fixed: dict) -> tuple[Callable | None, Any]:
    """How the writer tells apart the rows of one IR class: by their fixed fields."""
    if fixed:
        return attrgetter(*fixed), tuple(fixed.values()) if len(fixed) > 1 else next(iter(fixed.values()))
    return None, None


def _builder(row: Constructor) -> Callable[..., Any]:
    """The IR node of the row's arguments, read back."""
    if row.ir is None:

        def unreadable(*_args: Any) -> Any:
            raise ExpressionError(f"egglog term: {row.name} has no IR node")

        return unreadable
    if row.ir is tuple:
        return (lambda head, tail: (head, *tail)) if row.fields else tuple
    if row.fields == (None,):
        return _same
    ir, fields, fixed = row.ir, row.fields, row.fixed
    return lambda *values: ir(**fixed, **dict(zip(fields, values)))


INDEX = Sort("Index", "An index expression (``rewriter.ir.Index``).")
INDEX_LIST = Sort("IndexList", "The indices of an access, as a cons list.")
ITER = Sort("Iter", "An ``Iterator``: name and range [lo, hi).")
ITER_LIST = Sort("IterList", "Traversal or summation iterators, as a cons list.")
TENSOR = Sort("Tensor", "What an access reads: an input tensor (name, shape) or a nested scope.")
SCALAR = Sort("Scalar", "A scope body.")
SCOPE = Sort("Scope", "A ``Scope``: traversal, summation, body, reduction (``sum`` or ``max``).")
SORTS = (INDEX, INDEX_LIST, ITER, ITER_LIST, TENSOR, SCALAR, SCOPE)
_C = Constructor

# fmt: off
_TABLE = (
    #  egglog     sort        method    IR node   arguments: IR field (None: the node itself) -> kind
    _C("IVar",    INDEX,      "var",    Var,      {"name": STRING}),
    _C("ILit",    INDEX,      "lit",    Lit,      {"value": I64}),
    _C("IAdd",    INDEX,      "add",    IndexOp,  {"lhs": INDEX, "rhs": INDEX}, op="+"),
    _C("ISub",    INDEX,      "sub",    IndexOp,  {"lhs": INDEX, "rhs": INDEX}, op="-"),
    _C("IMul",    INDEX,      "mul",    IndexOp,  {"lhs": INDEX, "rhs": INDEX}, op="*"),
    _C("IDiv",    INDEX,      "div",    IndexOp,  {"lhs": INDEX, "rhs": INDEX}, op="/"),
    _C("IMod",    INDEX,      "mod",    IndexOp,  {"lhs": INDEX, "rhs": INDEX}, op="%"),
    _C("INeg",    INDEX,      "neg",    IndexNeg, {"arg": INDEX}),
    _C("IxNil",   INDEX_LIST, "nil",    tuple,    {}),
    _C("IxCons",  INDEX_LIST, "cons",   tuple,    {"head": INDEX, "tail": INDEX_LIST}),
    _C("IxRef",   INDEX_LIST, "ref",    None,     {"handle": I64}),
    _C("It",      ITER,       "make",   Iterator, {"name": STRING, "lo": I64, "hi": I64}),
    _C("ItNil",   ITER_LIST,  "nil",    tuple,    {}),
    _C("ItCons",  ITER_LIST,  "cons",   tuple,    {"head": ITER, "tail": ITER_LIST}),
    _C("ItRef",   ITER_LIST,  "ref",    None,     {"handle": I64}),
    _C("Input",   TENSOR,     "input",  Tensor,   {"name": STRING, "shape": SHAPE}),
    _C("Nested",  TENSOR,     "nested", Scope,    {None: SCOPE}),
    _C("Num",     SCALAR,     "num",    Num,      {"value": F64}),
    _C("Access",  SCALAR,     "access", Access,   {"source": TENSOR, "indices": INDEX_LIST}),
    _C("Unary",   SCALAR,     "unary",  Unary,    {"fn": STRING, "arg": SCALAR}),
    _C("Binary",  SCALAR,     "binary", Binary,   {"op": STRING, "lhs": SCALAR, "rhs": SCALAR}),
    _C("MkScope", SCOPE,      "make",   Scope,    {"traversal": ITER_LIST, "summation": ITER_LIST, "body": SCALAR,
                                                   "reduce": STRING}),
    _C("Ref",     SCOPE,      "ref",    None,     {"handle": I64}),
)
# fmt: on

CONSTRUCTORS: dict[str, Constructor] = {row.name: row for row in _TABLE}
REF = CONSTRUCTORS["Ref"]  # ExpressionGraph's handles: (Ref N) is unioned with the N-th scope added
_HANDLED = REF.sort
TERMS = frozenset(name for name, row in CONSTRUCTORS.items() if row.ir is not None)  # what e-graph sizes count
HANDLES = frozenset(CONSTRUCTORS) - TERMS  # rows that name an e-class and are no term of it
SHARED = (INDEX_LIST, ITER_LIST)  # sorts whose values ExpressionGraph writes once, then by handle


def _index() -> None:
    """Each sort's rows, and which sorts may hold a scope (their text depends on handles)."""
    for row in _TABLE:
        row.sort.add(row)
    holders = {REF.sort}
    while grown := {row.sort for row in _TABLE if holders.intersection(row.kinds)} - holders:
        holders |= grown
    for sort in SORTS:
        sort.holds_scopes = sort in holders


_index()

# --------------------------------------------------------------------------------------------
# The egglog-python classes


def _classmethod_stub(row: Constructor) -> FunctionType:
    """A bodyless function with the row's parameters, as egglog-python reads a constructor from a
    class body. Built with exec, as dataclasses builds ``__init__``, so that its signature is an
    ordinary one; the annotations are set once every class exists (egglog-python reads them at
    first use)."""
    namespace: dict[str, Any] = {}
    exec(f"def {row.method}(cls, {', '.join(row.params)}):\n    pass", namespace)
    stub = namespace[row.method]
    stub.__module__, stub.__qualname__ = __name__, f"{row.sort.name}Term.{row.method}"
    stub.__doc__ = f"``{row!r}``: {row.ir.__name__ if row.ir else 'no IR node'}"
    return stub


def _term_class(sort: Sort, stubs: dict[str, FunctionType]) -> Any:
    """``class <Sort>Term(Expr, egg_sort=<Sort>)`` with a classmethod per row, built by calling the
    metaclass as the class statement would."""
    namespace: dict[str, Any] = {"__doc__": sort.doc}
    for row in sort.rows.values():
        namespace[row.method] = method(egg_fn=row.name, unextractable=row.ir is None)(classmethod(stubs[row.name]))
    return type(Expr)(f"{sort.name}Term", (Expr,), namespace, egg_sort=sort.name)


def _term_classes() -> None:
    stubs = {row.name: _classmethod_stub(row) for row in _TABLE}
    for sort in SORTS:
        sort.term_class = _term_class(sort, stubs)
    for row in _TABLE:
        hints = {p: k.term_class if isinstance(k, Sort) else k.annotation for p, k in zip(row.params, row.kinds)}
        stubs[row.name].__annotations__ = {**hints, "return": row.sort.term_class}


_term_classes()
IndexTerm, IndexListTerm, IterTerm, IterListTerm, TensorTerm, ScalarTerm, ScopeTerm = (s.term_class for s in SORTS)

# --------------------------------------------------------------------------------------------
# IR -> egglog: folds


class Fold:
    """IR values folded bottom-up through the rows: ``app(name, folded arguments)`` for each
    constructor, ``lit(primitive, IR value)`` for each literal; ``fold(sort, value)``. A nested
    scope found in ``handles`` (scope -> N) folds as ``(Ref N)``. With ``memo``, folds of values
    that hold no scope are kept for the fold's lifetime (an index's text never changes, and the
    same indices recur in every derivation state; an e-class id is only good until egglog rebuilds).

    ``shared`` sorts (with memo) fold each value once: its first fold is queued in
    ``definitions`` as ``(sort's handle row N, fold)``, and every fold of it, the first too, is
    the handle ``N``. Whoever sends the folds sends the definitions first (``take_definitions``)."""

    def __init__(
        self,
        app: Callable[[str, list], Any],
        lit: Callable[[Primitive, Any], Any],
        handles=None,
        memo=True,
        shared: Sequence[Sort] = (),
    ):
        self.app = app
        self.handles: dict[Scope, int] = {} if handles is None else handles
        self.definitions: list[tuple[Sort, Any, Any, Any]] = []  # (sort, value, handle fold, fold)
        self._memos: dict[Sort, _Memo] = {}
        self._defined = 0  # handles given out
        # kind -> its folding function; a memoised sort's is the memo's __getitem__ (no Python
        # call on a hit: the writer meets each iterator list and index list many times)
        self._folds: dict[Kind, Callable[[Any], Any]] = {}
        for sort in SORTS:
            fold = partial(self._define if sort in shared else self._fold, sort)
            if sort.holds_scopes or not memo:
                self._folds[sort] = fold
            else:
                self._memos[sort] = _Memo(fold)
                self._folds[sort] = self._memos[sort].__getitem__
        for row in _TABLE:
            for _, kind, term in row.arguments:
                if not term:
                    self._folds[kind] = partial(lit, kind)
        self._arguments = {row: [(get, self._folds[kind]) for get, kind, _ in row.arguments] for row in _TABLE}

    def __call__(self, sort: Sort, value: Any) -> Any:
        return self._folds[sort](value)

    def _fold(self, sort: Sort, value: Any) -> Any:
        if sort is _HANDLED:
            handle = self.handles.get(value)
            if handle is not None:
                return self.ref(handle)
        if sort.cons is not None and type(value) is tuple:  # a cons list, folded from its end
            element, result = self._folds[sort.cons.kinds[0]], self.app(sort.nil.name, [])  # type: ignore[union-attr]
            for item in reversed(value):
                result = self.app(sort.cons.name, [element(item), result])
            return result
        row = sort.row_of(value)
        return self.app(row.name, [fold(get(value)) for get, fold in self._arguments[row]])

    def ref(self, handle: int) -> Any:
        """The fold of handle ``(Ref N)``."""
        return self.app(REF.name, [self._folds[I64](handle)])

    def _define(self, sort: Sort, value: Any) -> Any:
        if not value:  # an empty list is one node already
            return self._fold(sort, value)
        handle = self.app(sort.handle.name, [self._folds[I64](self._defined)])  # type: ignore[union-attr]
        self._defined += 1
        self.definitions.append((sort, value, handle, self._fold(sort, value)))
        return handle

    def take_definitions(self) -> list[tuple[Sort, Any, Any, Any]]:
        """The definitions ``(sort, value, handle fold, fold)`` queued since the last call, to be
        sent before the folds that use them."""
        taken, self.definitions = self.definitions, []
        return taken


class _Memo(dict):
    def __init__(self, fold: Callable[[Any], Any]):
        super().__init__()
        self.fold = fold

    def __missing__(self, value: Any) -> Any:
        result = self[value] = self.fold(value)
        return result


# --------------------------------------------------------------------------------------------
# egglog -> IR: readers


class Reader:
    """The IR of egglog terms. A subclass says what a term is: ``app(term)`` gives a constructor's
    name and argument terms, ``lit(term)`` a literal's value. Equal terms are read once."""

    def __init__(self) -> None:
        self.memo: dict[Any, Any] = {}

    def app(self, term: Any) -> tuple[str, Sequence]:
        raise NotImplementedError

    def lit(self, term: Any) -> Any:
        raise NotImplementedError

    def read(self, kind: Kind, term: Any) -> Any:
        """The IR value of ``term``, a term of ``kind``."""
        if isinstance(kind, Primitive):
            return kind.decode(self.lit(term))
        hit = self.memo.get(term)
        if hit is None:
            name, args = self.app(term)
            row = kind.rows.get(name)
            if row is None:
                raise ExpressionError(f"egglog term: {name!r} is not a {kind.name} constructor")
            hit = self.memo[term] = self.node(row, args)
        return hit

    def node(self, row: Constructor, args: Sequence) -> Any:
        """The IR node of a ``row`` term with argument terms ``args``."""
        return row.build(*(self.read(kind, arg) for kind, arg in zip(row.kinds, args)))


class _TermDagReader(Reader):
    def __init__(self, termdag: bindings.TermDag):
        super().__init__()
        self.dag = termdag

    def app(self, term: int) -> tuple[str, Sequence]:
        node = self.dag.get(term)
        if not isinstance(node, bindings.TermApp):
            raise ExpressionError(f"egglog term {term}: expected a constructor, got {node!r}")
        return node.name, node.args

    def lit(self, term: int) -> Any:
        node = self.dag.get(term)
        if not isinstance(node, bindings.TermLit):
            raise ExpressionError(f"egglog term {term}: expected a literal, got {node!r}")
        return node.value.value  # type: ignore[union-attr]


def read_termdag(termdag: bindings.TermDag, term: int) -> Scope:
    """The Scope of a term of an egglog TermDag (what egglog's ``extract`` command returns)."""
    return _TermDagReader(termdag).read(SCOPE, term)
