"""Index algebra: normal forms, ranges and integer-set queries on index expressions.

* ``normalize(ix)`` is a canonical quasi-affine form (``LinearForm``): a sorted sum of
  ``coefficient * atom`` plus a constant, where an atom is an iterator name or a floor division /
  modulo of a normalised form by a constant. ``to_index`` prints it back readably and
  ``simplify(ix, ranges)`` also uses iterator ranges (``(k*p + q)/k = p`` when ``0 <= q < k``).
* ``index_bounds(ix, ranges)`` is the inclusive (min, max) of an index over a box: exact for
  affine indices, a sound enclosure with ``/`` and ``%``.
* With islpy: ``isl_index`` writes an index in isl syntax; ``padding_support(scope)`` is the
  smallest box outside of which a scope is zero because everything it reads there is padding.

Ranges are ``{name: (lo, hi)}``, half-open like iterator ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import islpy as isl

from .errors import ExpressionError
from .ir import Access, Binary, Index, IndexNeg, IndexOp, Lit, Num, Scalar, Scope, Tensor, Unary, Var, index_vars

Ranges = dict  # name -> (lo, hi), half-open


def affine_coefficients(ix: Index) -> tuple[dict[str, int], int] | None:
    """``({iterator: coefficient}, constant)`` of an affine index, or None if it uses / or %."""
    form = normalize(ix)
    if any(not isinstance(atom, str) for atom, _ in form.terms):
        return None
    return dict(form.terms), form.constant


# --------------------------------------------------------------------------------------------
# Normal form


@dataclass(frozen=True)
class Div:
    """floor(form / divisor) as an atom."""

    form: "LinearForm"
    divisor: int


@dataclass(frozen=True)
class Mod:
    """form mod divisor (in [0, divisor)) as an atom."""

    form: "LinearForm"
    divisor: int


def _atom_key(atom) -> tuple:
    if isinstance(atom, str):
        return (0, atom)
    return (1 if isinstance(atom, Div) else 2, atom.divisor, _form_key(atom.form))


def _form_key(form: "LinearForm") -> tuple:
    return (tuple((_atom_key(a), c) for a, c in form.terms), form.constant)


@dataclass(frozen=True)
class LinearForm:
    """``sum(coefficient * atom) + constant`` with atoms sorted and no zero coefficients."""

    terms: tuple = ()
    constant: int = 0

    @staticmethod
    def of(coefficients: dict, constant: int = 0) -> "LinearForm":
        terms = tuple(sorted(((a, c) for a, c in coefficients.items() if c), key=lambda t: _atom_key(t[0])))
        return LinearForm(terms, constant)

    def scaled(self, k: int) -> "LinearForm":
        return LinearForm.of({a: c * k for a, c in self.terms}, self.constant * k)

    def plus(self, other: "LinearForm", sign: int = 1) -> "LinearForm":
        coefficients = dict(self.terms)
        for a, c in other.terms:
            coefficients[a] = coefficients.get(a, 0) + sign * c
        return LinearForm.of(coefficients, self.constant + sign * other.constant)

    @property
    def is_constant(self) -> bool:
        return not self.terms


@lru_cache(maxsize=1 << 17)
def normalize(ix: Index) -> LinearForm:
    """The canonical form of an index (exact identities only, no ranges)."""
    match ix:
        case Var(name):
            return LinearForm(((name, 1),), 0)
        case Lit(value):
            return LinearForm((), value)
        case IndexNeg(arg):
            return normalize(arg).scaled(-1)
        case IndexOp("+", lhs, rhs):
            return normalize(lhs).plus(normalize(rhs))
        case IndexOp("-", lhs, rhs):
            return normalize(lhs).plus(normalize(rhs), -1)
        case IndexOp("*", lhs, rhs):
            a, b = normalize(lhs), normalize(rhs)
            return b.scaled(a.constant) if a.is_constant else a.scaled(b.constant)
        case IndexOp("/", lhs, rhs):
            return _divide(normalize(lhs), normalize(rhs).constant, None)
        case IndexOp("%", lhs, rhs):
            return _modulo(normalize(lhs), normalize(rhs).constant, None)
    raise ExpressionError(f"{ix!r} is not an index expression")


def _split_multiples(form: LinearForm, k: int) -> tuple[LinearForm, LinearForm]:
    """form = k * whole + rest, with whole holding the terms whose coefficients k divides."""
    whole = {a: c // k for a, c in form.terms if c % k == 0}
    rest = {a: c for a, c in form.terms if c % k}
    return LinearForm.of(whole, form.constant // k), LinearForm.of(rest, form.constant % k)


def _divide(form: LinearForm, k: int, ranges: Ranges | None) -> LinearForm:
    if k == 1:
        return form
    whole, rest = _split_multiples(form, k)  # floor((k*w + r)/k) = w + floor(r/k)
    if rest.is_constant:
        return whole.plus(LinearForm((), rest.constant // k))
    if ranges is not None:
        lo, hi = _form_bounds(rest, ranges)
        if lo // k == hi // k:  # floor(r/k) is one value over the whole box
            return whole.plus(LinearForm((), lo // k))
    return whole.plus(LinearForm(((Div(rest, k), 1),), 0))


def _modulo(form: LinearForm, k: int, ranges: Ranges | None) -> LinearForm:
    if k == 1:
        return LinearForm()
    _, rest = _split_multiples(form, k)  # (k*w + r) mod k = r mod k
    if rest.is_constant:
        return LinearForm((), rest.constant % k)
    if ranges is not None:
        lo, hi = _form_bounds(rest, ranges)
        if lo // k == hi // k:  # r mod k = r - k*floor(r/k), and floor(r/k) is constant
            return rest.plus(LinearForm((), -k * (lo // k)))
    return LinearForm(((Mod(rest, k), 1),), 0)


def simplify(ix: Index, ranges: Ranges | None = None) -> Index:
    """A readable index equal to ``ix`` (on the box ``ranges`` when given)."""
    if ranges is None:
        return to_index(normalize(ix))
    relevant = tuple(sorted((name, tuple(ranges[name])) for name in index_vars(ix) if name in ranges))
    return _simplify_in(ix, relevant)


@lru_cache(maxsize=1 << 17)
def _simplify_in(ix: Index, ranges: tuple) -> Index:
    return to_index(_normalize_in(ix, dict(ranges)))


def _normalize_in(ix: Index, ranges: Ranges) -> LinearForm:
    """normalize, then re-simplify every div/mod atom knowing the iterator ranges."""
    form = normalize(ix)
    result = LinearForm((), form.constant)
    for atom, c in form.terms:
        if isinstance(atom, str):
            result = result.plus(LinearForm(((atom, c),), 0))
        else:
            inner = _normalize_in(to_index(atom.form), ranges)
            make = _divide if isinstance(atom, Div) else _modulo
            result = result.plus(make(inner, atom.divisor, ranges).scaled(c))
    return result


def to_index(form: LinearForm) -> Index:
    """The form as an index tree: positive terms first, then negative ones, the constant last."""
    ordered = [t for t in form.terms if t[1] > 0] + [t for t in form.terms if t[1] < 0]
    result: Index | None = None
    for atom, c in ordered:
        term = _atom_index(atom)
        magnitude = abs(c)
        if magnitude != 1:
            term = IndexOp("*", Lit(magnitude), term)
        if result is None:
            result = term if c > 0 else (IndexNeg(term) if magnitude == 1 else IndexOp("*", Lit(c), _atom_index(atom)))
        else:
            result = IndexOp("+" if c > 0 else "-", result, term)
    if result is None:
        return Lit(form.constant)
    if form.constant:
        result = IndexOp("+" if form.constant > 0 else "-", result, Lit(abs(form.constant)))
    return result


def _atom_index(atom) -> Index:
    if isinstance(atom, str):
        return Var(atom)
    return IndexOp("/" if isinstance(atom, Div) else "%", to_index(atom.form), Lit(atom.divisor))


# --------------------------------------------------------------------------------------------
# Ranges


def _form_bounds(form: LinearForm, ranges: Ranges) -> tuple[int, int]:
    lo = hi = form.constant
    for atom, c in form.terms:
        a_lo, a_hi = _atom_bounds(atom, ranges)
        lo += min(c * a_lo, c * a_hi)
        hi += max(c * a_lo, c * a_hi)
    return lo, hi


def _atom_bounds(atom, ranges: Ranges) -> tuple[int, int]:
    if isinstance(atom, str):
        if atom not in ranges:
            raise ExpressionError(f"no range given for iterator {atom!r}")
        lo, hi = ranges[atom]
        return lo, hi - 1
    lo, hi = _form_bounds(atom.form, ranges)
    if isinstance(atom, Div):
        return lo // atom.divisor, hi // atom.divisor
    if lo // atom.divisor == hi // atom.divisor:  # no wrap-around inside the box
        return lo % atom.divisor, hi % atom.divisor
    return 0, atom.divisor - 1


def index_bounds(ix: Index, ranges: Ranges) -> tuple[int, int]:
    """Inclusive (min, max) of ``ix`` over the box: exact when affine, an enclosure otherwise."""
    return _form_bounds(normalize(ix), ranges)


# --------------------------------------------------------------------------------------------
# Integer sets (islpy)


def isl_index(ix: Index) -> str:
    """An index in isl's syntax, written from its normal form (isl wants bare integer factors)."""
    return _isl_form(normalize(ix))


