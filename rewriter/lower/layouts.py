"""Layout eOperators for operands (OLLIE 4.3.1, Equations (3)-(4)): where a product matches no
operator as its operands lie, or only as many small GEMMs, instantiation reads the operands
through layout scopes that split, merge or reorder their dimensions, and matches again.

``split_layouts`` splits a dimension read as ``d*e1 + e2`` and merges two read as ``e/c`` and
``e%c``; ``operand_layouts`` orders an operand's dimensions as one larger Matmul wants.
"""

from __future__ import annotations

from functools import lru_cache

from rewriter.index import affine_coefficients, affine_index, index_bounds
from rewriter.ir import Access, Binary, IndexOp, Iterator, Scalar, Scope, Tensor, Var, constant_value, map_accesses


@lru_cache(maxsize=1 << 14)
def split_layouts(scope: Scope) -> Scope | None:
    """``scope`` reading each tensor whose indices look like ``d*e1 + e2`` (0 <= e2 < d) through a
    layout scope that splits that dimension in two, ``X'[.., e2, e1, ..]``, and each tensor read
    as ``X[.., e/c, .., e%c, ..]`` through one that merges the two dimensions, ``X'[.., e, ..]``;
    None if no read needs either.

    A split is how a dilated band or convolution becomes a plain one after a split
    ``i = d*p + q``: ``Y[i + d*w]`` reads ``Y'[q, p + w]``, and q joins the batch; with no
    ``e2`` (a strided read, ``X[2*h]``), the copy keeps every d-th element, ``X'[0, h]``, so
    that h merges with its neighbours (a 1x1 convolution of stride 2, one GEMM). A merge is
    how a summation over heads and head dimensions, ``T[k/64, i, k%64]`` (attention's output
    projection), becomes one summation iterator k that a Matmul can take.
    """
    box = scope.box
    changed = False

    def relaid(access: Access) -> Scalar:
        nonlocal changed
        if not isinstance(access.source, Tensor):
            return access
        merges = _dimension_merges(access.indices)
        splits = [
            None if k in merges or k in merges.values() else _dimension_split(ix, box, size)
            for k, (ix, size) in enumerate(zip(access.indices, access.source.shape))
        ]
        if not any(splits) and not merges:
            return access
        changed = True
        return _layout_read(access, splits, merges)

    body = map_accesses(scope.body, relaid)
    return scope.with_body(body) if changed else None


@lru_cache(maxsize=1 << 12)
def operand_layouts(scope: Scope) -> Scope | None:
    """``scope`` (a summed product of two tensor reads) reading each operand indexed by distinct
    plain iterators through a layout scope in the order traversal iterators (output order),
    then summation iterators: ``A[n, c, x, y]`` under ``L x, y, n, f ; S c`` becomes
    ``{ L x, y, n, c ; A[n, c, x, y] }[x, y, n, c]``, where (x, y, n) is one GEMM dimension.
    None if no operand changes."""
    body = scope.body
    if not (isinstance(body, Binary) and body.op == "*" and scope.summation):
        return None
    order = [it.name for it in scope.traversal + scope.summation]
    sizes = {it.name: it for it in scope.iterators}
    changed = False

    def relaid(access: Access) -> Scalar:
        nonlocal changed
        names = [ix.name for ix in access.indices if isinstance(ix, Var)]
        if not isinstance(access.source, Tensor) or len(set(names)) != len(access.indices):
            return access
        wanted = sorted(names, key=order.index)
        if wanted == names or any(sizes[n].lo != 0 or sizes[n].hi != d for n, d in zip(names, access.source.shape)):
            return access  # in order already, or not a whole-tensor permutation
        changed = True
        layout = Scope(tuple(Iterator(n, 0, sizes[n].hi) for n in wanted), (), access)
        return layout[tuple(Var(n) for n in wanted)]

    relaid_body = map_accesses(body, relaid)
    return scope.with_body(relaid_body) if changed else None


def _dimension_merges(indices) -> dict[int, int]:
    """{a: b} for each pair of positions read as ``e/c`` (at a) and ``e%c`` (at b), same e and c."""
    quotients = {(ix.lhs, ix.rhs): k for k, ix in enumerate(indices) if isinstance(ix, IndexOp) and ix.op == "/"}
    return {
        quotients[(ix.lhs, ix.rhs)]: k
        for k, ix in enumerate(indices)
        if isinstance(ix, IndexOp) and ix.op == "%" and (ix.lhs, ix.rhs) in quotients
    }


def _dimension_split(ix, box: dict, size: int):
    """(d, e1, e2, e2's range, e1's range within the dimension) for ``ix = d*e1 + e2``, or None."""
    form = affine_coefficients(ix)
    if form is None:
        return None
    coefficients, constant = form
    for d in sorted({abs(c) for c in coefficients.values() if abs(c) > 1}, reverse=True):
        outer = {v: c // d for v, c in coefficients.items() if c % d == 0}
        inner = {v: c for v, c in coefficients.items() if c % d}
        if not outer:
            continue
        e1, e2 = affine_index(outer, constant // d), affine_index(inner, constant % d)
        q_lo, q_hi = index_bounds(e2, box)
        if 0 <= q_lo and q_hi < d:
            j_lo, j_hi = index_bounds(e1, box)
            j_lo, j_hi = max(j_lo, 0), min(j_hi, (size - 1 - q_lo) // d)  # beyond: all padding
            if j_lo <= j_hi:
                return d, e1, e2, (q_lo, q_hi + 1), (j_lo, j_hi + 1)
    return None


def _layout_read(access: Access, splits, merges: dict[int, int]) -> Access:
    """The access through a layout scope: a split dimension is read as ``X[.., d*j + q, ..]`` at
    ``[.., e2, e1, ..]``; a merged pair as ``X[.., m/c, .., m%c, ..]`` at ``[.., e, ..]`` (m spans
    the quotient's extent times c; beyond X, both forms read 0)."""
    traversal, reads, indices = [], {}, []
    shape = access.source.shape
    for k, (ix, split, size) in enumerate(zip(access.indices, splits, shape)):
        if k in merges.values():
            continue  # read through the merged dimension at its quotient's position
        if k in merges:
            c = constant_value(ix.rhs)
            traversal.append(Iterator(f"m{k}", 0, size * c))
            reads[k], reads[merges[k]] = Var(f"m{k}") // c, Var(f"m{k}") % c
            indices.append(ix.lhs)
        elif split is None:
            traversal.append(Iterator(f"d{k}", 0, size))
            reads[k] = Var(f"d{k}")
            indices.append(ix)
        else:
            d, e1, e2, q_range, j_range = split
            traversal += [Iterator(f"q{k}", *q_range), Iterator(f"j{k}", *j_range)]
            reads[k] = d * Var(f"j{k}") + Var(f"q{k}")
            indices += [e2, e1]
    layout = Scope(tuple(traversal), (), access.source[tuple(reads[k] for k in range(len(shape)))])
    return layout[tuple(indices)]
