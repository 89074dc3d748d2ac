"""Expression instantiation (OLLIE 4.3): scopes become operator calls or eOperators.

``match_gemm(scope)`` fills the scope's iterators into the groups of the Matmul / BatchMatmul
iterator mapping tables (``rules/operators.py``) by which tensors they index, and checks that each
group reads its operands as one strided dimension, so a BLAS call can read them in place (OLLIE
Expression (2): no copies); ``match_conv`` and ``match_band`` do the same for Conv2d and the band
matmuls. ``instantiate(expr)`` turns every scope of an expression, innermost first, into a kernel:
a matched operator where one matches; failing that, the operator matched on operands re-laid out
by layout eOperators that split a dimension read as ``d*e1 + e2`` (Equations (3)-(4)); else an
eOperator (the scope itself, for codegen to compile). The result is a ``Candidate``: kernels in execution order, callable on
inputs. Its ``cost`` is an analytic stand-in (flops and bytes) that measured times will replace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from rewriter.index import affine_coefficients, affine_index, index_bounds
from rewriter.ir import (
    Access,
    Binary,
    IndexOp,
    Iterator,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
    constant_value,
    map_accesses,
    nested_scopes,
    rename_tensors,
    replace_reads,
    tensor_shapes,
)
from rewriter.semantics import evaluate

from .operators import BATCH_MATMUL

# The analytic stand-in for measured cost (seconds): a BLAS rate, a generated-kernel rate and
# memory bandwidth of a small CPU. Codegen's measurements replace ``Candidate.cost``.
BLAS_FLOPS = 5e10
EOP_OPS = 2e9
BYTES_PER_SECOND = 1e10
LAUNCH_SECONDS = 5e-6  # every kernel call costs something, however small


# --------------------------------------------------------------------------------------------
# Matching the Matmul family


@dataclass(frozen=True)
class Operand:
    """A tensor read as a strided 3-d view [batch, rows, cols] starting at ``offset`` elements."""

    tensor: str
    offset: int
    shape: tuple[int, int, int]
    strides: tuple[int, int, int]  # in elements


@dataclass(frozen=True)
class GemmMatch:
    kind: str  # "matmul" or "batch_matmul"
    a: Operand  # [b, m, k]
    b: Operand  # [b, k, n]
    out_strides: tuple[int, int, int]  # where C[b, m, n] lands in the row-major output

    @property
    def flops(self) -> int:
        batch, m, k = self.a.shape
        return 2 * batch * m * k * self.b.shape[2]


def _row_major(shape) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _placement(access: Access, box: dict) -> dict | None:
    """iterator -> element stride of the access, plus "" -> constant offset; None if an index
    mixes iterators or reads padding."""
    tensor = access.source
    strides = _row_major(tensor.shape)
    placement: dict[str, int] = {"": 0}
    for dim, (ix, stride) in enumerate(zip(access.indices, strides)):
        form = affine_coefficients(ix)
        if form is None:
            return None
        lo, hi = index_bounds(ix, box)
        if lo < 0 or hi >= tensor.shape[dim]:
            return None  # it reads padding: a layout eOperator must pad it first
        # a size-1 iterator is a constant (a 1x1 kernel's r in h+r)
        coefficients = {n: c for n, c in form[0].items() if box[n][1] - box[n][0] > 1}
        constant = form[1] + sum(c * box[n][0] for n, c in form[0].items() if n not in coefficients)
        if len(coefficients) > 1:
            return None
        for name, c in coefficients.items():  # an iterator in two dimensions adds up its strides
            placement[name] = placement.get(name, 0) + c * stride
        placement[""] += constant * stride
    return placement


def _merged(names: list[str], strides: dict, sizes: dict) -> int | None:
    """The single stride of iterators ``names`` (outer to inner) if they form one dimension."""
    names = [n for n in names if sizes[n] > 1]
    if not names:
        return 0
    stride = {n: strides.get(n, 0) for n in names}  # an operand broadcast along n: stride 0
    for outer, inner in zip(names, names[1:]):
        if stride[outer] != stride[inner] * sizes[inner]:
            return None
    return stride[names[-1]]


def match_gemm(scope: Scope) -> GemmMatch | None:
    """A Matmul / BatchMatmul reading its operands in place, or None (Table 2, section 4.3.1)."""
    body = scope.body
    if scope.reduce != "sum" or not (isinstance(body, Binary) and body.op == "*"):
        return None
    x, y = body.lhs, body.rhs
    if not all(isinstance(t, Access) and isinstance(t.source, Tensor) for t in (x, y)):
        return None
    box = {it.name: (it.lo, it.hi) for it in scope.iterators}
    sizes = {it.name: it.size for it in scope.iterators}
    px, py = _placement(x, box), _placement(y, box)
    if px is None or py is None:
        return None
    out_names = [it.name for it in scope.traversal]
    out_strides = dict(zip(out_names, _row_major(scope.shape)))
    groups: dict[str, list[str]] = {g.name: [] for g in BATCH_MATMUL.groups}
    for it in scope.iterators:
        group = BATCH_MATMUL.group_of(it.name in px, it.name in py, it.name in out_strides)
        if group is None:
            if it.size == 1:
                continue  # a size-1 iterator is a constant: it belongs to no group
            return None
        groups[group.name].append(it.name)
    if not groups["k"]:
        return None
    order = {name: k for k, name in enumerate(out_names)}
    for name in ("b", "m", "n"):
        groups[name].sort(key=order.get)
    # An m (n) iterator that does not merge with the others may be a batch dimension over
    # which the other operand is broadcast (stride 0): the outermost ones are tried first.
    for split_m in range(len(groups["m"]) + 1):
        for split_n in range(len(groups["n"]) + 1):
            batch = sorted(groups["b"] + groups["m"][:split_m] + groups["n"][:split_n], key=order.get)
            regrouped = dict(groups, b=batch, m=groups["m"][split_m:], n=groups["n"][split_n:])
            match = _gemm_match(x, y, px, py, regrouped, box, sizes, out_strides)
            if match is not None:
                return match
    return None


def _gemm_match(
    x: Access, y: Access, px: dict, py: dict, groups: dict, box: dict, sizes: dict, out_strides: dict
) -> GemmMatch | None:
    """The match for one grouping of the iterators into b, m, n, k, or None when some group's
    iterators do not form one strided dimension of an operand or of the output."""
    # read the operands at the first point of the box
    base_x = px[""] + sum(px[n] * box[n][0] for n in px if n)
    base_y = py[""] + sum(py[n] * box[n][0] for n in py if n)
    size = {g: math.prod(sizes[n] for n in names) for g, names in groups.items()}
    want = {
        "ax": [("b", px), ("m", px), ("k", px)],
        "by": [("b", py), ("k", py), ("n", py)],
        "out": [("b", out_strides), ("m", out_strides), ("n", out_strides)],
    }
    strides = {}
    for key, parts in want.items():
        merged = [_merged(groups[g], where, sizes) for g, where in parts]
        if any(s is None for s in merged):
            return None
        strides[key] = tuple(merged)
    kind = "batch_matmul" if size["b"] > 1 else "matmul"
    a = Operand(x.source.name, base_x, (size["b"], size["m"], size["k"]), strides["ax"])
    b = Operand(y.source.name, base_y, (size["b"], size["k"], size["n"]), strides["by"])
    return GemmMatch(kind, a, b, strides["out"])


def _operand_orders(scope: Scope) -> list[tuple[Access, Access]]:
    """(input, weight) both ways round for a summed product of two tensor reads, else nothing."""
    body = scope.body
    if scope.reduce != "sum" or not (isinstance(body, Binary) and body.op == "*"):
        return []
    if not all(isinstance(t, Access) and isinstance(t.source, Tensor) for t in (body.lhs, body.rhs)):
        return []
    return [(body.lhs, body.rhs), (body.rhs, body.lhs)]


@dataclass(frozen=True)
class ConvMatch:
    """A 2-d convolution: ``input[.., t*stride + s*dilation + offset, ..] * weight[.., s, ..]``."""

    input: str
    weight: str
    spatial: tuple[tuple[str, str, int, int], ...]  # (output iterator, kernel iterator, stride, dilation)
    flops: int


def match_conv(scope: Scope) -> ConvMatch | None:
    """A Conv2d by the CONV2D iterator mapping table: batch/spatial iterators index the input and
    the output, output channels the weight and the output, input channels and kernel offsets are
    summed over both; each spatial index of the input correlates one output iterator with one
    kernel iterator (``h*stride + r*dilation + offset``). Padding is the convolution's own."""
    return next((m for x, y in _operand_orders(scope) if (m := _conv_roles(scope, x, y))), None)