def _isl_form(form: LinearForm) -> str:
    parts = []
    for atom, c in form.terms:
        if isinstance(atom, str):
            text = atom
        elif isinstance(atom, Div):
            text = f"floor(({_isl_form(atom.form)})/{atom.divisor})"
        else:
            text = f"(({_isl_form(atom.form)}) mod {atom.divisor})"
        parts.append(f"{c}*{text}")
    parts.append(str(form.constant))
    return "(" + " + ".join(parts) + ")"


def isl_box(iterators) -> str:
    """The constraints ``lo <= x < hi`` of iterators, in isl syntax."""
    return " and ".join(f"{it.lo} <= {it.name} < {it.hi}" for it in iterators) or "true"


def _support_constraint(body: Scalar) -> str | None:
    """Where the body can be non-zero, as an isl condition; None means anywhere."""
    match body:
        case Access(source, indices):
            bounds = (
                [(0, d) for d in source.shape] if isinstance(source, Tensor) else [(it.lo, it.hi) for it in source.traversal]
            )
            parts = [f"{lo} <= {isl_index(ix)} < {hi}" for ix, (lo, hi) in zip(indices, bounds)]
            return "(" + " and ".join(parts) + ")" if parts else None
        case Num(value):
            return "false" if value == 0 else None
        case Unary("neg" | "relu" | "tanh" | "sqrt", arg):  # f(0) = 0
            return _support_constraint(arg)
        case Binary("*", lhs, rhs):
            parts = [p for p in (_support_constraint(lhs), _support_constraint(rhs)) if p is not None]
            return "(" + " and ".join(parts) + ")" if parts else None
        case Binary("+" | "-" | "max", lhs, rhs):
            a, b = _support_constraint(lhs), _support_constraint(rhs)
            return None if a is None or b is None else f"({a} or {b})"
    return None  # exp, sigmoid, division: can be non-zero anywhere


