"""Data-layout transformation of a tensor (OLLIE sections 4.2 and 5.2, Equations (3)-(4))."""

from rewriter.dsl import rule
from rewriter.indexing import index_bounds
from rewriter.ir import Iterator, Scope, Tensor, Var, accesses, replace_subterm


def _relaid(scope: Scope, access, new_source: Scope, new_indices) -> Scope:
    body = replace_subterm(scope.body, access, new_source[tuple(new_indices)])
    return Scope(scope.traversal, scope.summation, body, scope.reduce)


@rule("layout transformation", section="4.2, 5.2", kind="guided")
def transform_layout(scope: Scope):
    """Read an input tensor through a scope that re-lays it out (OLLIE 5.2, Equations (3)-(4)):

        T[i, j]  =>  { L b:J, a:I ; T[a, b] }[j, i]                     (permute two dimensions)
        T[i, j]  =>  { L m:I*J ; T[m/J, m%J] }[J*i + j]     when 0 <= j < J   (merge two)

    A merge needs the inner index inside its dimension: otherwise a read that was padding
    could land on a neighbouring row. Guided: operator matching asks for the layout it needs
    (e.g. A'[m, k] = A[t1*W + t2, c]), instead of every permutation being tried everywhere.
    """
    box = {it.name: (it.lo, it.hi) for it in scope.iterators}
    for access in accesses(scope.body):
        tensor = access.source
        if not isinstance(tensor, Tensor) or tensor.rank < 2:
            continue
        dims = [Iterator(f"d{k}", 0, size) for k, size in enumerate(tensor.shape)]
        for a in range(tensor.rank):
            for b in range(a + 1, tensor.rank):
                order = list(range(tensor.rank))
                order[a], order[b] = order[b], order[a]
                permuted = Scope(tuple(dims[k] for k in order), (), tensor[tuple(d.var for d in dims)])
                yield _relaid(scope, access, permuted, [access.indices[k] for k in order])
        for a in range(tensor.rank - 1):
            inner = tensor.shape[a + 1]
            lo, hi = index_bounds(access.indices[a + 1], box)
            if lo < 0 or hi >= inner:
                continue
            m = Iterator("m", 0, tensor.shape[a] * inner)
            merged_dims = dims[:a] + [m] + dims[a + 2 :]
            reads = [d.var for d in dims[:a]] + [Var("m") // inner, Var("m") % inner] + [d.var for d in dims[a + 2 :]]
            merged = Scope(tuple(merged_dims), (), tensor[tuple(reads)])
            index = inner * access.indices[a] + access.indices[a + 1]
            yield _relaid(scope, access, merged, list(access.indices[:a]) + [index] + list(access.indices[a + 2 :]))
