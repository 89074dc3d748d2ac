"""Index algebra: normal forms, ranges and integer-set queries on index expressions.

Normal forms (no dependencies)

* ``normalize(ix)`` is a canonical quasi-affine form (``LinearForm``): a sorted sum of
  ``coefficient * atom`` plus a constant, where an atom is an iterator name or a floor division
  (``Div``, also called ``FloorDiv``) of a normalised form by a constant; ``x%k`` is kept as
  ``x - k*(x/k)`` so that forms stay linear, and ``with_remainders`` shows it as a ``Mod`` atom.
  ``to_index`` builds a readable index back; ``simplify(ix, ranges)`` also uses iterator ranges
  (``(k*p + q)/k = p`` and ``(k*p + q)%k = q`` when ``0 <= q < k`` on the box).
* ``index_bounds(ix, ranges)`` is the inclusive (min, max) of an index over a box: exact for
  affine indices, a sound enclosure with ``/`` and ``%``.

Integer sets (islpy; iterators are renamed positionally, so any iterator name is safe)

* ``is_injective``, ``is_bijective``, ``image_box`` and ``inverse`` of a tuple of indices over a
  box (the iterator map behind variable substitution), ``equal_on`` (two indices agree on a box),
  ``padding_support(scope)`` (the box outside of which a scope reads only padding), and the
  string helpers ``isl_index`` / ``isl_box`` / ``isl_name``.

Ranges are ``{name: (lo, hi)}``, half-open like iterator ranges; a sequence of ``Iterator`` is
accepted wherever ranges are. Every error is an ``ExpressionError``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Iterable, Mapping, Sequence, Union

import islpy as isl

from .errors import ExpressionError
from .ir import Access, Binary, Index, IndexNeg, IndexOp, Iterator, Lit, Num, Scalar, Scope, Tensor, Unary, Var, as_index, index_vars

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


FloorDiv = Div


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
            return _divide(normalize(lhs), k.constant) if op == "/" else _modulo(normalize(lhs), k.constant)
    raise ExpressionError(f"{ix!r} is not an index expression")


def _reduce(form: LinearForm, k: int) -> tuple[LinearForm, LinearForm]:
    """``form = k*whole + rest`` with every coefficient and the constant of ``rest`` in [0, k)."""
    whole = {a: c // k for a, c in form.terms}
    rest = {a: c % k for a, c in form.terms}
    return LinearForm.of(whole, form.constant // k), LinearForm.of(rest, form.constant % k)


def _divide(form: LinearForm, k: int) -> LinearForm:
    """floor(form / k) in canonical form (exact identities only)."""
    if k == 1:
        return form
    whole, rest = _reduce(form, k)
    if rest.is_constant:  # 0 <= rest < k
        return whole
    g = math.gcd(k, *(c for _, c in rest.terms))
    if g > 1:  # floor((g*a + c)/(g*k')) = floor((a + floor(c/g))/k')
        inner = LinearForm.of({a: c // g for a, c in rest.terms}, rest.constant // g)
        return whole.plus(_divide(inner, k // g))
    (atom, c), *others = rest.terms
    if not others and c == 1 and isinstance(atom, Div):  # floor((floor(x/a) + c)/k) = floor((x + a*c)/(a*k))
        return whole.plus(_divide(atom.form.plus(atom.divisor * rest.constant), atom.divisor * k))
    return whole.plus(LinearForm.atom(Div(rest, k)))


def _modulo(form: LinearForm, k: int) -> LinearForm:
    """form mod k = form - k*floor(form/k), in canonical form."""
    return form.plus(_divide(form, k).scaled(k), -1)


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
        if isinstance(other, Div) and other.form == atom.form and other.divisor < atom.divisor and atom.divisor % other.divisor == 0:
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
    if ranges is None:
        return to_index(normalize(ix))
    if not isinstance(ranges, Mapping):
        ranges = {it.name: (it.lo, it.hi) for it in ranges}
    # only the index's own iterators matter: a small key, so the cache hits across scopes
    relevant = tuple(sorted((name, tuple(ranges[name])) for name in index_vars(ix) if name in ranges))
    return _simplify_in(ix, relevant)


@lru_cache(maxsize=1 << 17)
def _simplify_in(ix: Index, ranges: tuple) -> Index:
    return to_index(simplify_form(normalize(ix), _as_ranges(dict(ranges))))


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
    return _modulo(form, k) if remainder else _divide(form, k)


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
                lo, hi = _form_bounds(terms, ranges)
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


def _as_ranges(ranges: Ranges | Iterable[Iterator]) -> dict[str, tuple[int, int]]:
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


def _form_bounds(form: LinearForm, ranges: Ranges) -> tuple[int, int]:
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
    lo, hi = _form_bounds(atom.form, ranges)
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
    box = ranges if isinstance(ranges, Mapping) else {it.name: (it.lo, it.hi) for it in ranges}
    # only the ranges of the index's own iterators matter: that makes the answer cacheable
    return _bounds_on(ix, tuple((n, tuple(box[n])) for n in sorted(index_vars(ix)) if n in box))


@lru_cache(maxsize=1 << 16)
def _bounds_on(ix: Index, ranges: tuple) -> tuple[int, int]:
    return _form_bounds(normalize(ix), _as_ranges(dict(ranges)))


# --------------------------------------------------------------------------------------------
# isl syntax

# Words isl's parser reserves; an iterator with one of these names is renamed in isl text.
ISL_KEYWORDS = frozenset(
    {"and", "or", "not", "implies", "exists", "mod", "floor", "ceil", "floord", "ceild", "min", "max",
     "rat", "true", "false", "infty", "NaN", "cst"}
)


def isl_name(name: str) -> str:
    """``name`` as an isl identifier: unchanged unless isl reserves it (then ``name__isl``)."""
    return f"{name}__isl" if name in ISL_KEYWORDS else name


def isl_index(ix: Index, names: Mapping[str, str] | None = None) -> str:
    """An index in isl's syntax, from its normal form; ``names`` renames iterators (else isl_name)."""
    return _isl_form(normalize(ix), names)


