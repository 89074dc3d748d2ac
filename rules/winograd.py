"""Winograd's minimal filtering (Lavin and Gray, 2016): a convolution as a batch of products."""

from functools import lru_cache

import sympy

from rewriter.index import affine_coefficients
from rewriter.ir import Access, Iterator, Scope, Var, constant, index_vars
from rewriter.search.dsl import fresh_name, rule

TILES = (2, 4)  # outputs per tile along each dimension: F(2, r) and F(4, r)
POINTS = (0, 1, -1, 2, -2, sympy.Rational(1, 2), sympy.Rational(-1, 2))  # Cook-Toom points, then infinity
MAX_ALPHA = len(POINTS) + 1  # points per transformed tile (with infinity); more need larger points, less precise


@rule("winograd", section="Lavin and Gray 2016, section 4")
def winograd(scope: Scope):
    """Every stride-1 dimension of a convolution computed by Winograd's F(m, r) at once, one
    variant per tile size m of ``TILES`` (Lavin and Gray 2016, not in OLLIE's table: a summation
    split with a change of basis). Along a dimension h read as X[h + r + o] by W[r]
    (alpha = m + r - 1, tiles t = h / m):

        L h ; S c, r ; X[c, h+r+o] * W[c, r]
          =>  L h ; S k:alpha ; AT[h%m, k] * P[k, h/m]
              P = L k, t ; S c ; U[k, c] * V[k, c, t]
              U = L k, c ; S r ; G[k, r] * W[c, r]          (weights only: evaluated at build)
              V = L k, c, t ; S i:alpha ; BT[k, i] * X[c, m*t+i+o]

    since sum_k AT[u, k] G[k, r] BT[k, i] = [i == u + r]: the r products of each output become
    alpha per tile of m outputs, multiplied out once in P, a batch of matrix products over k.
    The constant matrices come from Cook-Toom interpolation at the points ``POINTS``
    (``rewriter.ir.constant``). Reads past X's edge are zero in both forms, so padding needs
    nothing; P covers whole tiles and the result reads the outputs it keeps. Over several
    dimensions V and the result are transformed one dimension at a time, the last first, as
    Lavin and Gray write them (BT d B, AT m A: a product on each side), each stage a scope of
    its own: alpha multiply-adds per point and dimension, where all at once took alpha**2
    (measured on AMD EPYC, Zen 3, NCHW8c, F(4, 3): the input's transform of 64 channels at
    56x56 1.74 to 0.53 ms, of 128 at 28x28 0.44 to 0.29; the result's 0.52 to 0.34 and
    0.27 to 0.23; F(2, 3) at 14x14 about even). Where the output's channels come in blocks
    (NCHW8c: f = 8*fo + fi), U keeps fo outside c, so each block of P's columns reads one
    contiguous panel of U (measured on AMD EPYC, Zen 3, the product alone: 256 channels at
    14x14, F(2, 3), 2.06 to 0.99 ms; 128 at 28x28, F(4, 3), 1.54 to 1.05).
    """
    if scope.reduce != "sum" or not _two_reads(scope.body):
        return
    for x, w in (scope.body.lhs, scope.body.rhs), (scope.body.rhs, scope.body.lhs):
        dims = _dims(scope, x, w)
        if dims:
            for m in TILES:
                sizes = [(scope.box[h][1], scope.box[r][1]) for h, r, _, _ in dims]
                if all(size >= m and m + taps - 1 <= MAX_ALPHA for size, taps in sizes):
                    yield _transformed(scope, x, w, dims, m)
            return


def _two_reads(body) -> bool:
    return getattr(body, "op", None) == "*" and isinstance(body.lhs, Access) and isinstance(body.rhs, Access)


def _dims(scope: Scope, x: Access, w: Access) -> list[tuple[str, str, int, int]]:
    """``(h, r, position in x, offset)`` of each dimension x reads at h + r + offset and w at r,
    neither iterator read anywhere else, both from 0."""
    traversal = {it.name: it for it in scope.traversal}
    summation = {it.name: it for it in scope.summation}
    dims = []
    for position, ix in enumerate(x.indices):
        form = affine_coefficients(ix)
        if form is None or len(form[0]) != 2 or set(form[0].values()) != {1}:
            continue
        (a, b) = form[0]
        h, r = (a, b) if a in traversal else (b, a)
        if h not in traversal or r not in summation or traversal[h].lo or summation[r].lo:
            continue
        in_w = [ix for ix in w.indices if r in index_vars(ix)]
        elsewhere = [ix for ix in x.indices + w.indices if {h, r} & index_vars(ix)]
        if in_w == [Var(r)] and len(elsewhere) == 2 and summation[r].size > 1:
            dims.append((h, r, position, form[1]))
    return dims


