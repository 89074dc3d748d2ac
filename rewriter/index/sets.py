"""Integer-set queries on index expressions (islpy, and exact interval arithmetic where it suffices).

``is_injective``, ``is_bijective``, ``image_box`` and ``inverse`` of a tuple of indices over a box
(the iterator map behind variable substitution), ``equal_on`` (two indices agree on a box),
``padding_support(scope)`` (the box outside of which a scope reads only padding),
``reads_outside`` (whether reads reach their bounds from a grown box outside an inner one),
``vanishes_outside`` (a body is 0 wherever an index leaves a range), and the isl string helpers
``isl_index`` / ``isl_box`` / ``isl_name``. Iterators are renamed positionally in isl text, so any
iterator name is safe. The support questions are answered without isl where the reads are
separable (``_conjunction_ranges``): isl's parser alone costs about 40 us per constraint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from functools import lru_cache

import islpy as isl

from rewriter.ir import (
    Access,
    Binary,
    ExpressionError,
    Index,
    Iterator,
    Num,
    Scalar,
    Scope,
    Tensor,
    Unary,
    as_index,
    box,
    index_vars,
)

from .algebra import (
    Div,
    LinearForm,
    Ranges,
    as_ranges,
    divide_form,
    form_bounds,
    index_bounds,
    modulo_form,
    normalize,
    simplify_form,
    to_index,
)

# --------------------------------------------------------------------------------------------
# isl syntax

# Words isl's parser reserves; an iterator with one of these names is renamed in isl text.
ISL_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "not",
        "implies",
        "exists",
        "mod",
        "floor",
        "ceil",
        "floord",
        "ceild",
        "min",
        "max",
        "rat",
        "true",
        "false",
        "infty",
        "NaN",
        "cst",
    }
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
    box = as_ranges(iterators)
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
    box = as_ranges(ranges)
    indices = [as_index(ix) for ix in indices]
    _check_covered(indices, box)
    rename = _positional(box)
    outs = ", ".join(_isl_form(normalize(ix), rename) for ix in indices)
    return isl.Map(f"{{ [{', '.join(rename.values())}] -> [{outs}] : {isl_box(box, rename)} }}")


def is_injective(indices: Sequence[Index], ranges: Ranges | Iterable[Iterator]) -> bool:
    """Whether distinct points of the box give distinct index tuples (every box iterator counts)."""
    return index_map(indices, ranges).is_injective()


def image_box(
    indices: Sequence[Index], ranges: Ranges | Iterable[Iterator]
) -> tuple[tuple[tuple[int, int], ...], bool]:
    """``(((lo, hi) per index, half-open), exact)``: the bounding box of the image of the box and
    whether the image is exactly that box."""
    image = index_map(indices, ranges).range()
    bounds = tuple(
        (image.dim_min_val(k).to_python(), image.dim_max_val(k).to_python() + 1)
        for k in range(image.dim(isl.dim_type.set))
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
    box = as_ranges(ranges)
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
    box = as_ranges(ranges)
    new_names = [str(n) for n in new_names]
    if len(new_names) != len(indices) or len(set(new_names)) != len(new_names):
        raise ExpressionError(
            f"inverse needs one distinct new name per index, got {new_names} for {len(indices)} index(es)"
        )
    m = index_map(indices, box)
    if not m.is_injective():
        raise ExpressionError(
            f"indices ({', '.join(map(str, indices))}) are not injective on the box {isl_box(box)}: no inverse"
        )
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


def _mixed_radix_inverse(
    forms: Sequence[LinearForm], box: Mapping, new_names: Sequence[str]
) -> list[LinearForm] | None:
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
            offset = LinearForm.atom(new).plus(form_bounds(form, box)[0], -1)  # in [0, place)
            for position, (weight, a, c) in enumerate(digits):
                digit = divide_form(offset, weight)
                if position < len(digits) - 1:
                    digit = modulo_form(digit, box[a][1] - box[a][0])
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


def _rational_parts(
    aff: isl.Aff, names: Sequence[str], divs: Sequence[LinearForm]
) -> list[tuple[Fraction, LinearForm]]:
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
    return divide_form(total, denominator)


# --------------------------------------------------------------------------------------------
# Padding support (islpy, and exact interval arithmetic where the reads are separable)


def padding_support(scope: Scope) -> dict[str, tuple[int, int]]:
    """Per traversal iterator, the smallest half-open range outside of which the scope is 0.

    The set of (traversal, summation) points where the body may be non-zero for some input (see
    ``_support_condition``) has its summation iterators projected out and the rest boxed. Where
    the reads are separable (affine, each naming at most one iterator that other reads name too:
    ``_conjunction_ranges``) the box follows exactly from interval arithmetic; otherwise isl
    computes it. A scope that is 0 everywhere gets empty ranges ``(lo, lo)``.
    """
    return dict(_padding_support(scope))


@lru_cache(maxsize=1 << 14)
def _padding_support(scope: Scope) -> tuple:
    traversal = box(scope.traversal)
    condition = _support_condition(scope.body, scope.box)
    if condition is None:  # non-zero anywhere in its box: no isl needed
        return tuple(traversal.items())
    hull = _separable_hull(condition, traversal, scope.box)
    if hull is not None:
        return tuple((name, hull.get(name, (lo, lo))) for name, (lo, _) in traversal.items())
    return _isl_support(scope, condition)


def _isl_support(scope: Scope, condition) -> tuple:
    traversal = box(scope.traversal)
    rename = _positional({it.name: None for it in scope.iterators})
    where = _isl_condition(condition, rename)
    dims = ", ".join(rename[it.name] for it in scope.traversal)
    summed = ", ".join(rename[it.name] for it in scope.summation)
    exists = f"exists ({summed} : {isl_box(scope.summation, rename)} and {where})" if summed else where
    support = isl.Set(f"{{ [{dims}] : {isl_box(scope.traversal, rename)} and {exists} }}")
    if support.is_empty():
        return tuple((name, (lo, lo)) for name, (lo, _) in traversal.items())
    return tuple(
        (it.name, (support.dim_min_val(k).to_python(), support.dim_max_val(k).to_python() + 1))
        for k, it in enumerate(scope.traversal)
    )


def reads_outside(
    indices: Sequence[Index], bounds, inner: Sequence[Iterator], grown: Sequence[Iterator]
) -> bool | None:
    """Whether some point of the box ``grown`` outside the box ``inner`` (the same iterators)
    reads inside ``bounds`` (a half-open range per index) with every index: exactly, by interval
    arithmetic on each slab of ``grown`` outside ``inner``; None when the reads are not separable
    there (``_conjunction_ranges``)."""
    reads = [(ix, lo, hi) for ix, (lo, hi) in zip(indices, bounds)]
    answer = False
    for it, out in zip(inner, grown):
        for lo, hi in ((out.lo, it.lo), (it.hi, out.hi)):
            if lo >= hi:
                continue
            slab = {g.name: (g.lo, g.hi) for g in grown}
            slab[it.name] = (lo, hi)
            ranges = _conjunction_ranges(reads, slab, slab)
            if ranges is None:
                return None
            answer = answer or bool(ranges)
    return answer


def read_bounds(source: Tensor | Scope) -> list[tuple[int, int]]:
    """Per dimension, the half-open range outside of which a read of ``source`` gives 0: a
    tensor's extent, or a nested scope's padding support."""
    return [(0, d) for d in source.shape] if isinstance(source, Tensor) else list(padding_support(source).values())


def vanishes_outside(body: Scalar, box: Sequence[Iterator], ix: Index, lo: int, hi: int) -> bool:
    """Whether ``body`` is 0 at every point of ``box`` where ``ix`` leaves [lo, hi) (exact, isl).

    This is what makes growing a summation range sound: the added points must add nothing.
    """
    condition = _support_condition(body, {it.name: (it.lo, it.hi) for it in box})
    if condition is None:
        return False
    rename = _positional({it.name: None for it in box})
    dims = ", ".join(rename[it.name] for it in box)
    where = isl_index(ix, rename)
    outside = f"({where} < {lo} or {where} >= {hi})"
    inside = _isl_condition(condition, rename)
    return isl.Set(f"{{ [{dims}] : {isl_box(box, rename)} and {inside} and {outside} }}").is_empty()


def _stays_within(ix: Index, lo: int, hi: int, box: Mapping[str, tuple[int, int]]) -> bool:
    """Whether ``ix`` lies in [lo, hi) on the whole (non-empty) box; False when unsure."""
    if any(b_lo >= b_hi for b_lo, b_hi in box.values()) or not index_vars(ix) <= box.keys():
        return False
    reach_lo, reach_hi = index_bounds(ix, box)
    return lo <= reach_lo and reach_hi < hi


# A support condition: None (anywhere), _NOWHERE, ("read", ((ix, lo, hi), ...)) (every index in
# its range), ("and", a, b) or ("or", a, b).
_NOWHERE = ("false",)


def _support_condition(body: Scalar, box: Mapping[str, tuple[int, int]]):
    """Where the body may be non-zero in ``box`` (iterator ranges), as a condition tree; None
    means anywhere. A read whose index stays inside its source's bounds on the whole box adds no
    constraint (isl's parser costs about 40 us per constraint, and most reads are such).

    An access is non-zero only inside its source (a nested scope: inside its own padding
    support); ``*`` and ``select`` intersect, ``+ - max min less greater`` unite, ``neg relu
    tanh sin sqrt erf abs floor ceil``, a positive constant power and division by a non-zero
    constant keep the support (f(0) = 0); a zero constant is nowhere, anything else anywhere.
    """
    match body:
        case Access(source, indices):
            reads = tuple(
                (ix, lo, hi) for ix, (lo, hi) in zip(indices, read_bounds(source)) if not _stays_within(ix, lo, hi, box)
            )
            return ("read", reads) if reads else None
        case Num(value):
            return _NOWHERE if value == 0 else None
        case Unary("neg" | "relu" | "tanh" | "sin" | "sqrt" | "erf" | "abs" | "floor" | "ceil", arg):
            return _support_condition(arg, box)
        case Binary("pow", lhs, Num(value)) if value > 0:
            return _support_condition(lhs, box)
        case Binary("/", lhs, Num(value)) if value != 0:
            return _support_condition(lhs, box)
        case Binary("*" | "select", lhs, rhs):
            a, b = _support_condition(lhs, box), _support_condition(rhs, box)
            return a if b is None else b if a is None else ("and", a, b)
        case Binary("+" | "-" | "max" | "min" | "less" | "greater", lhs, rhs):  # f(0, 0) = 0
            a, b = _support_condition(lhs, box), _support_condition(rhs, box)
            return None if a is None or b is None else ("or", a, b)
    return None  # exp, sigmoid, division by an expression: may be non-zero anywhere


def _isl_condition(condition, rename: Mapping[str, str]) -> str:
    """A support condition in isl's syntax, iterators renamed by ``rename``."""
    match condition:
        case ("false",):
            return "false"
        case ("read", reads):
            return "(" + " and ".join(f"{lo} <= {isl_index(ix, rename)} < {hi}" for ix, lo, hi in reads) + ")"
        case (op, a, b):
            return f"({_isl_condition(a, rename)} {op} {_isl_condition(b, rename)})"
    raise TypeError(condition)


def _disjuncts(condition, limit: int = 16) -> list[tuple] | None:
    """The condition as an "or" of conjunctions of reads ``(ix, lo, hi)``; None past ``limit``."""
    match condition:
        case ("false",):
            return []
        case ("read", reads):
            return [reads]
        case ("or", a, b):
            left, right = _disjuncts(a, limit), _disjuncts(b, limit)
            if left is None or right is None or len(left) + len(right) > limit:
                return None
            return left + right
        case ("and", a, b):
            left, right = _disjuncts(a, limit), _disjuncts(b, limit)
            if left is None or right is None or len(left) * len(right) > limit:
                return None
            return [x + y for x in left for y in right]
    raise TypeError(condition)


def _separable_hull(condition, traversal: Mapping, box: Mapping) -> dict | None:
    """The bounding box of the traversal points where ``condition`` holds for some summation
    point, exactly, or None when the reads couple iterators (then isl decides). A traversal
    iterator missing from the answer means no point holds."""
    disjuncts = _disjuncts(condition)
    if disjuncts is None:
        return None
    hull: dict[str, tuple[int, int]] = {}
    for conjunction in disjuncts:
        ranges = _conjunction_ranges(conjunction, traversal, box)
        if ranges is None:
            return None
        for name, (lo, hi) in ranges.items():
            old = hull.get(name, (lo, hi))
            hull[name] = (min(lo, old[0]), max(hi, old[1]))
    return hull


def _conjunction_ranges(reads, traversal: Mapping, box: Mapping) -> dict | None:
    """Half-open ranges of the traversal iterators where every read ``lo <= ix < hi`` holds for
    some values of the summation iterators; {} when none does; None when it is not separable.

    For an iterator x of a read ``lo <= a*x + s + c < hi``, where the values of the rest s in
    [m, M] leave no gap wider than ``hi - lo`` (``_span``), some rest satisfies the read exactly
    when ``lo - c - M <= a*x <= hi - 1 - c - m``: an interval of x. Separable: every index is affine
    and names at most one iterator that other reads name too (``h`` in ``A[h+r-1] * B[h]``), so
    the reads hang off their shared iterators without cycles. Then each shared iterator's range
    is the intersection of its reads' intervals (their other iterators are their own), and each
    other iterator's range is its interval with the shared one kept to that range: exact.
    """
    forms = [(normalize(ix), lo, hi) for ix, lo, hi in reads]
    if not all(form.is_affine for form, _, _ in forms):
        return None
    uses: dict[str, int] = {}
    for form, _, _ in forms:
        for name, _ in form.terms:
            uses[name] = uses.get(name, 0) + 1
    if any(sum(uses[name] > 1 for name, _ in form.terms) > 1 for form, _, _ in forms):
        return None
    ranges = {name: [lo, hi - 1] for name, (lo, hi) in box.items() if name in uses or name in traversal}
    own_box = {name: tuple(box[name]) for name in uses}
    shared_first = [(form, lo, hi, name) for form, lo, hi in forms for name, _ in form.terms if uses[name] > 1]
    own = [(form, lo, hi, name) for form, lo, hi in forms for name, _ in form.terms if uses[name] == 1]
    constant = [(form, lo, hi, None) for form, lo, hi in forms if form.is_constant]
    for pass_ in (shared_first, own + constant):
        spans = own_box if pass_ is shared_first else {n: (r[0], r[1] + 1) for n, r in ranges.items()}
        for form, lo, hi, target in pass_:
            span = _span([(n, c) for n, c in form.terms if n != target], spans)
            if span[2] > hi - lo:  # a window of the read's range might fall between two values
                return None
            low, high = lo - form.constant - span[1], hi - 1 - form.constant - span[0]  # a*x lies here
            if target is None:
                if not low <= 0 <= high:
                    return {}
                continue
            a, bound = form.coefficient(target), ranges[target]
            if a > 0:
                bound[0], bound[1] = max(bound[0], -(-low // a)), min(bound[1], high // a)
            else:
                bound[0], bound[1] = max(bound[0], -(-high // a)), min(bound[1], low // a)
            if bound[0] > bound[1]:
                return {}
    return {name: (ranges[name][0], ranges[name][1] + 1) for name in traversal}


def _span(terms, box: Mapping) -> tuple[int, int, int]:
    """``(min, max, gap)`` of ``sum(c * y)`` over the box: no two consecutive values it takes
    differ by more than ``gap`` (1: every integer in between). Built in increasing coefficient
    size: copies of the set so far, shifted by |c|, leave a gap of |c| - reach at most."""
    low = high = reach = 0
    gap = 1
    for name, c in sorted(terms, key=lambda t: abs(t[1])):
        lo, hi = box[name]
        low, high = low + min(c * lo, c * (hi - 1)), high + max(c * lo, c * (hi - 1))
        if hi - lo > 1:
            gap = max(gap, abs(c) - reach)
            reach += abs(c) * (hi - lo - 1)
    return low, high, gap