def padding_support(scope: Scope) -> dict[str, tuple[int, int]]:
    return dict(_padding_support(scope))


@lru_cache(maxsize=1 << 14)
def _padding_support(scope: Scope) -> tuple:
    """Per traversal iterator, the half-open range outside of which the scope is 0 (islpy).

    The set of (traversal, summation) points where the body may be non-zero is projected onto
    the traversal iterators and boxed. An all-zero scope gets empty ranges (lo == hi).
    """
    box = {it.name: (it.lo, it.hi) for it in scope.traversal}
    condition = _support_constraint(scope.body)
    if condition is None:
        return tuple(box.items())
    names = [it.name for it in scope.traversal]
    summed = [it.name for it in scope.summation]
    exists = f"exists ({', '.join(summed)} : {isl_box(scope.summation)} and {condition})" if summed else condition
    support = isl.Set(f"{{ [{', '.join(names)}] : {isl_box(scope.traversal)} and {exists} }}")
    if support.is_empty():
        return tuple((name, (lo, lo)) for name, (lo, _) in box.items())
    result = {}
    for position, name in enumerate(names):
        lo = support.dim_min_val(position).to_python()
        hi = support.dim_max_val(position).to_python()
        result[name] = (int(lo), int(hi) + 1)
    return tuple(result.items())
