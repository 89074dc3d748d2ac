"""Index algebra: normal forms, range-aware simplification and bounds of index expressions.

* ``normalize(ix)`` is a canonical quasi-affine form (``LinearForm``): a sorted sum of
  ``coefficient * atom`` plus a constant, where an atom is an iterator name or a floor division
  (``Div``) of a normalised form by a constant; ``x%k`` is kept as ``x - k*(x/k)`` so that forms
  stay linear, and ``with_remainders`` shows it as a ``Mod`` atom. ``to_index`` builds a readable
  index back; ``simplify(ix, ranges)`` also uses iterator ranges (``(k*p + q)/k = p`` and
  ``(k*p + q)%k = q`` when ``0 <= q < k`` on the box).
* ``index_bounds(ix, ranges)`` is the inclusive (min, max) of an index over a box: exact for
  affine indices, a sound enclosure with ``/`` and ``%``.
* ``affine_coefficients`` reads an affine index as coefficients; ``affine_index`` writes one.

Ranges are ``{name: (lo, hi)}``, half-open like iterator ranges; a sequence of ``Iterator`` is
accepted wherever ranges are. Every error is an ``ExpressionError``. No dependencies.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Union

from rewriter.ir import ExpressionError, Index, IndexNeg, IndexOp, Iterator, Lit, Var, as_index, box, index_vars

Ranges = Mapping  # name -> (lo, hi), half-open


def affine_coefficients(ix: Index) -> tuple[dict[str, int], int] | None:
    """``({iterator: coefficient}, constant)`` of an affine index, or None if it uses / or %.

    Zero coefficients are dropped, so ``h+r-h`` gives ``({"r": 1}, 0)``; ``(2*h)/2`` is affine.
    """
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


Atom = Union[str, Div, Mod]


def _atom_key(atom: Atom) -> tuple:
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
    def of(coefficients: Mapping, constant: int = 0) -> "LinearForm":
        terms = tuple(sorted(((a, c) for a, c in coefficients.items() if c), key=lambda t: _atom_key(t[0])))
        return LinearForm(terms, constant)

    @staticmethod
    def atom(atom: Atom, coefficient: int = 1) -> "LinearForm":
        return LinearForm(((atom, coefficient),), 0) if coefficient else LinearForm()

    def scaled(self, k: int) -> "LinearForm":
        return LinearForm.of({a: c * k for a, c in self.terms}, self.constant * k)

    def plus(self, other: "LinearForm | int", sign: int = 1) -> "LinearForm":
        if isinstance(other, int):
            return LinearForm(self.terms, self.constant + sign * other)
        coefficients = dict(self.terms)
        for a, c in other.terms:
            coefficients[a] = coefficients.get(a, 0) + sign * c
        return LinearForm.of(coefficients, self.constant + sign * other.constant)

    def coefficient(self, atom: Atom) -> int:
        return dict(self.terms).get(atom, 0)

    @property
    def is_constant(self) -> bool:
        return not self.terms

    @property
    def is_affine(self) -> bool:
        return all(isinstance(a, str) for a, _ in self.terms)

    def __str__(self) -> str:
        return str(to_index(self))


@lru_cache(maxsize=1 << 17)
def normalize(ix: Index) -> LinearForm:
    """The canonical form of an index, by exact identities only (no ranges).

    Forms are linear: ``normalize(a - b)`` is ``normalize(a)`` minus ``normalize(b)``, and the atoms
    are iterators and floor divisions ``Div(arg, k)`` of canonical arguments; a remainder is
    ``x%k = x - k*(x/k)`` (``with_remainders`` and ``to_index`` write it back as ``x%k``). The
    argument of a division is reduced by ``x/1 = x``, ``(k*a+b)/k = a + b/k`` (every coefficient
    and the constant of ``b`` in [0, k)), ``(g*a+c)/(g*k) = (a + c/g)/k`` and
    ``(x/a + c)/k = (x + a*c)/(a*k)``; so ``(k*a+b)%k = b%k`` and ``(x%(c*k))%k = x%k`` follow.
    Equal forms mean equal values; unequal forms may still agree (``(x+1)/2 + x/2 = x``): ask
    ``equal_on`` for a decision.
    """
    ix = as_index(ix)
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
            if not (a.is_constant or b.is_constant):
                raise ExpressionError(f"non-affine index {ix}: a product of two iterator expressions")
            return b.scaled(a.constant) if a.is_constant else a.scaled(b.constant)
        case IndexOp("/" | "%" as op, lhs, rhs):
            k = normalize(rhs)
            if not k.is_constant or k.constant <= 0:
                raise ExpressionError(f"index {ix}: the divisor must be a positive constant")
            return divide_form(normalize(lhs), k.constant) if op == "/" else modulo_form(normalize(lhs), k.constant)
    raise ExpressionError(f"{ix!r} is not an index expression")


def _reduce(form: LinearForm, k: int) -> tuple[LinearForm, LinearForm]:
    """``form = k*whole + rest`` with every coefficient and the constant of ``rest`` in [0, k)."""
    whole = {a: c // k for a, c in form.terms}
    rest = {a: c % k for a, c in form.terms}
    return LinearForm.of(whole, form.constant // k), LinearForm.of(rest, form.constant % k)


def divide_form(form: LinearForm, k: int) -> LinearForm:
    """floor(form / k) in canonical form (exact identities only)."""
    if k == 1:
        return form
    whole, rest = _reduce(form, k)
    if rest.is_constant:  # 0 <= rest < k
        return whole
    g = math.gcd(k, *(c for _, c in rest.terms))
    if g > 1:  # floor((g*a + c)/(g*k')) = floor((a + floor(c/g))/k')
        inner = LinearForm.of({a: c // g for a, c in rest.terms}, rest.constant // g)
        return whole.plus(divide_form(inner, k // g))
    (atom, c), *others = rest.terms
    if not others and c == 1 and isinstance(atom, Div):  # floor((floor(x/a) + c)/k) = floor((x + a*c)/(a*k))
        return whole.plus(divide_form(atom.form.plus(atom.divisor * rest.constant), atom.divisor * k))
    return whole.plus(LinearForm.atom(Div(rest, k)))


def modulo_form(form: LinearForm, k: int) -> LinearForm:
    """form mod k = form - k*floor(form/k), in canonical form."""
    return form.plus(divide_form(form, k).scaled(k), -1)


@lru_cache(maxsize=1 << 16)
def with_remainders(form: LinearForm) -> LinearForm:
    """The same value with ``Mod`` atoms: ``c*x - c*k*(x/k)`` becomes ``c*(x%k)`` where the form
    holds those ``c*x`` terms (at least in part), in atom order; ``x`` may also be a division
    ``y/a`` present in the form, since ``(y/a)/k`` is normalised to ``y/(a*k)``. For printing and
    bounds only: canonical forms (``normalize``) have no ``Mod`` atoms."""
    have = dict(form.terms)
    for atom, d in form.terms:
        if not isinstance(atom, Div):
            continue
        for x, k in _remainder_candidates(atom, have):
            if d % k:
                continue
            c = -d // k
            if all(have.get(a, 0) * c * e > 0 and abs(have.get(a, 0)) >= abs(c * e) for a, e in x.terms):
                rest = form.plus(LinearForm.atom(atom, d), -1).plus(x.scaled(c), -1)
                return with_remainders(rest.plus(LinearForm.atom(Mod(x, k), c)))
    return form


def _remainder_candidates(atom: Div, have: Mapping):
    """``(x, k)`` with ``atom == x/k``: its own argument, or ``y/a`` of the form when a divides k."""
    yield atom.form, atom.divisor
    for other in have:
        if (
            isinstance(other, Div)
            and other.form == atom.form
            and other.divisor < atom.divisor
            and atom.divisor % other.divisor == 0
        ):
            yield LinearForm.atom(other), atom.divisor // other.divisor


def to_index(form: LinearForm) -> Index:
    """The form as an index tree: positive terms first, then negative ones, the constant last.

    Coefficients print as ``k*x`` (``1*`` omitted); a leading negative term is ``-x`` or ``-k*x``;
    remainders print as ``x%k`` (see ``with_remainders``).
    """
    form = with_remainders(form)
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


def _atom_index(atom: Atom) -> Index:
    if isinstance(atom, str):
        return Var(atom)
    return IndexOp("/" if isinstance(atom, Div) else "%", to_index(atom.form), Lit(atom.divisor))


# --------------------------------------------------------------------------------------------
# Range-aware simplification


def simplify(ix: Index, ranges: Ranges | Iterable[Iterator] | None = None) -> Index:
    """A readable index equal to ``ix`` (everywhere, or on the box ``ranges`` when given).

    Iterators missing from ``ranges`` are treated as unbounded.
    """
    if ranges is None or normalize(ix).is_affine:  # ranges only matter to / and %
        return _simplest(ix)
    if not isinstance(ranges, Mapping):
        ranges = box(ranges)
    # only the index's own iterators matter: a small key, so the cache hits across scopes
    relevant = tuple(sorted((name, tuple(ranges[name])) for name in index_vars(ix) if name in ranges))
    return _simplify_in(ix, relevant)


@lru_cache(maxsize=1 << 17)
def _simplest(ix: Index) -> Index:
    return to_index(normalize(ix))


@lru_cache(maxsize=1 << 17)
def _simplify_in(ix: Index, ranges: tuple) -> Index:
    return to_index(simplify_form(normalize(ix), as_ranges(dict(ranges))))


def simplify_form(form: LinearForm, ranges: Ranges) -> LinearForm:
    """``form`` with every division (and remainder) atom re-simplified on the box, inner first."""
    result = LinearForm((), form.constant)
    for atom, c in form.terms:
        if isinstance(atom, str):
            result = result.plus(LinearForm.atom(atom, c))
        else:
            inner = simplify_form(atom.form, ranges)
            result = result.plus(_divmod_on_box(inner, atom.divisor, isinstance(atom, Mod), ranges).scaled(c))
    return result


def _divmod_on_box(form: LinearForm, k: int, remainder: bool, ranges: Ranges) -> LinearForm:
    split = _split_on_box(form, k, ranges)
    if split is not None:
        quotient, rest = split
        return rest if remainder else quotient
    return modulo_form(form, k) if remainder else divide_form(form, k)


def _split_on_box(form: LinearForm, k: int, ranges: Ranges, max_free: int = 10) -> tuple[LinearForm, LinearForm] | None:
    """``form = k*p + q`` with ``0 <= q < k`` on the box, as ``(p, q)``, or None if none is found.

    Each coefficient of q is the coefficient of form modulo k, or that minus k; the constant of
    q is then the only one that can put q's range inside [0, k). Fewer negative choices first.
    Iterators without a range make it None.
    """
    residues = {atom: c % k for atom, c in form.terms}
    free = [atom for atom, r in residues.items() if r]
    for count in range(len(free) + 1 if len(free) <= max_free else 1):
        for negative in itertools.combinations(free, count):
            terms = LinearForm.of({a: r - k if a in negative else r for a, r in residues.items()})
            try:
                lo, hi = form_bounds(terms, ranges)
            except ExpressionError:
                return None
            constant = -lo + (form.constant + lo) % k  # the least constant >= -lo congruent to form's
            if hi + constant < k:
                rest = terms.plus(constant)
                difference = form.plus(rest, -1)
                quotient = LinearForm.of({a: c // k for a, c in difference.terms}, difference.constant // k)
                return quotient, rest
    return None


# --------------------------------------------------------------------------------------------
# Ranges


def as_ranges(ranges: Ranges | Iterable[Iterator]) -> dict[str, tuple[int, int]]:
    """``{name: (lo, hi)}`` from a mapping or from Iterators; refuses empty or malformed ranges."""
    items = ranges.items() if isinstance(ranges, Mapping) else ((it.name, (it.lo, it.hi)) for it in ranges)
    box = {}
    for name, bounds in items:
        try:
            lo, hi = (int(b) for b in bounds)
        except (TypeError, ValueError):
            raise ExpressionError(f"range of {name!r} must be a pair (lo, hi), got {bounds!r}") from None
        if hi <= lo:
            raise ExpressionError(f"range of {name!r} is empty: [{lo}, {hi})")
        box[name] = (lo, hi)
    return box


def form_bounds(form: LinearForm, ranges: Ranges) -> tuple[int, int]:
    """Interval arithmetic on the form written with remainders (``x%k`` lies in [0, k))."""
    form = with_remainders(form)
    lo = hi = form.constant
    for atom, c in form.terms:
        a_lo, a_hi = _atom_bounds(atom, ranges)
        lo += min(c * a_lo, c * a_hi)
        hi += max(c * a_lo, c * a_hi)
    return lo, hi


def _atom_bounds(atom: Atom, ranges: Ranges) -> tuple[int, int]:
    if isinstance(atom, str):
        if atom not in ranges:
            raise ExpressionError(f"no range given for iterator {atom!r}")
        lo, hi = ranges[atom]
        return lo, hi - 1
    lo, hi = form_bounds(atom.form, ranges)
    if isinstance(atom, Div):
        return lo // atom.divisor, hi // atom.divisor
    if lo // atom.divisor == hi // atom.divisor:  # no wrap-around inside the box
        return lo % atom.divisor, hi % atom.divisor
    return 0, atom.divisor - 1


def index_bounds(ix: Index, ranges: Ranges | Iterable[Iterator]) -> tuple[int, int]:
    """Inclusive (min, max) of ``ix`` over the box: exact when affine, an enclosure otherwise.

    Interval arithmetic on the normal form, where each iterator appears once (so exact for an
    affine index); every iterator of ``ix`` needs a range.
    """
    ranges = ranges if isinstance(ranges, Mapping) else box(ranges)
    # only the ranges of the index's own iterators matter: that makes the answer cacheable
    return _bounds_on(ix, tuple((n, tuple(ranges[n])) for n in sorted(index_vars(ix)) if n in ranges))


@lru_cache(maxsize=1 << 16)
def _bounds_on(ix: Index, ranges: tuple) -> tuple[int, int]:
    return form_bounds(normalize(ix), as_ranges(dict(ranges)))


def affine_index(coefficients: dict, constant: int = 0) -> Index:
    """A readable index ``c1*x1 + c2*x2 - ... + constant`` (unit coefficients left out)."""
    result = None
    for name, c in coefficients.items():
        if c == 0:
            continue
        term = Var(name) if abs(c) == 1 else abs(c) * Var(name)
        if result is None:
            result = term if c > 0 else (-term if abs(c) == 1 else (-abs(c)) * Var(name))
        else:
            result = result + term if c > 0 else result - term
    if result is None:
        return Lit(constant)
    return result + constant if constant else result


def row_major(shape) -> list[int]:
    """The element strides of a row-major (C-order) array of ``shape``: where index
    ``(i0, i1, ...)`` lies is ``sum(i_k * stride_k)``."""
    return [math.prod(shape[k + 1 :]) for k in range(len(shape))]
