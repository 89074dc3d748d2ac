"""Matchable operators (OLLIE 4.3.1), one record each: adding an operator is adding a record here.

A record, ``Operator``, holds

* ``kind``: the name its kernels carry ("matmul", "conv2d", ...);
* ``table``: its iterator mapping table (``rewriter.lower.tables``: groups and windows, Table 2);
* ``constraints``: its own checks on a scope filled into the table (the filling, ``fill``, is
  shared by every operator), returning the match: what code generation and ``Candidate`` need
  (a GEMM's operand strides for an in-place BLAS call, a convolution's windows, a band's
  dilation), with ``structure``, the parameters that make two kernels of one kind different
  programs (a kernel extent, a dilation); or None;
* ``implementations``: per backend, the implementation names its code generator knows
  (``{"cpu": ("im2col", "tvm")}``), raced by measurement;
* ``flops``: its arithmetic, for the analytic cost stand-in.

``OPERATORS`` are the registered records in matching order (Matmul before BatchMatmul: a
product that is one GEMM is not called a batch of one); ``match_operator(scope, operators)``
gives the first that matches. The constraint functions (``gemm_constraints``,
``conv_constraints``, ``band_constraints``) serve any table of their family: a 1-D or a 3-D
convolution is a record with another table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache, partial
from itertools import product
from typing import Callable, Mapping

import numpy as np

from rewriter.index import row_major
from rewriter.ir import Scope

from .tables import Filled, Group, IteratorTable, Read, Window, fill


def point_flops(scope: Scope) -> int:
    """A multiply and an add at every point of the iteration space."""
    return 2 * math.prod(it.size for it in scope.iterators)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: kernels and caches keep the record
class Operator:
    """One matchable operator: its iterator mapping table, constraints, implementations, cost."""

    kind: str
    table: IteratorTable
    constraints: Callable[[Operator, Filled], object | None]
    implementations: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    flops: Callable[[Scope], int] = point_flops

    def match(self, scope: Scope):
        """The match of ``scope`` (the first operand order that passes), or None."""
        for filled in fill(scope, self.table):
            found = self.constraints(self, filled)
            if found is not None:
                return found
        return None

    def __repr__(self) -> str:
        return f"Operator({self.kind!r})"


# --------------------------------------------------------------------------------------------
# GEMM: operands read in place through strides (OLLIE Expression (2))


@dataclass(frozen=True)
class Operand:
    """A tensor read as a strided 3-d view [batch, rows, cols] starting at ``offset`` elements."""

    tensor: str
    offset: int
    shape: tuple[int, int, int]
    strides: tuple[int, int, int]  # in elements


@dataclass(frozen=True)
class GemmMatch:
    """C[b, m, n] = A[b, m, :] @ B[b, :, n], every operand a strided view (no copies)."""

    operator: Operator
    a: Operand  # [b, m, k]
    b: Operand  # [b, k, n]
    out_strides: tuple[int, int, int]  # where C[b, m, n] lands in the row-major output

    @property
    def kind(self) -> str:
        return self.operator.kind

    @property
    def batches(self) -> int:
        return self.a.shape[0]

    @property
    def structure(self) -> tuple:
        return ()


def gemm_constraints(operator: Operator, filled: Filled, batched: bool = True) -> GemmMatch | None:
    """GEMM's own constraint (OLLIE 4.3.1 and footnote 2): each group's iterators form one
    strided dimension of each operand that reads it and of the output, so BLAS reads them in
    place; no operand reads padding. An m (n) iterator that does not merge with the others may
    be a batch over which the other operand is broadcast (stride 0): with ``batched``, the
    outermost ones are tried as batch iterators too."""
    x, y = filled.input, filled.weight
    if x.padded or y.padded:
        return None  # a layout eOperator must pad it first
    sizes = filled.sizes
    groups = {g: [n for n in names if sizes[n] > 1] for g, names in filled.groups.items()}
    groups.setdefault("b", [])
    if not groups["k"]:
        return None
    px, py = _placement(x, filled.scope.box, sizes), _placement(y, filled.scope.box, sizes)
    out_names = [it.name for it in filled.scope.traversal]
    out_strides = dict(zip(out_names, row_major(filled.scope.shape)))
    order = {name: k for k, name in enumerate(out_names)}
    splits = product(range(len(groups["m"]) + 1), range(len(groups["n"]) + 1)) if batched else [(0, 0)]
    for split_m, split_n in splits:
        batch = sorted(groups["b"] + groups["m"][:split_m] + groups["n"][:split_n], key=order.get)
        regrouped = dict(groups, b=batch, m=groups["m"][split_m:], n=groups["n"][split_n:])
        found = _gemm_views(operator, x.tensor, y.tensor, px, py, regrouped, sizes, out_strides)
        if found is not None:
            return found
    return None


def _placement(read: Read, box: dict, sizes: dict) -> dict[str, int]:
    """iterator -> element stride of the read, plus "" -> the offset of its first element."""
    placement: dict[str, int] = {"": 0}
    for form, stride in zip(read.indices, row_major(read.access.source.shape)):
        offset = form.constant
        for name, c in form.coefficients.items():
            if sizes[name] > 1:  # an iterator in two dimensions adds up its strides
                placement[name] = placement.get(name, 0) + c * stride
            offset += c * box[name][0]
        placement[""] += offset * stride
    return placement


def _merged(names: list[str], strides: dict, sizes: dict) -> int | None:
    """The single stride of iterators ``names`` (outer to inner) if they form one dimension."""
    if not names:
        return 0
    stride = {n: strides.get(n, 0) for n in names}  # an operand broadcast along n: stride 0
    for outer, inner in zip(names, names[1:]):
        if stride[outer] != stride[inner] * sizes[inner]:
            return None
    return stride[names[-1]]


def _gemm_views(operator, x: str, y: str, px, py, groups, sizes, out_strides) -> GemmMatch | None:
    """The match for one grouping of the iterators into b, m, n, k, or None when some group's
    iterators do not form one strided dimension of an operand or of the output."""
    size = {g: math.prod(sizes[n] for n in names) for g, names in groups.items()}
    want = {
        "a": [("b", px), ("m", px), ("k", px)],
        "b": [("b", py), ("k", py), ("n", py)],
        "out": [("b", out_strides), ("m", out_strides), ("n", out_strides)],
    }
    strides = {}
    for key, parts in want.items():
        merged = [_merged(groups[g], where, sizes) for g, where in parts]
        if any(s is None for s in merged):
            return None
        strides[key] = tuple(merged)
    a = Operand(x, px[""], (size["b"], size["m"], size["k"]), strides["a"])
    b = Operand(y, py[""], (size["b"], size["k"], size["n"]), strides["b"])
    return GemmMatch(operator, a, b, strides["out"])


def operand_view(values: dict[str, np.ndarray], op: Operand) -> np.ndarray:
    """The operand as its strided 3-d view of its tensor in ``values`` (no copy of a C-contiguous one)."""
    flat = np.ascontiguousarray(values[op.tensor]).reshape(-1)
    return np.lib.stride_tricks.as_strided(flat[op.offset :], op.shape, tuple(s * flat.itemsize for s in op.strides))


def run_gemm(match: GemmMatch, values: dict[str, np.ndarray], out_shape, out: np.ndarray | None = None) -> np.ndarray:
    """C[b, m, n] = A[b, m, :] @ B[b, :, n] on strided views of the operands (no copies made
    here), landing in ``out`` (a new array when None) through C's strides."""

    a, b = operand_view(values, match.a), operand_view(values, match.b)
    out = np.empty(out_shape, dtype=np.result_type(a, b)) if out is None else out
    shape = (a.shape[0], a.shape[1], b.shape[2])
    target = np.lib.stride_tricks.as_strided(out.reshape(-1), shape, tuple(s * out.itemsize for s in match.out_strides))
    np.matmul(a, b, out=target)
    return out


