"""Variable substitution (OLLIE section 4.2, Table 1): skew, merge and split iterators."""

from itertools import product

from rewriter.index import affine_coefficients, affine_index, vanishes_outside
from rewriter.ir import Access, Iterator, Scope, Var, accesses, index_vars, map_accesses, substitute
from rewriter.search.dsl import fresh_name, rule, substitute_traversal


@rule("variable substitution", section="4.2", shallow=True)
def substitute_variables(scope: Scope):
    """Replace traversal iterators through a bijection phi (OLLIE 4.2):

        L x ; S s ; f(x)   =>   L x ; { L y ; S s ; f(phi^-1(y)) }[phi(x)]

    The bijections tried are read off the scope's indices, so the branching stays small:
    skewing ``t = a + k*b`` for iterators a, b sharing an index (one at a time, and all of an
    access's indices at once, as Figure 6's ``(r,s,h,w,f) -> (r,s,f,h+r,w+s)``), and splitting
    ``i = k*p + q`` for strides k that appear beside i. Merging is the guided rule below.
    Each phi is checked to be a bijection with islpy before use.

    A strided index ``k*h + r`` (a convolution with stride k) has no pivot of coefficient 1
    whose inverse leaves the other reads alone (``r = t - k*h`` moves h into the weight's
    index). Where h is read only through that index, phi(h, r) = (k*h + r, r) is injective
    but not onto its box, and the inner scope is written on the image instead:

        L h, r ; S s ; f(k*h + r, r)   =>   L h, r ; { L r, t ; S s ; f(t, r) }[r, k*h + r]

    which agrees with the original wherever it is read (t = k*h + r) and computes the points
    between them too: the step from a strided convolution to one GEMM over every input
    position (Figure 3b with stride).
    """
    for new_traversal, forward, inverse in _proposals(scope):
        yield substitute_traversal(scope, new_traversal, forward, inverse)
    yield from _strided_skews(scope)


def _proposals(scope: Scope):
    yield from _skews(scope)
    yield from _splits(scope)


@rule("iterator merging", section="4.2, 5.2", kind="guided")
def merge_iterators(scope: Scope):
    """Variable substitution that fuses adjacent traversal iterators, ``z = B*a + b`` (OLLIE 5.2):

        L a:A, b:B ; f(a, b)   =>   L a:A, b:B ; { L z:A*B ; f(z/B, z%B) }[B*a + b]

    Guided: iterator-group mismatches with an operator ask for it (t1, t2 -> m for a Matmul),
    so explorative search does not try every adjacent pair everywhere.
    """
    for new_traversal, forward, inverse in _merges(scope):
        yield substitute_traversal(scope, new_traversal, forward, inverse)


def _traversal_forms(scope: Scope):
    """(access, affine coefficients restricted to traversal iterators) for each affine index."""
    names = {it.name for it in scope.traversal}
    for access in accesses(scope.body):
        forms = []
        for ix in access.indices:
            form = affine_coefficients(ix)
            if form is not None:
                forms.append({v: c for v, c in form[0].items() if v in names})
        yield access, forms


def _skew(scope: Scope, pivots: dict[str, dict[str, int]]):
    """Substitute each pivot a (coefficient 1) by t = its index's traversal part, a + k*b + ...

    The new iterators go last, as in Figure 6's ``(r,s,h,w,f) -> (r,s,f,h+r,w+s)``.
    """
    taken = {it.name for it in scope.iterators}
    kept, added, forward, inverse = [], [], {}, {}
    for it in scope.traversal:
        coeffs = pivots.get(it.name)
        if coeffs is None:
            kept.append(it)
            forward[it.name] = inverse[it.name] = Var(it.name)
            continue
        t = fresh_name("t", taken)
        taken.add(t)
        lo, hi = _bounds(coeffs, scope)
        added.append(Iterator(t, lo, hi + 1))
        forward[t] = affine_index(coeffs)
        inverse[it.name] = affine_index({t: 1, **{v: -c for v, c in coeffs.items() if v != it.name}})
    return tuple(kept + added), forward, inverse


def _bounds(coeffs: dict[str, int], scope: Scope) -> tuple[int, int]:
    box = {it.name: it for it in scope.traversal}
    lo = sum(min(c * box[v].lo, c * (box[v].hi - 1)) for v, c in coeffs.items())
    hi = sum(max(c * box[v].lo, c * (box[v].hi - 1)) for v, c in coeffs.items())
    return lo, hi