def _conv_roles(scope: Scope, x: Access, y: Access) -> ConvMatch | None:
    traversal = {it.name for it in scope.traversal}
    box = {it.name: (it.lo, it.hi) for it in scope.iterators}
    in_weight = set()
    for dim, ix in enumerate(y.indices):
        form = affine_coefficients(ix)
        lo, hi = index_bounds(ix, box)
        if form is None or len(form[0]) != 1 or set(form[0].values()) != {1} or lo < 0 or hi >= y.source.shape[dim]:
            return None
        in_weight |= set(form[0])
    spatial, covered = [], set(in_weight)
    for ix in x.indices:
        form = affine_coefficients(ix)
        if form is None:
            return None
        (coefficients, _), names = form, set(form[0])
        if len(names) == 2:
            outer, kernel = sorted(names & traversal), sorted((names - traversal) & in_weight)
            if len(outer) != 1 or len(kernel) != 1 or min(coefficients.values()) <= 0:
                return None  # a spatial index pairs one output iterator with one kernel offset
            spatial.append((outer[0], kernel[0], coefficients[outer[0]], coefficients[kernel[0]]))
            covered |= names
        elif len(names) == 1 and set(coefficients.values()) == {1}:
            covered |= names
        elif names:
            return None
    if len(spatial) != 2 or covered != set(box):
        return None
    flops = 2 * math.prod(it.size for it in scope.iterators)
    return ConvMatch(x.source.name, y.source.name, tuple(spatial), flops)


