"""Concatenation merging (OLLIE section 4.1, expression merging of n expressions that differ by a
constant offset; Figure 5)."""

from rewriter.index import affine_coefficients, index_bounds, simplify
from rewriter.ir import Access, Binary, Iterator, Lit, Scope, Tensor, Var
from rewriter.search.dsl import rule


@rule("concatenation merging", section="4.1", kind="eager")
def merge_concatenation(scope: Scope):
    """Merge a sum of n reads of one source, each landing on a single slice of it, into one read
    (OLLIE 4.1, expression merging of n expressions that differ by a constant offset):

        L x ; sum_j X[.., e-j, .. f_k + j*s_k ..]   =>   L x ; { L z ; X[.., lo, .. z_k + s_k*(z_p-lo) ..] }[.., e, .. f_k ..]

    where X spans one point ``lo`` along axis p. Read j is non-zero only where e-j = lo (it is
    0 outside X), so at each point at most one read counts, the one with j = e-lo; the nested
    scope (z_p over lo..lo+n, the other axes wide enough for every read) picks it. This is the
    Slice + Concat form of an unfold (a band of shifted rows): merged, it is one affine read
    that operator matching can see, instead of n copies.

    Every term of the sum must read the same source: a sum with other terms is left alone, so
    the rule fires once, after traversal merging has inlined every slice.
    """
    terms = _summands(scope.body)
    if len(terms) < 2 or not all(isinstance(t, Access) and t.source == terms[0].source for t in terms):
        return
    source = terms[0].source
    box = _source_box(source)
    for p, (lo, hi) in enumerate(box):
        if hi - lo != 1:
            continue
        offsets = [_constant_offsets(terms[0].indices, t.indices) for t in terms]
        if any(o is None for o in offsets):
            continue
        order = sorted(range(len(terms)), key=lambda j: -offsets[j][p])
        first = offsets[order[0]]
        shifted = [[o - b for o, b in zip(offsets[j], first)] for j in order]  # relative to the first
        if any(row[p] != -j for j, row in enumerate(shifted)):
            continue  # the slices read are not consecutive
        steps = [shifted[1][k] for k in range(len(box))]
        if any(row[k] != j * steps[k] for j, row in enumerate(shifted) for k in range(len(box)) if k != p):
            continue  # another index does not move by a constant step
        base = terms[order[0]].indices
        ranges = scope.box
        axes = []
        for k, (klo, khi) in enumerate(box):
            if k == p:
                axes.append(Iterator(f"z{k}", lo, lo + len(terms)))
            else:
                rlo, rhi = index_bounds(base[k], ranges)
                axes.append(Iterator(f"z{k}", min(klo, rlo), max(khi, rhi + 1)))
        zp = Var(f"z{p}")
        reads = tuple(Lit(lo) if k == p else simplify(Var(f"z{k}") + steps[k] * (zp - lo)) for k in range(len(box)))
        merged = Scope(tuple(axes), (), Access(source, reads))
        yield scope.with_body(Access(merged, tuple(base)))
        return


def _summands(body) -> list:
    if isinstance(body, Binary) and body.op == "+":
        return _summands(body.lhs) + _summands(body.rhs)
    return [body]


def _source_box(source) -> list[tuple[int, int]]:
    if isinstance(source, Tensor):
        return [(0, size) for size in source.shape]
    return [(it.lo, it.hi) for it in source.traversal]


def _constant_offsets(base, indices) -> list[int] | None:
    """``indices[k] - base[k]`` for every k when each is a constant, else None."""
    offsets = []
    for a, b in zip(base, indices):
        diff = affine_coefficients(simplify(b - a))
        if diff is None or diff[0]:
            return None
        offsets.append(diff[1])
    return offsets