def _skews(scope: Scope):
    """One skew per (pivot, index), and per access all its indices' skews at once."""
    seen = set()

    def once(pivots):
        key = tuple(sorted((p, tuple(sorted(c.items()))) for p, c in pivots.items()))
        if key not in seen:
            seen.add(key)
            yield _skew(scope, pivots)

    for _, forms in _traversal_forms(scope):
        multi = [coeffs for coeffs in forms if len(coeffs) > 1]
        for coeffs in multi:
            for pivot in (v for v, c in coeffs.items() if c == 1):
                yield from once({pivot: coeffs})
        # every choice of one pivot per multi-iterator index, as one substitution
        choices = [[(v, coeffs) for v, c in coeffs.items() if c == 1] for coeffs in multi]
        for combination in product(*choices) if len(multi) > 1 else ():
            pivots = dict(combination)
            # each pivot's index may not mention another pivot, or phi^-1 would be circular
            independent = all(not (set(coeffs) - {p}) & set(pivots) for p, coeffs in combination)
            if len(pivots) == len(combination) and independent:
                yield from once(pivots)


def _strided_skews(scope: Scope):
    """The skews t = k*h + ... of pivots h of coefficient k > 1 read through that one index
    form only: one per index, and all of an access's indices at once."""
    for _, forms in _traversal_forms(scope):
        pivots = {}
        for coeffs in forms:
            for pivot, k in coeffs.items():
                if abs(k) > 1 and len(coeffs) > 1 and _read_only_as(scope, pivot, coeffs):
                    pivots.setdefault(pivot, coeffs)
        for pivot, coeffs in pivots.items():
            yield _strided_skew(scope, {pivot: coeffs})
        if len(pivots) > 1 and all(not (set(c) - {p}) & set(pivots) for p, c in pivots.items()):
            yield _strided_skew(scope, pivots)


def _read_only_as(scope: Scope, pivot: str, coeffs: dict[str, int]) -> bool:
    """Whether every index that mentions ``pivot`` is affine with traversal part ``coeffs``."""
    names = {it.name for it in scope.traversal}
    for access in accesses(scope.body):
        for ix in access.indices:
            if pivot in index_vars(ix):
                form = affine_coefficients(ix)
                if form is None or {v: c for v, c in form[0].items() if v in names} != coeffs:
                    return False
    return True


def _strided_skew(scope: Scope, pivots: dict[str, dict[str, int]]) -> Scope:
    """``L x ; f(phi(x))  =>  L x ; { L y ; f(y) }[phi(x)]``: each pivot's index form becomes
    a new iterator t (last, as in ``_skew``) wherever it is read; phi need not be onto."""
    taken = {it.name for it in scope.iterators}
    names = {it.name for it in scope.traversal}
    added, forward, rewrite = [], {}, {}
    for coeffs in pivots.values():
        t = fresh_name("t", taken)
        taken.add(t)
        lo, hi = _bounds(coeffs, scope)
        added.append(Iterator(t, lo, hi + 1))
        forward[t] = affine_index(coeffs)
        rewrite[tuple(sorted(coeffs.items()))] = t

    def reindex(ix):
        form = affine_coefficients(ix)
        if form is None:
            return ix
        coeffs, constant = form
        t = rewrite.get(tuple(sorted((v, c) for v, c in coeffs.items() if v in names)))
        if t is None:
            return ix
        return affine_index({t: 1, **{v: c for v, c in coeffs.items() if v not in names}}, constant)

    body = map_accesses(scope.body, lambda a: Access(a.source, tuple(map(reindex, a.indices))))
    traversal = tuple(it for it in scope.traversal if it.name not in pivots) + tuple(added)
    forward.update({it.name: Var(it.name) for it in traversal if it.name not in forward})
    inner = Scope(traversal, scope.summation, body, scope.reduce)
    return Scope(scope.traversal, (), inner[tuple(forward[it.name] for it in traversal)])


def _merges(scope: Scope):
    """z = B*(a - lo_a) + (b - lo_b) for adjacent traversal iterators a, b."""
    taken = {it.name for it in scope.iterators}
    traversal = scope.traversal
    for k in range(len(traversal) - 1):
        a, b = traversal[k], traversal[k + 1]
        z = fresh_name("z", taken)
        merged = Iterator(z, 0, a.size * b.size)
        forward = {it.name: Var(it.name) for it in traversal if it not in (a, b)}
        forward[z] = affine_index({a.name: b.size, b.name: 1}, -b.size * a.lo - b.lo)
        inverse = {it.name: Var(it.name) for it in traversal if it not in (a, b)}
        inverse[a.name] = Var(z) // b.size + a.lo
        inverse[b.name] = Var(z) % b.size + b.lo
        yield traversal[:k] + (merged,) + traversal[k + 2 :], forward, inverse