@dataclass(frozen=True)
class BandMatch:
    """G2BMM or GBMM (Longformer band matmuls): ``Y[.., i + dilation*w + offset, ..]`` reads a band."""

    kind: str  # "g2bmm" (w is an output iterator) or "gbmm" (w is summed)
    x: str
    y: str
    row: str  # i
    band: str  # w
    dilation: int
    flops: int


def match_band(scope: Scope) -> BandMatch | None:
    """A band matmul by the G2BMM/GBMM rows of the iterator mapping table: every index reads one
    iterator, except one index of the second operand that reads ``i + dilation*w + offset``, where
    i also indexes the first operand and w is the band (an output iterator for G2BMM, a summed one
    for GBMM, indexing the first operand too)."""
    return next((m for x, y in _operand_orders(scope) if (m := _band_roles(scope, x, y))), None)


def _single_iterators(access: Access) -> set | None:
    names = set()
    for ix in access.indices:
        form = affine_coefficients(ix)
        if form is None or len(form[0]) > 1 or set(form[0].values()) - {1}:
            return None
        names |= set(form[0])
    return names


def _band_roles(scope: Scope, x: Access, y: Access) -> BandMatch | None:
    in_x = _single_iterators(x)
    if in_x is None:
        return None
    combined = [affine_coefficients(ix) for ix in y.indices]
    if any(f is None for f in combined):
        return None
    pairs = [f[0] for f in combined if len(f[0]) == 2]
    singles = [f[0] for f in combined if len(f[0]) < 2]
    if len(pairs) != 1 or any(set(f.values()) - {1} for f in singles):
        return None
    (pair,) = pairs
    rows = [n for n, c in pair.items() if c == 1 and n in in_x]
    if len(rows) != 1:
        return None
    row = rows[0]
    (band,) = set(pair) - {row}
    dilation = pair[band]
    traversal = {it.name for it in scope.traversal}
    in_y = set().union(*(set(f) for f in singles)) | {row}
    if dilation <= 0 or band in in_y or row not in traversal:
        return None
    if band in traversal:  # G2BMM: out[.., i, w] = sum_k X[.., i, k] * Y[.., i + D*w, k]
        kind, ok = "g2bmm", band not in in_x and all(n in in_x and n in in_y for n in set(in_x | in_y) - {band})
    else:  # GBMM: out[.., i, k] = sum_w X[.., i, w] * Y[.., i + D*w, k]
        kind, ok = "gbmm", band in in_x and row in in_y
    if not ok or set(in_x | in_y | {band}) != {it.name for it in scope.iterators}:
        return None
    flops = 2 * math.prod(it.size for it in scope.iterators)
    return BandMatch(kind, x.source.name, y.source.name, row, band, dilation, flops)