def _isl_form(form: LinearForm, names: Mapping[str, str] | None = None) -> str:
    parts = []
    for atom, c in form.terms:
        if isinstance(atom, str):
            text = names[atom] if names is not None else isl_name(atom)
        elif isinstance(atom, Div):
            text = f"floor(({_isl_form(atom.form, names)})/{atom.divisor})"
        else:
            text = f"(({_isl_form(atom.form, names)}) mod {atom.divisor})"
        parts.append(f"{c}*{text}")
    parts.append(str(form.constant))
    return "(" + " + ".join(parts) + ")"


def isl_box(iterators: Ranges | Iterable[Iterator], names: Mapping[str, str] | None = None) -> str:
    """The constraints ``lo <= x < hi`` of a box, in isl syntax (``true`` for no iterators)."""
    box = _as_ranges(iterators)
    rename = names if names is not None else {n: isl_name(n) for n in box}
    return " and ".join(f"{lo} <= {rename[n]} < {hi}" for n, (lo, hi) in box.items()) or "true"


def _positional(box: Mapping, prefix: str = "i") -> dict[str, str]:
    return {name: f"{prefix}{k}" for k, name in enumerate(box)}


def _box_set(bounds: Sequence[tuple[int, int]]) -> isl.Set:
    dims = [f"o{k}" for k in range(len(bounds))]
    constraints = " and ".join(f"{lo} <= {d} < {hi}" for d, (lo, hi) in zip(dims, bounds)) or "true"
    return isl.Set(f"{{ [{', '.join(dims)}] : {constraints} }}")


def _check_covered(indices: Sequence[Index], box: Mapping) -> None:
    for position, ix in enumerate(indices):
        missing = index_vars(ix) - set(box)
        if missing:
            raise ExpressionError(f"index {position} ({ix}) uses iterator(s) {sorted(missing)} that have no range")


# --------------------------------------------------------------------------------------------
# Maps of a box through indices (islpy)


def index_map(indices: Sequence[Index], ranges: Ranges | Iterable[Iterator]) -> isl.Map:
    """The isl map ``{ [iterators of the box] -> [indices] : box }``, iterators in ranges' order."""
    box = _as_ranges(ranges)
    indices = [as_index(ix) for ix in indices]
    _check_covered(indices, box)
    rename = _positional(box)
    outs = ", ".join(_isl_form(normalize(ix), rename) for ix in indices)
    return isl.Map(f"{{ [{', '.join(rename.values())}] -> [{outs}] : {isl_box(box, rename)} }}")