def _splits(scope: Scope):
    """i = k*p + q, 0 <= q < k, for each stride k written beside traversal iterator i in an index."""
    taken = {it.name for it in scope.iterators}
    factors: dict[str, set[int]] = {}
    for access in accesses(scope.body):
        # a stride beside i may belong to a summation iterator: h + 2*r (a dilated kernel)
        for coeffs, _ in filter(None, map(affine_coefficients, access.indices)):
            for v, c in coeffs.items():
                if abs(c) == 1:
                    factors.setdefault(v, set()).update(abs(o) for w, o in coeffs.items() if w != v and abs(o) > 1)
    for k_index, it in enumerate(scope.traversal):
        for k in sorted(factors.get(it.name, ())):
            if it.size <= k:
                continue
            p, q = fresh_name("p", taken), fresh_name("q", taken | {fresh_name("p", taken)})
            new_p = Iterator(p, it.lo // k, (it.hi - 1) // k + 1)
            new_q = Iterator(q, 0, k)
            forward = {o.name: Var(o.name) for o in scope.traversal if o is not it}
            forward[p], forward[q] = Var(it.name) // k, Var(it.name) % k
            inverse = {o.name: Var(o.name) for o in scope.traversal if o is not it}
            inverse[it.name] = k * Var(p) + Var(q)
            yield scope.traversal[:k_index] + (new_p, new_q) + scope.traversal[k_index + 1 :], forward, inverse


@rule("summation iterator splitting", section="4.2")
def split_summation_iterators(scope: Scope):
    """Variable substitution on summation iterators, with boundary relaxing (OLLIE 4.2):

        L x ; S r:R ; f(r)   =>   L x ; S ro:ceil(R/k), ri:k ; f(k*ro + ri)

    The new box may hold up to k-1 points past R; they must add nothing, so the rule applies to
    sums only and islpy checks that f reads padding there (a kernel offset past the kernel's
    edge). The split iterators are kernel offsets, read beside a traversal iterator (``h+r``),
    and all offsets of one size split together: Conv5x5's r, s -> 3*ro + ri, 3*so + si is the
    step toward a Conv3x3 over four shifted kernels (SRCNN in OLLIE's evaluation). Splits that
    make more work than they save are not proposed: a split adds at most a fifth more offsets
    (5 -> 2*3, not 3 -> 2*2, a third more work), and the inner kernel is at least as large as
    the number of its shifted copies (5 -> 2*3, not 5 -> 3*2). Splitting every 3x3 convolution
    multiplied the states of a depth-4 search by 23.
    """
    if scope.reduce != "sum":
        return  # a max over padded zeros is not the max
    by_size: dict[int, list[Iterator]] = {}
    for it in _offsets(scope):
        by_size.setdefault(it.size, []).append(it)
    for size, group in by_size.items():
        for k in range(2, size):
            padded = -size % k  # offsets past the kernel: k * ceil(size / k) - size
            if padded <= 1 and 5 * padded <= size and k >= -(-size // k):
                split = _split_summation(scope, group, k)
                if split is not None:
                    yield split


def _offsets(scope: Scope) -> list[Iterator]:
    """Summation iterators that share an index with a traversal iterator."""
    traversal = {it.name for it in scope.traversal}
    shared = set()
    for access in accesses(scope.body):
        for form in filter(None, map(affine_coefficients, access.indices)):
            if traversal & set(form[0]):
                shared |= set(form[0]) - traversal
    return [it for it in scope.summation if it.name in shared]


def _split_summation(scope: Scope, group: list[Iterator], k: int) -> Scope | None:
    taken = {it.name for it in scope.iterators}
    summation, mapping, checks = [], {}, []
    for it in scope.summation:
        if it not in group:
            summation.append(it)
            continue
        outer, inner = fresh_name(f"{it.name}o", taken), fresh_name(f"{it.name}i", taken)
        taken |= {outer, inner}
        summation += [Iterator(outer, 0, -(-it.size // k)), Iterator(inner, 0, k)]
        mapping[it.name] = k * Var(outer) + Var(inner) + it.lo if it.lo else k * Var(outer) + Var(inner)
        checks.append((mapping[it.name], it.lo, it.hi))
    body = substitute(scope.body, mapping)
    box = scope.traversal + tuple(summation)
    if all(vanishes_outside(body, box, ix, lo, hi) for ix, lo, hi in checks):
        return Scope(scope.traversal, tuple(summation), body, scope.reduce)
    return None
