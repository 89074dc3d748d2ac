"""Boundary relaxing and tightening (OLLIE section 4.2, Table 1)."""

from rewriter.index import (
    affine_coefficients,
    affine_index,
    index_bounds,
    padding_support,
    read_bounds,
    vanishes_outside,
)
from rewriter.ir import Iterator, Scope, Var, accesses, box, nested_reads, replace_subterm, substitute
from rewriter.search.dsl import fresh_name, rule


def _with_box(scope: Scope, box: dict) -> Scope:
    traversal = tuple(Iterator(it.name, *box[it.name]) for it in scope.traversal)
    return scope.with_traversal(traversal)


def _rebuild(scope: Scope, access, inner: Scope) -> Scope:
    body = replace_subterm(scope.body, access, inner[access.indices])
    return scope.with_body(body)


@rule("boundary tightening", section="4.2")
def tighten_boundary(scope: Scope):
    """Shrink a nested scope's ranges to where it can be non-zero (OLLIE 4.2, E5 -> E6):

        { L t:a..b ; f }[i]   =>   { L t:a'..b' ; f }[i]

    where [a', b') is the smallest range outside of which f reads only padding (islpy computes
    the support). Reads of the dropped points gave 0 before and give 0 after.
    """
    for access in nested_reads(scope.body):
        inner = access.source
        support = padding_support(inner)
        if support != box(inner.traversal) and all(hi > lo for lo, hi in support.values()):
            yield _rebuild(scope, access, _with_box(inner, support))


RELAX_GROWTH = 2


@rule("boundary relaxing", section="4.2")
def relax_boundary(scope: Scope):
    """Grow a nested scope's ranges to cover every point the outer scope reads (OLLIE 4.2):

        { L t:a..b ; f }[i]   =>   { L t:a'..b' ; f }[i]    with [a', b') the hull of [a, b) and i

    Sound only where f is 0 on the added points (they read only padding): then the reads that
    used to fall outside the box and give 0 still give 0. Once every read is inside the box,
    traversal merging can inline the scope. Relaxing adds a halo (a convolution's padding), not
    a far region: a range may grow to at most ``RELAX_GROWTH`` times its size plus 2, so a read
    a million points out of range (all padding) does not make a scope of a million points.
    """
    outer = scope.box
    for access in nested_reads(scope.body):
        inner = access.source
        ranges = box(inner.traversal)
        grown = dict(ranges)
        for it, ix in zip(inner.traversal, access.indices):
            lo, hi = index_bounds(ix, outer)
            grown[it.name] = (min(it.lo, lo), max(it.hi, hi + 1))
        too_far = any(grown[it.name][1] - grown[it.name][0] > RELAX_GROWTH * it.size + 2 for it in inner.traversal)
        if grown == ranges or too_far:
            continue
        relaxed = _with_box(inner, grown)
        support = padding_support(relaxed)
        if all(ranges[n][0] <= lo and hi <= ranges[n][1] for n, (lo, hi) in support.items()):
            yield _rebuild(scope, access, relaxed)


@rule("summation boundary tightening", section="4.2")
def tighten_summation(scope: Scope):
    """Sum only over the offsets that can be non-zero at each point (OLLIE 4.2, boundary
    tightening, with ranges that depend on the traversal iterators):

        L h ; S x:X ; f(x) * K[e(h) - k*x]   =>   L h ; S x':ceil(R/k) ; f(e(h)/k - x') * K[e(h)%k + k*x']

    where K's dimension has size R (K a tensor, or a nested scope non-zero on R points of it:
    the OffsetAdd that sums a Matmul's shifted tiles). A transposed convolution written naively
    sums over every input position x although only about R/k of them meet the kernel at each h. islpy checks
    both directions: the body is 0 wherever x' leaves [0, ceil(R/k)), and wherever the new x
    leaves x's old range. Sums only. One result per tightenable iterator, and one for all.
    """
    if scope.reduce != "sum":
        return
    plans = [plan for it in scope.summation if (plan := _offset_plan(scope, it)) is not None]
    for chosen in [[plan] for plan in plans] + ([plans] if len(plans) > 1 else []):
        tightened = _tightened(scope, chosen)
        if tightened is not None:
            yield tightened


def _offset_plan(scope: Scope, it: Iterator):
    """(x, x', x as an index of x' and the traversal, x' as an index of the old iterators, size)."""
    traversal = {t.name for t in scope.traversal}
    taken = {i.name for i in scope.iterators}
    for access in accesses(scope.body):
        for ix, (lo, hi) in zip(access.indices, read_bounds(access.source)):
            form = affine_coefficients(ix)
            if form is None or form[0].get(it.name, 0) == 0:
                continue
            coefficients, constant = form
            size, constant = hi - lo, constant - lo  # the read as an index into [0, size)
            if size <= 0:
                continue  # reads only zeros: nothing to sum over
            c, rest = coefficients[it.name], {v: k for v, k in coefficients.items() if v != it.name}
            if not rest or not set(rest) <= traversal:
                continue
            k = abs(c)
            extent = -(-size // k)
            if extent >= it.size:
                continue
            # c < 0: x lies in [ceil((rest-R+1)/k), floor(rest/k)]; c > 0: in [.., floor((R-1-rest)/k)]
            top = (
                affine_index(rest, constant)
                if c < 0
                else affine_index({v: -w for v, w in rest.items()}, size - 1 - constant)
            )
            inner = fresh_name(f"{it.name}o", taken)
            x_of_new = top // k - Var(inner)
            new_of_old = top // k - it.var
            return it, Iterator(inner, 0, extent), x_of_new, new_of_old
    return None


def _tightened(scope: Scope, plans) -> Scope | None:
    mapping = {it.name: x_of_new for it, _, x_of_new, _ in plans}
    summation = tuple(next((new for it2, new, _, _ in plans if it2 is it), it) for it in scope.summation)
    body = substitute(scope.body, mapping)
    new_box = scope.traversal + summation
    old_box = scope.iterators
    if all(vanishes_outside(scope.body, old_box, new_of_old, 0, new.size) for _, new, _, new_of_old in plans) and all(
        vanishes_outside(body, new_box, x_of_new, it.lo, it.hi) for it, _, x_of_new, _ in plans
    ):
        return Scope(scope.traversal, summation, body, scope.reduce)
    return None