def is_injective(indices: Sequence[Index], ranges: Ranges | Iterable[Iterator]) -> bool:
    """Whether distinct points of the box give distinct index tuples (every box iterator counts)."""
    return index_map(indices, ranges).is_injective()


def image_box(indices: Sequence[Index], ranges: Ranges | Iterable[Iterator]) -> tuple[tuple[tuple[int, int], ...], bool]:
    """``(((lo, hi) per index, half-open), exact)``: the bounding box of the image of the box and
    whether the image is exactly that box."""
    image = index_map(indices, ranges).range()
    bounds = tuple(
        (image.dim_min_val(k).to_python(), image.dim_max_val(k).to_python() + 1) for k in range(image.dim(isl.dim_type.set))
    )
    return bounds, image.is_equal(_box_set(bounds))


def is_bijective(
    indices: Sequence[Index], ranges: Ranges | Iterable[Iterator], target_ranges: Sequence[tuple[int, int]]
) -> bool:
    """Whether the indices map the box one-to-one onto exactly the box ``target_ranges``
    (one half-open (lo, hi) per index)."""
    target = [tuple(int(b) for b in t) for t in target_ranges]
    if len(target) != len(indices):
        raise ExpressionError(f"{len(indices)} index(es) but {len(target)} target range(s)")
    m = index_map(indices, ranges)
    return m.is_injective() and m.range().is_equal(_box_set(target))


def equal_on(a: Index, b: Index, ranges: Ranges | Iterable[Iterator]) -> bool:
    """Whether two indices have equal values at every point of the box (decided by isl)."""
    box = _as_ranges(ranges)
    _check_covered([as_index(a), as_index(b)], box)
    if normalize(a) == normalize(b):
        return True
    rename = _positional(box)
    differ = f"{isl_index(a, rename)} != {isl_index(b, rename)}"
    return isl.Set(f"{{ [{', '.join(rename.values())}] : {isl_box(box, rename)} and {differ} }}").is_empty()


def inverse(
    indices: Sequence[Index], ranges: Ranges | Iterable[Iterator], new_names: Sequence[str]
) -> dict[str, Index]:
    """The old iterators as indices of new ones, where ``new_names[k]`` stands for ``indices[k]``.

    Defined when the indices are injective on the box; the result is exact on the image of the
    box. Merges in a mixed radix are solved directly (``z = 3*x + y`` with ``y`` in [0, 3) gives
    ``{x: z/3, y: z%3}``); otherwise isl computes the inverse (unimodular maps such as the skew
    ``j = i1 + k*i2``, splits ``(x/b, x%b)``, compositions of these). Each candidate is simplified
    on the image box and checked with isl. Raises ExpressionError when the map is not injective,
    or when isl's inverse is piecewise and no piece holds on the whole image (e.g. the digit
    permutation ``2*(x%2) + x/2``).
    """
    box = _as_ranges(ranges)
    new_names = [str(n) for n in new_names]
    if len(new_names) != len(indices) or len(set(new_names)) != len(new_names):
        raise ExpressionError(f"inverse needs one distinct new name per index, got {new_names} for {len(indices)} index(es)")
    m = index_map(indices, box)
    if not m.is_injective():
        raise ExpressionError(f"indices ({', '.join(map(str, indices))}) are not injective on the box {isl_box(box)}: no inverse")
    bounds, exact = image_box(indices, box)
    radix = _mixed_radix_inverse([normalize(i) for i in indices], box, new_names)
    if radix is not None:
        result = _checked_inverse(m, radix, box, new_names, dict(zip(new_names, bounds)) if exact else None)
        if result is not None:
            return result
    pieces = _inverse_pieces(m.reverse(), new_names)
    for forms in pieces:  # isl may split an inverse into pieces: one of them may hold everywhere
        result = _checked_inverse(m, forms, box, new_names, dict(zip(new_names, bounds)) if exact else None)
        if result is not None:
            return result
    raise ExpressionError(
        f"the inverse of ({', '.join(map(str, indices))}) on {isl_box(box)} is piecewise in isl "
        f"({len(pieces)} pieces) and no piece is an index expression for all of it"
    )