def run_gemm(match: GemmMatch, values: dict[str, np.ndarray], out_shape, out: np.ndarray | None = None) -> np.ndarray:
    """C[b, m, n] = A[b, m, :] @ B[b, :, n] on strided views of the operands (no copies made
    here), landing in ``out`` (a new array when None) through C's strides."""

    def view(op: Operand) -> np.ndarray:
        flat = np.ascontiguousarray(values[op.tensor]).reshape(-1)
        itemsize = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[op.offset :], op.shape, tuple(s * itemsize for s in op.strides))

    a, b = view(match.a), view(match.b)
    out = np.empty(out_shape, dtype=np.result_type(a, b)) if out is None else out
    shape = (a.shape[0], a.shape[1], b.shape[2])
    target = np.lib.stride_tricks.as_strided(out.reshape(-1), shape, tuple(s * out.itemsize for s in match.out_strides))
    np.matmul(a, b, out=target)
    return out


# --------------------------------------------------------------------------------------------
# Candidates: kernels in execution order


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``output = expr`` where expr reads inputs and earlier kernels' outputs by name."""

    kind: str  # "matmul", "batch_matmul", or "eop" (an eOperator)
    output: str
    expr: Scope
    match: GemmMatch | ConvMatch | BandMatch | None = None
    weight_only: bool = False  # reads only weights: evaluated once at build time (5.4)

    @property
    def cost(self) -> float:
        """Analytic stand-in: compute time plus the bytes the kernel reads and writes."""
        moved = 4 * (math.prod(self.expr.shape) + sum(math.prod(s) for s in tensor_shapes(self.expr).values()))
        fixed = LAUNCH_SECONDS + moved / BYTES_PER_SECOND
        if self.match is not None:
            return self.match.flops / BLAS_FLOPS + fixed
        # a fused eOperator still computes its nested scopes (once each): count their work too
        work = sum(
            math.prod(it.size for it in s.iterators) * _op_count(s.body) for s in (self.expr, *nested_scopes(self.expr))
        )
        return work / EOP_OPS + fixed

    def with_expr(self, expr: Scope) -> Kernel:
        """The same kernel over a renamed expression (matched again: names are in the match)."""
        if self.kind == "eop":
            return Kernel("eop", self.output, expr, None, self.weight_only)
        matched = _kernel(expr, self.output)
        return Kernel(matched.kind, self.output, expr, matched.match, self.weight_only)

    def renamed(self, names: dict[str, str]) -> Kernel:
        """The same kernel reading and writing the tensors ``names`` maps to (others unchanged)."""
        return replace(self, output=names.get(self.output, self.output)).with_expr(rename_tensors(self.expr, names))

    def __str__(self) -> str:
        marks = " (weights only)" if self.weight_only else ""
        return f"{self.output} = {self.kind}{marks}: {self.expr}"