@lru_cache(maxsize=None)
def transforms(m: int, r: int):
    """The constant tensors (AT: m x alpha, G: alpha x r, BT: alpha x alpha) of F(m, r)."""
    alpha = m + r - 1
    points = POINTS[: alpha - 1]
    at = sympy.Matrix(m, alpha, lambda u, k: points[k] ** u if k < alpha - 1 else int(u == m - 1))
    scale = [sympy.prod(a - b for b in points if b != a) for a in points]
    g = sympy.Matrix(alpha, r, lambda k, j: points[k] ** j / scale[k] if k < alpha - 1 else int(j == r - 1))
    # BT's column i solves sum_k AT[u, k] G[k, j] BT[k, i] = [i == u + j] over every (u, j)
    products = sympy.Matrix(m * r, alpha, lambda row, k: at[row // r, k] * g[k, row % r])
    bt = sympy.Matrix.hstack(
        *(
            products.solve_least_squares(sympy.Matrix(m * r, 1, lambda row, _: int(row // r + row % r == i)))
            for i in range(alpha)
        )
    )
    name = f"m{m}_r{r}"
    return (
        constant(f"winograd_AT_{name}", at.tolist()),
        constant(f"winograd_G_{name}", g.tolist()),
        constant(f"winograd_BT_{name}", bt.tolist()),
    )


def _transformed(scope: Scope, x: Access, w: Access, dims, m: int) -> Scope:
    box, taken = scope.box, set(scope.box)
    spatial = {h: (r, position, offset) for h, r, position, offset in dims}
    reduced = {r for _, r, _, _ in dims}
    traversal = [it.name for it in scope.traversal]

    def fresh(base: str, size: int) -> Iterator:
        name = fresh_name(base, taken)
        taken.add(name)
        return Iterator(name, 0, size)

    k = {h: fresh("k", m + box[r][1] - 1) for h, r, _, _ in dims}
    t = {h: fresh("t", -(-box[h][1] // m)) for h in spatial}
    i = {h: fresh("i", k[h].size) for h in spatial}
    mats = {h: transforms(m, box[r][1]) for h, r, _, _ in dims}
    ks = tuple(k.values())

    def iterators(names, tiles: bool) -> tuple[Iterator, ...]:
        """``names`` as iterators, each once, in the scope's order (a tile in place of its h)."""
        names = set(names)
        ordered = [n for n in (*traversal, *(it.name for it in scope.summation)) if n in names]
        return tuple(t[n] if tiles and n in t else Iterator(n, *box[n]) for n in ordered)

    # laid out as a matrix product per point of the tile, V (M x K) times U (K x N): V's rows
    # the traversal X reads (tiles for h), U's columns the traversal only W reads
    x_vars = {v for ix in x.indices for v in index_vars(ix)} - reduced
    w_vars = {v for ix in w.indices for v in index_vars(ix)} - reduced
    rows = iterators([n for n in traversal if n in x_vars], tiles=True)
    cols = iterators([n for n in traversal if n in w_vars - x_vars], tiles=False)
    shared = iterators([n for n in traversal if n in w_vars & x_vars], tiles=False)  # a depthwise channel
    x_sum, w_sum = (iterators(vs - set(traversal), tiles=False) for vs in (x_vars, w_vars))
    # U: the filter in the transformed basis (weights only: evaluated at build time), its
    # columns but the innermost outside the summed ones: where the output's channels come in
    # blocks (NCHW8c's fo, fi), each block of columns reads one contiguous panel of U
    u_body = w
    for h, (r, _, _) in spatial.items():
        u_body = mats[h][1][k[h].var, Var(r)] * u_body
    u_order = ks + shared + cols[:-1] + w_sum + cols[-1:]
    u = Scope(u_order, iterators(reduced, tiles=False), u_body)
    # V: the input's tiles in the transformed basis, one dimension at a time, the last first:
    # BT d B, a product on each side (alpha multiply-adds per point and dimension, not
    # alpha**dims per point); each stage keeps the tile's points i of the dimensions before
    x_indices = list(x.indices)
    for h, (_, position, offset) in spatial.items():
        x_indices[position] = m * t[h].var + i[h].var + offset
    names = list(spatial)
    v = Access(x.source, tuple(x_indices))
    for j in reversed(range(len(names))):
        points = tuple(i[d] if n < j else k[d] for n, d in enumerate(names))
        h = names[j]
        stage = Scope(points + rows + x_sum, (i[h],), mats[h][2][k[h].var, i[h].var] * v)
        v = stage[_vars(points + rows + x_sum)]
    # P: a batch of matrix products over the tile's points
    p_sum = tuple(it for it in scope.summation if it.name not in reduced)
    p = Scope(ks + rows + cols, p_sum, v * u[_vars(u_order)])
    # the result: each output gathers its tile's alpha products, one dimension at a time, the
    # last first; each stage keeps the points k and the tiles t of the dimensions before
    gathered, order = p, ks + rows + cols
    for j in reversed(range(len(names))):
        h = names[j]
        read = gathered[tuple(Var(h) // m if it is t[h] else it.var for it in order)]
        order = tuple(k[d] for d in names[:j]) + tuple(
            t[it.name] if it.name in names[:j] else it for it in scope.traversal
        )
        gathered = Scope(order, (k[h],), mats[h][0][Var(h) % m, k[h].var] * read)
    return gathered


def _vars(iterators) -> tuple:
    return tuple(it.var for it in iterators)