def _checked_inverse(m: isl.Map, forms, box: Mapping, new_names, image: Mapping | None) -> dict[str, Index] | None:
    """The candidate forms (simplified on the image box when it is one) if they invert ``m``."""
    if image is not None:
        forms = [simplify_form(f, image) for f in forms]
    result = {name: to_index(f) for name, f in zip(box, forms)}
    return result if _inverts(m, [result[name] for name in box], new_names) else None


def _inverse_pieces(reverse: isl.Map, new_names: Sequence[str]) -> list[list[LinearForm]]:
    """The quasi-affine pieces of a single-valued map, each as one normal form per output."""
    pieces: list = []
    isl.PwMultiAff.from_map(reverse).coalesce().foreach_piece(lambda _, ma: pieces.append(ma))
    return [[_aff_form(ma.get_at(k), new_names) for k in range(ma.dim(isl.dim_type.out))] for ma in pieces]


def _mixed_radix_inverse(forms: Sequence[LinearForm], box: Mapping, new_names: Sequence[str]) -> list[LinearForm] | None:
    """Old iterators from merged indices ``n = sum(c_j * x_j) + c`` whose |c_j|, sorted, are the
    place values of a mixed radix with the iterators' sizes as digits (isl splits these into
    pieces on small boxes); None unless every old iterator is recovered this way."""
    solved: dict[str, LinearForm] = {}
    for form, new in zip(forms, new_names):
        if not form.terms or not form.is_affine:
            continue
        digits = sorted((abs(c), a, c) for a, c in form.terms)
        place = 1
        for weight, a, _ in digits:
            if weight != place:
                break
            place *= box[a][1] - box[a][0]
        else:
            offset = LinearForm.atom(new).plus(_form_bounds(form, box)[0], -1)  # in [0, place)
            for position, (weight, a, c) in enumerate(digits):
                digit = _divide(offset, weight)
                if position < len(digits) - 1:
                    digit = _modulo(digit, box[a][1] - box[a][0])
                x = digit.plus(box[a][0]) if c > 0 else digit.scaled(-1).plus(box[a][1] - 1)
                solved.setdefault(a, x)
    return [solved[name] for name in box] if set(solved) == set(box) else None


def _inverts(m: isl.Map, old_from_new: Sequence[Index], new_names: Sequence[str]) -> bool:
    """Whether the indices (of the new names) are the inverse of ``m`` on its whole image."""
    rename = {name: f"n{k}" for k, name in enumerate(new_names)}
    outs = ", ".join(isl_index(ix, rename) for ix in old_from_new)
    candidate = isl.Map(f"{{ [{', '.join(rename.values())}] -> [{outs}] }}").intersect_domain(m.range())
    return candidate.is_equal(m.reverse())


def _aff_form(aff: isl.Aff, names: Sequence[str]) -> LinearForm:
    """An isl quasi-affine expression as a normal form (floor of it where it is rational)."""
    divs: list[LinearForm] = []
    for j in range(aff.dim(isl.dim_type.div)):
        divs.append(_floor_of(_rational_parts(aff.get_div(j), names, divs)))
    return _floor_of(_rational_parts(aff, names, divs))


def _rational_parts(aff: isl.Aff, names: Sequence[str], divs: Sequence[LinearForm]) -> list[tuple[Fraction, LinearForm]]:
    """``aff`` as ``sum(fraction * form)`` over its inputs, its (earlier) divs and 1."""
    parts = [(Fraction(str(aff.get_constant_val())), LinearForm((), 1))]
    for k, name in enumerate(names):
        parts.append((Fraction(str(aff.get_coefficient_val(isl.dim_type.in_, k))), LinearForm.atom(name)))
    for j in range(aff.dim(isl.dim_type.div)):
        coefficient = Fraction(str(aff.get_coefficient_val(isl.dim_type.div, j)))
        if coefficient and j >= len(divs):
            raise ExpressionError(f"internal: isl div {j} of {aff} refers to a later div")
        if coefficient:
            parts.append((coefficient, divs[j]))
    return parts