# --------------------------------------------------------------------------------------------
# Convolution: the input read through windows ``stride*h + dilation*r + offset``


@dataclass(frozen=True)
class ConvMatch:
    """A convolution: ``input[.., stride*t + dilation*s + offset, ..] * weight[.., s, ..]``
    for each window (in input dimension order); the padding is the convolution's own."""

    operator: Operator
    input: str
    weight: str
    spatial: tuple[tuple[str, str, int, int], ...]  # (output iterator, kernel iterator, stride, dilation)
    extents: tuple[int, ...]  # each window's kernel extent

    @property
    def kind(self) -> str:
        return self.operator.kind

    @property
    def structure(self) -> tuple:
        """Kernel extents and dilations: a dilated and a plain convolution are different programs."""
        return (tuple((extent, dilation) for extent, (_, _, _, dilation) in zip(self.extents, self.spatial)),)


def conv_constraints(operator: Operator, filled: Filled) -> ConvMatch | None:
    """A convolution's own constraints: the weight is read inside its bounds, one iterator per
    index, with coefficient 1; an input index other than the windows reads at most one
    iterator of extent above 1 (a depthwise ``A[n, f+c, ..]`` with c of extent 1 reads f), with
    coefficient 1: a strided or dilated read is a window's business."""
    x, w = filled.input, filled.weight
    if w.padded or any(len(f.coefficients) != 1 or not _unit(f) for f in w.indices):
        return None
    sizes = filled.sizes
    if any(c != 1 for f in x.plain for n, c in f.coefficients.items() if sizes[n] > 1):
        return None
    spatial = tuple((o, k, f.coefficients[o], f.coefficients[k]) for f in x.windows for o, k in [f.roles])
    return ConvMatch(operator, x.tensor, w.tensor, spatial, tuple(sizes[k] for _, k, _, _ in spatial))