def _op_count(body: Scalar) -> int:
    if isinstance(body, Unary):
        return 1 + _op_count(body.arg)
    if isinstance(body, Binary):
        return 1 + _op_count(body.lhs) + _op_count(body.rhs)
    return 1


@dataclass
class Candidate:
    """A program of kernels equivalent to the expression it was derived from."""

    kernels: list[Kernel]
    source: object = field(default=None, repr=False)  # the search state it came from
    unfused: list[Kernel] | None = field(default=None, repr=False)  # before eOperator fusion (5.4)

    @property
    def output(self) -> str:
        return self.kernels[-1].output

    @property
    def cost(self) -> float:
        return sum(k.cost for k in self.kernels)

    def __call__(self, **inputs) -> np.ndarray:
        values = {name: np.asarray(value, dtype=np.float64) for name, value in inputs.items()}
        for kernel in self.kernels:
            if isinstance(kernel.match, GemmMatch):
                values[kernel.output] = run_gemm(kernel.match, values, kernel.expr.shape)
            else:
                needed = {name: values[name] for name in tensor_shapes(kernel.expr)}
                values[kernel.output] = evaluate(kernel.expr, needed)
        return values[self.output]

    def __str__(self) -> str:
        return "\n".join(str(k) for k in self.kernels)


def instantiate(expr: Scope, relayout: bool = False) -> Candidate:
    """Every scope of ``expr`` (innermost first) as a kernel; nested scopes become tensors.

    With ``relayout``, a product that matches only as a BatchMatmul of many small batches (or
    no operator) reads its operands through layout eOperators that order their dimensions as
    one larger Matmul wants (``_operand_layouts``): a copy against a better GEMM, which
    measurement decides (``derive`` instantiates its best states both ways)."""
    kernels: list[Kernel] = []
    names = iter(f"T{k}" for k in range(1 << 30))
    root = _lift(expr, kernels, names, {}, relayout)
    _emit(root, "out", kernels, names, relayout)
    return Candidate(kernels)


def _kernel(scope: Scope, output: str) -> Kernel:
    kind, match = match_operator(scope)
    return Kernel(kind, output, scope, match)


def wants_operator(scope: Scope) -> bool:
    """Whether ``scope`` has an operator's shape (a summed product of two tensor reads) but no
    operator table matches it yet: what guided derivation works on."""
    return bool(_operand_orders(scope)) and match_operator(scope)[0] == "eop"


@lru_cache(maxsize=1 << 14)
def match_operator(scope: Scope) -> tuple[str, object]:
    """(kind, match) of the first operator table that matches, else ("eop", None); cached because
    the states of a search share most of their scopes."""
    gemm = match_gemm(scope)
    if gemm is not None:
        return gemm.kind, gemm
    conv = match_conv(scope)
    if conv is not None:
        return "conv2d", conv
    band = match_band(scope)
    return (band.kind, band) if band else ("eop", None)


def _emit(scope: Scope, output: str, kernels: list[Kernel], names, relayout: bool = False) -> None:
    """The kernel computing ``scope``; where no operator matches the operands as laid out but
    one matches them re-laid out (split dimensions), the layout eOperators come first."""
    kernel = _kernel(scope, output)
    relaid = _split_layouts(scope) if wants_operator(scope) else None
    if relaid is not None:
        layouts: list[Kernel] = []
        matched = _kernel(_lift(relaid, layouts, names, {}), output)
        if matched.kind != "eop":
            kernels.extend(layouts)
            kernel = matched
    relaid = _operand_layouts(kernel.expr) if relayout and _batches(kernel) > 1 else None
    if relaid is not None:
        layouts = []
        matched = _kernel(_lift(relaid, layouts, names, {}), output)
        if _batches(matched) < _batches(kernel):
            kernels.extend(layouts)
            kernel = matched
    kernels.append(kernel)