def _floor_of(parts: Sequence[tuple[Fraction, LinearForm]]) -> LinearForm:
    denominator = math.lcm(*(q.denominator for q, _ in parts))
    total = LinearForm()
    for q, form in parts:
        total = total.plus(form.scaled(int(q * denominator)))
    return _divide(total, denominator)


# --------------------------------------------------------------------------------------------
# Padding support (islpy)


def padding_support(scope: Scope) -> dict[str, tuple[int, int]]:
    """Per traversal iterator, the smallest half-open range outside of which the scope is 0.

    The set of (traversal, summation) points where the body may be non-zero for some input is
    computed with isl (see ``_support_condition``), its summation iterators are projected out and
    the rest is boxed. A scope that is 0 everywhere gets empty ranges ``(lo, lo)``.
    """
    return dict(_padding_support(scope))


@lru_cache(maxsize=1 << 14)
def _padding_support(scope: Scope) -> tuple:
    box = {it.name: (it.lo, it.hi) for it in scope.traversal}
    rename = _positional({it.name: None for it in scope.iterators})
    condition = _support_condition(scope.body, rename)
    if condition is None:
        return tuple(box.items())
    dims = ", ".join(rename[it.name] for it in scope.traversal)
    summed = ", ".join(rename[it.name] for it in scope.summation)
    exists = f"exists ({summed} : {isl_box(scope.summation, rename)} and {condition})" if summed else condition
    support = isl.Set(f"{{ [{dims}] : {isl_box(scope.traversal, rename)} and {exists} }}")
    if support.is_empty():
        return tuple((name, (lo, lo)) for name, (lo, _) in box.items())
    return tuple(
        (it.name, (support.dim_min_val(k).to_python(), support.dim_max_val(k).to_python() + 1))
        for k, it in enumerate(scope.traversal)
    )


def read_bounds(source: Tensor | Scope) -> list[tuple[int, int]]:
    """Per dimension, the half-open range outside of which a read of ``source`` gives 0: a
    tensor's extent, or a nested scope's padding support."""
    return [(0, d) for d in source.shape] if isinstance(source, Tensor) else list(padding_support(source).values())


def vanishes_outside(body: Scalar, box: Sequence[Iterator], ix: Index, lo: int, hi: int) -> bool:
    """Whether ``body`` is 0 at every point of ``box`` where ``ix`` leaves [lo, hi) (exact, isl).

    This is what makes growing a summation range sound: the added points must add nothing.
    """
    rename = _positional({it.name: None for it in box})
    condition = _support_condition(body, rename)
    if condition is None:
        return False
    dims = ", ".join(rename[it.name] for it in box)
    where = isl_index(ix, rename)
    outside = f"({where} < {lo} or {where} >= {hi})"
    return isl.Set(f"{{ [{dims}] : {isl_box(box, rename)} and {condition} and {outside} }}").is_empty()


def _support_condition(body: Scalar, rename: Mapping[str, str]) -> str | None:
    """Where the body may be non-zero, as an isl condition; None means anywhere.

    An access is non-zero only inside its source (a nested scope: inside its own padding
    support); ``*`` intersects, ``+ - max`` unite, ``neg relu tanh sqrt`` and division by a non-zero
    constant keep the support (f(0) = 0); a zero constant is nowhere, anything else anywhere.
    """
    match body:
        case Access(source, indices):
            parts = [f"{lo} <= {isl_index(ix, rename)} < {hi}" for ix, (lo, hi) in zip(indices, read_bounds(source))]
            return "(" + " and ".join(parts) + ")" if parts else None
        case Num(value):
            return "false" if value == 0 else None
        case Unary("neg" | "relu" | "tanh" | "sqrt", arg):
            return _support_condition(arg, rename)
        case Binary("/", lhs, Num(value)) if value != 0:
            return _support_condition(lhs, rename)
        case Binary("*", lhs, rhs):
            parts = [p for p in (_support_condition(lhs, rename), _support_condition(rhs, rename)) if p is not None]
            return "(" + " and ".join(parts) + ")" if parts else None
        case Binary("+" | "-" | "max", lhs, rhs):
            a, b = _support_condition(lhs, rename), _support_condition(rhs, rename)
            return None if a is None or b is None else f"({a} or {b})"
    return None  # exp, sigmoid, division by an expression: may be non-zero anywhere