def _unit(form) -> bool:
    return all(c == 1 for c in form.coefficients.values())


# --------------------------------------------------------------------------------------------
# Band matmuls (Longformer): the second operand read through a window ``i + dilation*w + offset``


@dataclass(frozen=True)
class BandMatch:
    """A band matmul: ``y[.., row + dilation*band + offset, ..]`` reads a band of rows of y
    around each row of x; ``summed`` when the band is summed over (GBMM), else it is an
    output dimension (G2BMM)."""

    operator: Operator
    x: str
    y: str
    row: str  # i
    band: str  # w
    dilation: int
    summed: bool

    @property
    def kind(self) -> str:
        return self.operator.kind

    @property
    def structure(self) -> tuple:
        return (self.dilation,)


def band_constraints(operator: Operator, filled: Filled) -> BandMatch | None:
    """A band matmul's own constraints: every index other than the window reads at most one
    iterator with coefficient 1; the band iterator is read by the window alone, and is the only
    iterator of its group."""
    x, y = filled.input, filled.weight
    if any(len(f.coefficients) > 1 or not _unit(f) for f in (*x.indices, *y.plain)):
        return None
    if len(y.windows) != 1:
        return None
    (form,) = y.windows
    row, along = form.roles
    if filled.groups[form.window.inner] != (along,) or any(along in f.coefficients for f in y.plain):
        return None
    summed = along in {it.name for it in filled.scope.summation}
    return BandMatch(operator, x.tensor, y.tensor, row, along, form.coefficients[along], summed)


# --------------------------------------------------------------------------------------------
# The records (Table 2)

# BLAS; the scope compiled by TVM (faster for few rows); TVM over the weight laid out once: in
# panels where the right operand is a weight (in rows of two vectors, or of six where AVX-512
# has room), and k-major in panels with lanes along the weight's rows where either one is and
# the output runs along the other (codegen.packed); raced by measurement
CPU_GEMM = {"cpu": ("blas", "tvm", "packed", "packed_wide", "transposed")}

MATMUL = Operator(
    "matmul",
    IteratorTable(
        (
            Group("m", input=True, weight=False, output=True),
            Group("n", input=False, weight=True, output=True),
            Group("k", input=True, weight=True, output=False),
        )
    ),
    partial(gemm_constraints, batched=False),
    CPU_GEMM,
)

BATCH_MATMUL = Operator(
    "batch_matmul",
    IteratorTable(
        (
            Group("b", input=True, weight=True, output=True),
            *MATMUL.table.groups,
        )
    ),
    gemm_constraints,
    CPU_GEMM,
)

CONV2D = Operator(
    "conv2d",
    IteratorTable(
        (
            Group("g", input=True, weight=True, output=True),  # groups: a depthwise channel
            Group("nhw", input=True, weight=False, output=True),
            Group("f", input=False, weight=True, output=True),
            Group("crs", input=True, weight=True, output=False),
        ),
        (Window("input", "nhw", "crs"), Window("input", "nhw", "crs")),  # stride*h + dilation*r + offset, and w, s
    ),
    conv_constraints,
    # im2col + BLAS; the scope compiled by TVM; TVM over the weight laid out in panels of output
    # channels once (codegen.panels); raced by measurement
    {"cpu": ("im2col", "tvm", "panels")},
)

G2BMM = Operator(
    "g2bmm",
    IteratorTable(
        (
            Group("bi", input=True, weight=True, output=True),  # batch and the row i
            Group("w", input=False, weight=True, output=True),  # the band
            Group("k", input=True, weight=True, output=False),
        ),
        (Window("weight", "bi", "w", outer_coefficient=1),),  # i + dilation*w + offset
    ),
    band_constraints,
    {"cpu": ("band", "tvm")},
)

GBMM = Operator(
    "gbmm",
    IteratorTable(
        (
            Group("bi", input=True, weight=True, output=True),
            Group("w", input=True, weight=True, output=False),  # the band, summed
            Group("n", input=False, weight=True, output=True),
        ),
        (Window("weight", "bi", "w", outer_coefficient=1),),
    ),
    band_constraints,
    {"cpu": ("band", "tvm")},
)

OPERATORS: tuple[Operator, ...] = (MATMUL, BATCH_MATMUL, CONV2D, G2BMM, GBMM)


def match_operator(scope: Scope, operators=None) -> tuple[str, object]:
    """(kind, match) of the first of ``operators`` (default ``OPERATORS``) that matches
    ``scope``, else ("eop", None): an eOperator."""
    return _first_match(scope, OPERATORS if operators is None else tuple(operators))


@lru_cache(maxsize=1 << 14)  # the states of a search share most of their scopes
def _first_match(scope: Scope, operators: tuple[Operator, ...]) -> tuple[str, object]:
    for operator in operators:
        found = operator.match(scope)
        if found is not None:
            return operator.kind, found
    return "eop", None