def _batches(kernel: Kernel) -> float:
    """How many GEMMs the kernel is (infinite for one that is no GEMM)."""
    return kernel.match.a.shape[0] if kernel.kind in ("matmul", "batch_matmul") else math.inf


def _lift(scope: Scope, kernels: list[Kernel], names, emitted: dict, relayout: bool = False) -> Scope:
    """``scope`` with each nested scope replaced by a read of a kernel's output tensor. Equal
    nested scopes (a softmax reads its row maximum twice) share one kernel: ``emitted`` maps
    each lifted scope to the tensor that holds it."""

    def lift(access: Access) -> Scalar:
        if not isinstance(access.source, Scope):
            return access
        inner = _lift(access.source, kernels, names, emitted, relayout)
        if inner not in emitted:
            emitted[inner] = next(names)
            _emit(inner, emitted[inner], kernels, names, relayout)
        name = emitted[inner]
        # a kernel output is stored from 0; the scope was read in iterator coordinates
        shifted = tuple(ix - it.lo for ix, it in zip(access.indices, inner.traversal))
        return Access(Tensor(name, inner.shape), shifted)

    return Scope(scope.traversal, scope.summation, map_accesses(scope.body, lift), scope.reduce)


# --------------------------------------------------------------------------------------------
# Layout eOperators for operands (OLLIE 4.3.1, Equations (3)-(4))


@lru_cache(maxsize=1 << 14)
def _split_layouts(scope: Scope) -> Scope | None:
    """``scope`` reading each tensor whose indices look like ``d*e1 + e2`` (0 <= e2 < d) through a
    layout scope that splits that dimension in two, ``X'[.., e2, e1, ..]``, and each tensor read
    as ``X[.., e/c, .., e%c, ..]`` through one that merges the two dimensions, ``X'[.., e, ..]``;
    None if no read needs either.

    A split is how a dilated band or convolution becomes a plain one after a split
    ``i = d*p + q``: ``Y[i + d*w]`` reads ``Y'[q, p + w]``, and q joins the batch. A merge is
    how a summation over heads and head dimensions, ``T[k/64, i, k%64]`` (attention's output
    projection), becomes one summation iterator k that a Matmul can take.
    """
    box = {it.name: (it.lo, it.hi) for it in scope.iterators}
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
    return Scope(scope.traversal, scope.summation, body, scope.reduce) if changed else None


@lru_cache(maxsize=1 << 12)
def _operand_layouts(scope: Scope) -> Scope | None:
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
    return Scope(scope.traversal, scope.summation, relaid_body, scope.reduce) if changed else None


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
        if not outer or not inner:
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


# --------------------------------------------------------------------------------------------
# Post-processing (OLLIE 5.4)


def postprocess(candidate: Candidate, weights=()) -> Candidate:
    """Drop identity eOperators, fuse an eOperator into the eOperator that alone reads it, and
    mark kernels that read only weights (``weights``: input names) for compile-time evaluation.

    The result also carries ``unfused``: the same program before eOperator fusion (None when
    nothing fused), so that code generation can fuse only where that measures faster."""
    kernels = list(candidate.kernels)
    while _drop_identity(kernels):
        pass
    unfused = list(kernels)
    while _fuse_eops(kernels) or _drop_identity(kernels):
        pass
    fused = len(kernels) < len(unfused)
    return Candidate(
        mark_weight_only(kernels, weights), candidate.source, mark_weight_only(unfused, weights) if fused else None
    )


def mark_weight_only(kernels: list[Kernel], weights) -> list[Kernel]:
    """``kernels`` with those that read only weights (and their products) marked weight-only;
    the program's final kernel is never marked."""
    constant, marked = set(weights), []
    for kernel in kernels:
        only = kernel.output != kernels[-1].output and set(tensor_shapes(kernel.expr)) <= constant
        if only:
            constant.add(kernel.output)
        marked.append(Kernel(kernel.kind, kernel.output, kernel.expr, kernel.match, only))
    return marked


def _readers(kernels: list[Kernel], name: str) -> list[int]:
    return [k for k, kernel in enumerate(kernels) if name in tensor_shapes(kernel.expr)]


def _drop_identity(kernels: list[Kernel]) -> bool:
    """An eOperator that copies a tensor element for element (flattened, the map is x -> x):
    its readers read the source instead; a final copy of a kernel's output renames that output."""
    produced = {k.output: k for k in kernels}
    for index, kernel in enumerate(kernels):
        source = _copied(kernel)
        if source is None:
            continue
        if index < len(kernels) - 1:
            _rename_reads(kernels, kernel.output, source)
        elif source in produced:
            producer = produced[source]
            kernels[kernels.index(producer)] = Kernel(
                producer.kind, kernel.output, producer.expr, producer.match, producer.weight_only
            )
            _rename_reads(kernels, source, kernel.output)
        else:
            continue  # the whole program copies an input: that copy is the program
        del kernels[index]
        return True
    return False


def _copied(kernel: Kernel) -> str | None:
    """The tensor an eOperator copies unchanged, or None."""
    expr, body = kernel.expr, kernel.expr.body
    if kernel.kind != "eop" or expr.summation or not isinstance(body, Access) or not isinstance(body.source, Tensor):
        return None
    identity = tuple(it.var - it.lo if it.lo else it.var for it in expr.traversal)
    return body.source.name if body.source.shape == expr.shape and body.indices == identity else None


def _rename_reads(kernels: list[Kernel], old: str, new: str) -> None:
    """Readers of ``old`` read ``new`` (a tensor of the same shape) instead."""
    for k in _readers(kernels, old):
        reader = kernels[k]
        tensor = Tensor(new, tensor_shapes(reader.expr)[old])
        kernels[k] = reader.with_expr(rename_tensor(reader.expr, old, tensor))


def fusion_pairs(kernels: list[Kernel]) -> list[tuple[int, int]]:
    """(producer, consumer) positions where an eOperator is read by exactly one later kernel,
    itself an eOperator: the pairs eOperator fusion may merge."""
    pairs = []
    for index, producer in enumerate(kernels[:-1]):
        readers = _readers(kernels, producer.output)
        if producer.kind == "eop" and len(readers) == 1 and kernels[readers[0]].kind == "eop":
            pairs.append((index, readers[0]))
    return pairs


def fuse(producer: Kernel, consumer: Kernel) -> Kernel:
    """eOperator fusion: ``consumer`` with its reads of ``producer`` replaced by the producer's
    expression (a nested scope, which code generation computes once as a stage)."""

    def read(indices, scope=producer.expr):
        return scope[tuple(ix + it.lo for ix, it in zip(indices, scope.traversal))]

    expr = consumer.expr
    fused = Scope(expr.traversal, expr.summation, replace_reads(expr.body, producer.output, read), expr.reduce)
    return Kernel("eop", consumer.output, fused, weight_only=producer.weight_only and consumer.weight_only)


def _fuse_eops(kernels: list[Kernel]) -> bool:
    pairs = fusion_pairs(kernels)
    if not pairs:
        return False
    producer, consumer = pairs[0]
    kernels[consumer] = fuse(kernels[producer], kernels[consumer])
    del kernels[producer]
    return True


def rename_tensor(scope: Scope, name: str, tensor: Tensor) -> Scope:
    return Scope(scope.traversal, scope.summation, replace_reads(scope.body, name, lambda ix: tensor[ix]), scope.reduce)
