"""Builders: the operators users bring (matmul, convolutions, attention bands, element-wise ops,
reductions, softmax, layer norm, einsum) as IR scopes in the notation of DESIGN.md.

Every operand argument accepts

* a ``Tensor``;
* a ``Scope`` (another builder's result): it is read as a nested scope with identity indices, so
  builders compose, e.g. ``relu(conv2d(x, w))``;
* a plain shape tuple: a ``Tensor`` is made with the builder's default name ("A", "B", ... as each
  builder documents). A default name already used by another operand gets a digit ("B1") so two
  different inputs never share a name.

Iterator names are part of the interface (printed text is what people read):

* matmul-like ops: ``i, j`` traverse, ``k`` sums, ``b`` is the batch;
* convolutions: ``n, f, h, w`` traverse (batch, output channel, row, column), ``c, r, s`` sum
  (input channel, kernel row, kernel column); transposed convolutions sum ``x, y`` (input row,
  column) instead of ``r, s``;
* element-wise ops: ``i0, i1, ...``, one per output axis;
* reductions: ``i<axis>`` for a kept axis and ``r<axis>`` for a reduced one, numbered by the
  input's axis, so ``reduce_sum(A, 1)`` on a (2, 3, 4) tensor is
  ``L i0:2, i2:4 ; S r1:3 ; A[i0, r1, i2]``;
* einsum: the subscript letters (``L``, ``S`` and ``M`` are keywords of the notation and become
  ``L_``, ``S_``, ``M_``).

Every error is an ``ExpressionError`` whose message starts with the builder's name.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

from .errors import ExpressionError
from .indices import Index, IndexOp, Lit, Var
from .nodes import Access, Binary, Iterator, Num, Scalar, Scope, Tensor, Unary, tensor_shapes
from .notation import COMPARISONS, KEYWORDS, UNARY_FUNCTIONS

__all__ = [
    "matmul",
    "batch_matmul",
    "conv1d",
    "conv2d",
    "conv_transpose2d",
    "g2bmm",
    "gbmm",
    "unary",
    "relu",
    "exp",
    "tanh",
    "sin",
    "cos",
    "sigmoid",
    "sqrt",
    "erf",
    "log",
    "absolute",
    "rsqrt",
    "floor",
    "ceil",
    "gelu",
    "binary",
    "add",
    "sub",
    "mul",
    "div",
    "maximum",
    "minimum",
    "power",
    "compare",
    "where",
    "clip",
    "reduce_sum",
    "cumsum",
    "reduce_max",
    "reduce_mean",
    "reduce_norm",
    "softmax",
    "log_softmax",
    "layer_norm",
    "group_norm",
    "einsum",
]

Operand = Union[Tensor, Scope, Sequence[int]]


# --------------------------------------------------------------------------------------------
# Shared helpers: error prefixes, operands, small integer arguments, index arithmetic


_BUILDERS: set[str] = set()


def _builder(name: str):
    """Prefix every ExpressionError raised while building with the builder's name."""
    _BUILDERS.add(name)

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except ExpressionError as err:
                message = str(err)
                inner, _, rest = message.partition(": ")
                if inner in _BUILDERS:  # a builder calling another: name the one the user called
                    message = rest
                raise ExpressionError(f"{name}: {message}") from None

        return wrapper

    return decorate


@dataclass(frozen=True)
class _Operand:
    """An operand as a builder sees it: something with a shape that can be read at indices."""

    source: Union[Tensor, Scope]
    label: str  # how messages name it: the tensor's name, or "the scope passed as b"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def rank(self) -> int:
        return len(self.shape)

    def read(self, *indices) -> Access:
        """``source[indices]`` with indices counted from 0 along every axis.

        A scope whose traversal starts at lo != 0 is stored over [lo, hi), so its reads shift.
        """
        if isinstance(self.source, Scope):
            indices = tuple(_shift(ix, it.lo) for ix, it in zip(indices, self.source.traversal))
        return Access(self.source, tuple(indices))


def _shift(ix, offset: int) -> Index:
    ix = ix if isinstance(ix, Index) else Lit(ix) if isinstance(ix, int) else Var(ix)
    return ix if offset == 0 else ix + offset


def _operands(*specs: tuple[str, object, str]) -> list[_Operand]:
    """Operands from ``(parameter, value, default tensor name)`` triples.

    Shapes become Tensors named by the default, unless another operand already uses that name
    (then a digit is appended): reading one name with two meanings would be silently wrong.
    """
    used: set[str] = set()
    for _, value, _ in specs:
        if isinstance(value, Tensor):
            used.add(value.name)
        elif isinstance(value, Scope):
            used.update(tensor_shapes(value))
    result = []
    for param, value, default in specs:
        if isinstance(value, Tensor):
            result.append(_Operand(value, value.name))
        elif isinstance(value, Scope):
            result.append(_Operand(value, f"the scope passed as {param}"))
        elif isinstance(value, (tuple, list)):
            name, suffix = default, 0
            while name in used:
                suffix += 1
                name = f"{default}{suffix}"
            used.add(name)
            result.append(_Operand(Tensor(name, tuple(value)), name))
        else:
            raise ExpressionError(
                f"argument {param} must be a Tensor, a Scope or a shape tuple, got {type(value).__name__}"
            )
    return result


def _int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExpressionError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ExpressionError(f"{what} must be at least {minimum}, got {value}")
    return value


def _pair(value: object, what: str, minimum: int) -> tuple[int, int]:
    """An int or a pair of ints (height, width), as PyTorch takes stride/padding/dilation."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ExpressionError(f"{what} must be an integer or a pair, got {value!r}")
        return _int(value[0], f"{what} (height)", minimum), _int(value[1], f"{what} (width)", minimum)
    v = _int(value, what, minimum)
    return v, v


def _rank(op: _Operand, rank: int, what: str) -> None:
    if op.rank != rank:
        raise ExpressionError(f"{what} {op.label} must have rank {rank}, got shape {op.shape}")


def _linear(*terms: Union[int, tuple[int, Index]]) -> Index:
    """A sum of ``coefficient*index`` terms and integer constants, in the given order, written
    as a person would: ``(2, h), (1, r), -1`` gives ``2*h+r-1``; zero terms are dropped."""
    result = None
    for term in terms:
        coef, ix = (term, None) if isinstance(term, int) else term
        if coef == 0:
            continue
        size = abs(coef)
        piece = Lit(size) if ix is None else ix if size == 1 else Lit(size) * ix
        if result is None:
            # a leading negative term: "-2*x" (constant folded into the literal) or "-x"
            if coef > 0:
                result = piece
            elif ix is None:
                result = Lit(coef)
            else:
                result = -ix if size == 1 else Lit(coef) * ix
        else:
            result = IndexOp("+" if coef > 0 else "-", result, piece)
    return Lit(0) if result is None else result


def _its(*pairs: tuple[str, int]) -> tuple[Iterator, ...]:
    return tuple(Iterator(name, 0, size) for name, size in pairs)


# --------------------------------------------------------------------------------------------
# Matrix products


@_builder("matmul")
def matmul(a: Operand, b: Operand, transpose_a: bool = False, transpose_b: bool = False) -> Scope:
    """Matrix product ``A @ B`` of rank-2 operands (default names A and B)::

        L i:M, j:N ; S k:K ; A[i, k] * B[k, j]

    ``A`` is (M, K) and ``B`` is (K, N); ``transpose_a`` takes ``A`` as (K, M) and reads
    ``A[k, i]``, ``transpose_b`` takes ``B`` as (N, K) and reads ``B[j, k]``.
    """
    a, b = _operands(("a", a, "A"), ("b", b, "B"))
    _rank(a, 2, "operand")
    _rank(b, 2, "operand")
    m, ka = a.shape[::-1] if transpose_a else a.shape
    kb, n = b.shape[::-1] if transpose_b else b.shape
    if ka != kb:
        a_dim = "rows (transpose_a)" if transpose_a else "columns"
        b_dim = "columns (transpose_b)" if transpose_b else "rows"
        raise ExpressionError(f"inner dimensions differ: {a.label} has {ka} {a_dim}, {b.label} has {kb} {b_dim}")
    left = a.read("k", "i") if transpose_a else a.read("i", "k")
    right = b.read("j", "k") if transpose_b else b.read("k", "j")
    return Scope(_its(("i", m), ("j", n)), _its(("k", ka)), left * right)


@_builder("batch_matmul")
def batch_matmul(a: Operand, b: Operand, transpose_a: bool = False, transpose_b: bool = False) -> Scope:
    """Batched matrix product of rank-3 operands (default names A and B)::

        L b:Bt, i:M, j:N ; S k:K ; A[b, i, k] * B[b, k, j]

    ``A`` is (Bt, M, K), ``B`` is (Bt, K, N); the transpose flags swap the last two axes of an
    operand as in ``matmul``. Batch sizes must be equal. (Iterator ``b`` and tensor ``B`` are
    different names: the notation is case-sensitive.)
    """
    a, b = _operands(("a", a, "A"), ("b", b, "B"))
    _rank(a, 3, "operand")
    _rank(b, 3, "operand")
    if a.shape[0] != b.shape[0]:
        raise ExpressionError(f"batch sizes differ: {a.label} has {a.shape[0]}, {b.label} has {b.shape[0]}")
    m, ka = a.shape[:0:-1] if transpose_a else a.shape[1:]
    kb, n = b.shape[:0:-1] if transpose_b else b.shape[1:]
    if ka != kb:
        a_dim = "rows (transpose_a)" if transpose_a else "columns"
        b_dim = "columns (transpose_b)" if transpose_b else "rows"
        raise ExpressionError(f"inner dimensions differ: {a.label} has {ka} {a_dim}, {b.label} has {kb} {b_dim}")
    left = a.read("b", "k", "i") if transpose_a else a.read("b", "i", "k")
    right = b.read("b", "j", "k") if transpose_b else b.read("b", "k", "j")
    return Scope(_its(("b", a.shape[0]), ("i", m), ("j", n)), _its(("k", ka)), left * right)


# --------------------------------------------------------------------------------------------
# Convolutions

_LAYOUTS = ("NCHW", "NHWC")


def _check_layout(layout: object) -> None:
    if layout not in _LAYOUTS:
        raise ExpressionError(f"layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")


def _conv_output_size(
    size: int, kernel: int, stride: int, pad: int, dilation: int, axis: str, end: int | None = None
) -> int:
    """PyTorch's output size: floor((size + 2*pad - dilation*(kernel-1) - 1) / stride) + 1; with
    ``end``, ``pad`` is the padding before the input and ``end`` after it."""
    span = dilation * (kernel - 1) + 1
    padded, what = (size + 2 * pad, f"2*padding {pad}") if end is None else (size + pad + end, f"padding {pad}+{end}")
    if padded < span:
        raise ExpressionError(
            f"the kernel does not fit: input {axis} {size} + {what} is less than the dilated kernel {axis} {span}"
        )
    return (padded - span) // stride + 1


@_builder("conv2d")
def conv2d(
    x: Operand,
    w: Operand,
    stride=1,
    padding=0,
    dilation=1,
    groups: int = 1,
    layout: str = "NCHW",
    padding_end=None,
) -> Scope:
    """2-D convolution (cross-correlation, as PyTorch), default names A (input) and K (weight).

    ``stride``, ``padding`` and ``dilation`` are an int or a (height, width) pair; padding is
    zero padding, which the notation gives for free (a read outside a tensor is 0).
    ``padding_end`` (an int or a pair) is the padding after the input where it differs from the
    padding before it (ONNX's asymmetric ``pads``).

    NCHW (PyTorch): input (N, C, H, W), weight (F, C/groups, R, S)::

        L n:N, f:F, h:OH, w:OW ; S c:C/groups, r:R, s:S ; A[n, c, h+r-1, w+s-1] * K[f, c, r, s]

    NHWC (OLLIE): input (N, H, W, C), weight (R, S, F, C/groups)::

        L n:N, h:OH, w:OW, f:F ; S c:C/groups, r:R, s:S ; A[n, h+r-1, w+s-1, c] * K[r, s, f, c]

    (both shown for padding 1). The input row is ``stride*h + dilation*r - padding``, printed
    minimally (stride 2 gives ``2*h+r-1``, dilation 2 gives ``h+2*r-2``). With groups, output
    channel ``f`` belongs to group ``f/Fg`` (floor division, Fg = F/groups) and reads input
    channel ``Cg*(f/Fg)+c`` for ``c`` over the group's Cg = C/groups channels.
    OH = floor((H + 2*padding - dilation*(R-1) - 1) / stride) + 1, as PyTorch.
    """
    _check_layout(layout)
    x, w = _operands(("x", x, "A"), ("w", w, "K"))
    _rank(x, 4, "input")
    _rank(w, 4, "weight")
    (sh, sw), (ph, pw) = _pair(stride, "stride", 1), _pair(padding, "padding", 0)
    dh, dw = _pair(dilation, "dilation", 1)
    groups = _int(groups, "groups", 1)
    if layout == "NCHW":
        (n, c, height, width), (f, cg, kh, kw) = x.shape, w.shape
    else:
        (n, height, width, c), (kh, kw, f, cg) = x.shape, w.shape
    if c % groups or f % groups:
        raise ExpressionError(
            f"groups={groups} must divide the input channels ({c}, input {x.label}) and the output "
            f"channels ({f}, weight {w.label})"
        )
    if cg * groups != c:
        raise ExpressionError(
            f"weight {w.label} has {cg} input channels per group, input {x.label} has {c} channels and groups={groups}"
        )
    eh, ew = (ph, pw) if padding_end is None else _pair(padding_end, "padding_end", 0)
    oh = _conv_output_size(height, kh, sh, ph, dh, "height", eh)
    ow = _conv_output_size(width, kw, sw, pw, dw, "width", ew)
    vn, vf, vh, vw, vc, vr, vs = (Var(v) for v in "nfhwcrs")
    row = _linear((sh, vh), (dh, vr), -ph)
    col = _linear((sw, vw), (dw, vs), -pw)
    # group g = f / Fg reads input channels g*Cg .. g*Cg + Cg - 1
    fg = f // groups
    channel = vc if groups == 1 else _linear((cg, vf if fg == 1 else vf // Lit(fg)), (1, vc))
    summation = _its(("c", cg), ("r", kh), ("s", kw))
    if layout == "NCHW":
        body = x.read(vn, channel, row, col) * w.read(vf, vc, vr, vs)
        return Scope(_its(("n", n), ("f", f), ("h", oh), ("w", ow)), summation, body)
    body = x.read(vn, row, col, channel) * w.read(vr, vs, vf, vc)
    return Scope(_its(("n", n), ("h", oh), ("w", ow), ("f", f)), summation, body)


def _single(value: object, what: str, minimum: int) -> int:
    """An int or a one-element list of ints, as 1-D convolutions take stride/padding/dilation."""
    if isinstance(value, (tuple, list)):
        if len(value) != 1:
            raise ExpressionError(f"{what} must be an integer or one integer in a list, got {value!r}")
        value = value[0]
    return _int(value, what, minimum)


@_builder("conv1d")
def conv1d(x: Operand, w: Operand, stride=1, padding=0, dilation=1, groups: int = 1, padding_end=None) -> Scope:
    """1-D convolution (cross-correlation, as PyTorch's ``conv1d``), default names A (input,
    (N, C, L)) and K (weight, (F, C/groups, S)); arguments as ``conv2d``'s, one size each::

        L n:N, f:F, w:OW ; S c:C/groups, s:S ; A[n, c, w+s-1] * K[f, c, s]

    (padding 1). With groups, output channel ``f`` reads input channel ``Cg*(f/Fg)+c``.
    """
    x, w = _operands(("x", x, "A"), ("w", w, "K"))
    _rank(x, 3, "input")
    _rank(w, 3, "weight")
    stride, padding = _single(stride, "stride", 1), _single(padding, "padding", 0)
    dilation, groups = _single(dilation, "dilation", 1), _int(groups, "groups", 1)
    (n, c, length), (f, cg, k) = x.shape, w.shape
    if c % groups or f % groups or cg * groups != c:
        raise ExpressionError(
            f"weight {w.label} has {cg} input channels per group and {f} output channels; input {x.label} has "
            f"{c} channels and groups={groups}"
        )
    end = padding if padding_end is None else _single(padding_end, "padding_end", 0)
    out = _conv_output_size(length, k, stride, padding, dilation, "length", end)
    vn, vf, vw, vc, vs = (Var(v) for v in "nfwcs")
    fg = f // groups
    channel = vc if groups == 1 else _linear((cg, vf if fg == 1 else vf // Lit(fg)), (1, vc))
    body = x.read(vn, channel, _linear((stride, vw), (dilation, vs), -padding)) * w.read(vf, vc, vs)
    return Scope(_its(("n", n), ("f", f), ("w", out)), _its(("c", cg), ("s", k)), body)


@_builder("conv_transpose2d")
def conv_transpose2d(x: Operand, w: Operand, stride=1, padding=0, output_padding=0, layout: str = "NCHW") -> Scope:
    """Transposed 2-D convolution (PyTorch's ``conv_transpose2d``), default names A and K.

    Written as a gather over the input: output row ``h`` sums input rows ``x`` with kernel row
    ``h + padding - stride*x``; kernel reads outside [0, R) are 0, so the index stays affine and
    no zero-stuffing is needed.

    NCHW (PyTorch): input (N, C, H, W), weight (C, F, R, S)::

        L n:N, f:F, h:OH, w:OW ; S c:C, x:H, y:W ; A[n, c, x, y] * K[c, f, h+1-2*x, w+1-2*y]

    NHWC (OLLIE): input (N, H, W, C), weight (R, S, F, C)::

        L n:N, h:OH, w:OW, f:F ; S x:H, y:W, c:C ; A[n, x, y, c] * K[h+1-2*x, w+1-2*y, f, c]

    (both shown for stride 2, padding 1). The summation iterators follow the input's axes.
    OH = (H-1)*stride - 2*padding + R + output_padding; output_padding must be below the stride.
    """
    _check_layout(layout)
    x, w = _operands(("x", x, "A"), ("w", w, "K"))
    _rank(x, 4, "input")
    _rank(w, 4, "weight")
    (sh, sw), (ph, pw) = _pair(stride, "stride", 1), _pair(padding, "padding", 0)
    oph, opw = _pair(output_padding, "output_padding", 0)
    if oph >= sh or opw >= sw:
        raise ExpressionError(f"output_padding ({oph}, {opw}) must be smaller than the stride ({sh}, {sw})")
    if layout == "NCHW":
        (n, c, height, width), (cw, f, kh, kw) = x.shape, w.shape
    else:
        (n, height, width, c), (kh, kw, f, cw) = x.shape, w.shape
    if c != cw:
        raise ExpressionError(f"weight {w.label} has {cw} input channels, input {x.label} has {c}")
    oh = (height - 1) * sh - 2 * ph + kh + oph
    ow = (width - 1) * sw - 2 * pw + kw + opw
    if oh < 1 or ow < 1:
        raise ExpressionError(f"padding ({ph}, {pw}) leaves an empty output ({oh}, {ow})")
    vn, vf, vh, vw, vc, vx, vy = (Var(v) for v in "nfhwcxy")
    krow = _linear((1, vh), ph, (-sh, vx))
    kcol = _linear((1, vw), pw, (-sw, vy))
    if layout == "NCHW":
        body = x.read(vn, vc, vx, vy) * w.read(vc, vf, krow, kcol)
        return Scope(_its(("n", n), ("f", f), ("h", oh), ("w", ow)), _its(("c", c), ("x", height), ("y", width)), body)
    body = x.read(vn, vx, vy, vc) * w.read(krow, kcol, vf, vc)
    return Scope(_its(("n", n), ("h", oh), ("w", ow), ("f", f)), _its(("x", height), ("y", width), ("c", c)), body)


# --------------------------------------------------------------------------------------------
# Band matrix products (Longformer attention)


def _band(width: object, dilation: object) -> tuple[int, int]:
    return _int(width, "width", 0), _int(dilation, "dilation", 1)


@_builder("g2bmm")
def g2bmm(q: Operand, k: Operand, width: int, dilation: int = 1) -> Scope:
    """General-to-band matrix product (Longformer attention scores), default names Q and K.

    ``q`` is (B, N, D) and ``k`` is (B, M, D) (M is usually N); for each query row ``i`` the
    ``2*width+1`` scores against key rows ``i + dilation*(j - width)``::

        L b:B, i:N, j:2W+1 ; S k:D ; Q[b, i, k] * K[b, i+d*j-d*W, k]

    with d the dilation and W the width; key rows outside [0, M) read 0.
    """
    q, k = _operands(("q", q, "Q"), ("k", k, "K"))
    width, dilation = _band(width, dilation)
    _rank(q, 3, "operand")
    _rank(k, 3, "operand")
    (b, n, d), (bk, _, dk) = q.shape, k.shape
    if b != bk:
        raise ExpressionError(f"batch sizes differ: {q.label} has {b}, {k.label} has {bk}")
    if d != dk:
        raise ExpressionError(f"feature sizes differ: {q.label} has {d}, {k.label} has {dk}")
    vb, vi, vj, vk = (Var(v) for v in "bijk")
    key_row = _linear((1, vi), (dilation, vj), -dilation * width)
    body = q.read(vb, vi, vk) * k.read(vb, key_row, vk)
    return Scope(_its(("b", b), ("i", n), ("j", 2 * width + 1)), _its(("k", d)), body)


@_builder("gbmm")
def gbmm(a: Operand, v: Operand, width: int, dilation: int = 1) -> Scope:
    """Band-to-general matrix product (Longformer attention times values), default names A, V.

    ``a`` is (B, N, 2W+1), band scores as ``g2bmm`` makes them, ``v`` is (B, M, D); the result
    is (B, N, D)::

        L b:B, i:N, k:D ; S j:2W+1 ; A[b, i, j] * V[b, i+d*j-d*W, k]

    with d the dilation and W the width: ``j`` walks the band, ``k`` the features (as in g2bmm).
    """
    a, v = _operands(("a", a, "A"), ("v", v, "V"))
    width, dilation = _band(width, dilation)
    _rank(a, 3, "operand")
    _rank(v, 3, "operand")
    (b, n, band), (bv, _, d) = a.shape, v.shape
    if b != bv:
        raise ExpressionError(f"batch sizes differ: {a.label} has {b}, {v.label} has {bv}")
    if band != 2 * width + 1:
        raise ExpressionError(f"{a.label} has a band of {band} but width {width} needs 2*width+1 = {2 * width + 1}")
    vb, vi, vj, vk = (Var(x) for x in "bijk")
    row = _linear((1, vi), (dilation, vj), -dilation * width)
    body = a.read(vb, vi, vj) * v.read(vb, row, vk)
    return Scope(_its(("b", b), ("i", n), ("k", d)), _its(("j", band)), body)


# --------------------------------------------------------------------------------------------
# Element-wise operations with numpy broadcasting


def _broadcast_shape(ops: list[_Operand]) -> tuple[int, ...]:
    rank = max((op.rank for op in ops), default=0)
    shape = [1] * rank
    for op in ops:
        for axis, size in enumerate(op.shape, start=rank - op.rank):
            if size != 1 and shape[axis] not in (1, size):
                shapes = " and ".join(f"{o.label} {o.shape}" for o in ops)
                raise ExpressionError(f"shapes do not broadcast: {shapes} differ in axis {axis - rank}")
            if size != 1:
                shape[axis] = size
    return tuple(shape)


def _map(fn: Callable[..., Scalar], values: list) -> Scope:
    """``L i0, i1, ... ; fn(reads)``: operands broadcast as numpy does, numbers are constants.

    An operand with fewer axes lines up with the trailing output axes; a size-1 axis is read at
    index 0 (whatever the output's size there, so a size-1 iterator never indexes an operand).
    """
    ops = [v for v in values if isinstance(v, _Operand)]
    shape = _broadcast_shape(ops)
    names = [f"i{axis}" for axis in range(len(shape))]

    def read(value):
        if not isinstance(value, _Operand):
            return Num(value)
        lead = len(shape) - value.rank
        return value.read(*(Lit(0) if size == 1 else Var(names[lead + k]) for k, size in enumerate(value.shape)))

    return Scope(_its(*zip(names, shape)), (), fn(*(read(v) for v in values)))


def _elementwise_operands(specs) -> list:
    """Operands for element-wise ops; a Python number stays a number (a constant)."""
    numbers = {param for param, value, _ in specs if _is_number(value)}
    # default names go to the tensor operands in order: 1.5 - (2, 3) reads A, not B
    defaults = iter(default for _, _, default in specs)
    ops = iter(_operands(*((param, value, next(defaults)) for param, value, _ in specs if param not in numbers)))
    return [float(value) if param in numbers else next(ops) for param, value, _ in specs]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@_builder("unary")
def unary(fn: str, x: Operand) -> Scope:
    """``L i0:.., i1:.., ... ; fn(A[i0, i1, ...])`` for fn a unary function of the notation (relu,
    exp, log, tanh, sigmoid, erf, sqrt, rsqrt, abs, floor, ceil, neg: ``neg`` prints as
    ``-A[...]``); default name A."""
    if fn not in UNARY_FUNCTIONS:
        raise ExpressionError(f"unknown function {fn!r}; known: {', '.join(sorted(UNARY_FUNCTIONS))}")
    (x,) = _operands(("x", x, "A"))
    return _map(lambda a: Unary(fn, a), [x])


@_builder("relu")
def relu(x: Operand) -> Scope:
    """``L i0, ... ; relu(A[i0, ...])``: max(x, 0) element-wise."""
    return unary("relu", x)


@_builder("exp")
def exp(x: Operand) -> Scope:
    """``L i0, ... ; exp(A[i0, ...])``."""
    return unary("exp", x)


@_builder("tanh")
def tanh(x: Operand) -> Scope:
    """``L i0, ... ; tanh(A[i0, ...])``."""
    return unary("tanh", x)


@_builder("sin")
def sin(x: Operand) -> Scope:
    """``L i0, ... ; sin(A[i0, ...])`` (rotary position tables computed at run time)."""
    return unary("sin", x)


@_builder("cos")
def cos(x: Operand) -> Scope:
    """``L i0, ... ; cos(A[i0, ...])``."""
    return unary("cos", x)


@_builder("sigmoid")
def sigmoid(x: Operand) -> Scope:
    """``L i0, ... ; sigmoid(A[i0, ...])``: 1 / (1 + exp(-x)) element-wise."""
    return unary("sigmoid", x)


@_builder("sqrt")
def sqrt(x: Operand) -> Scope:
    """``L i0, ... ; sqrt(A[i0, ...])``."""
    return unary("sqrt", x)


@_builder("erf")
def erf(x: Operand) -> Scope:
    """``L i0, ... ; erf(A[i0, ...])``: the error function element-wise."""
    return unary("erf", x)


@_builder("log")
def log(x: Operand) -> Scope:
    """``L i0, ... ; log(A[i0, ...])``: the natural logarithm element-wise."""
    return unary("log", x)


@_builder("absolute")
def absolute(x: Operand) -> Scope:
    """``L i0, ... ; abs(A[i0, ...])``."""
    return unary("abs", x)


@_builder("rsqrt")
def rsqrt(x: Operand) -> Scope:
    """``L i0, ... ; rsqrt(A[i0, ...])``: 1 / sqrt(x) element-wise."""
    return unary("rsqrt", x)


@_builder("floor")
def floor(x: Operand) -> Scope:
    """``L i0, ... ; floor(A[i0, ...])``."""
    return unary("floor", x)


@_builder("ceil")
def ceil(x: Operand) -> Scope:
    """``L i0, ... ; ceil(A[i0, ...])``."""
    return unary("ceil", x)


@_builder("gelu")
def gelu(x: Operand, approximate: str = "none") -> Scope:
    """GELU element-wise: ``0.5 * x * (1 + erf(x / sqrt(2)))``, or with ``approximate="tanh"``
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))`` (as PyTorch and ONNX define them)."""
    (x,) = _operands(("x", x, "A"))
    if approximate == "none":
        return _map(lambda a: Num(0.5) * a * (Num(1.0) + Unary("erf", a * Num(1 / math.sqrt(2)))), [x])
    if approximate == "tanh":
        inner = lambda a: Num(math.sqrt(2 / math.pi)) * (a + Num(0.044715) * a * a * a)  # noqa: E731
        return _map(lambda a: Num(0.5) * a * (Num(1.0) + Unary("tanh", inner(a))), [x])
    raise ExpressionError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


_BINARY_OPS = ("+", "-", "*", "/", "max", "min", "pow", *COMPARISONS, "select")


@_builder("binary")
def binary(op: str, a: Operand | float, b: Operand | float) -> Scope:
    """``L i0:.., ... ; A[..] op B[..]`` for op in + - * / max min pow, a comparison or select
    (a function prints ``max(A[..], B[..])``), with numpy broadcasting; default names A and B.

    Shapes align on their trailing axes; a missing leading axis or a size-1 axis broadcasts (it
    is read at index 0), e.g. (3, 1) + (4,) gives ``L i0:3, i1:4 ; A[i0, 0] + B[i1]``. Either
    operand may be a Python number, which becomes a constant.
    """
    if op not in _BINARY_OPS:
        raise ExpressionError(f"unknown operator {op!r}; known: {', '.join(_BINARY_OPS)}")
    values = _elementwise_operands([("a", a, "A"), ("b", b, "B")])
    if not any(isinstance(v, _Operand) for v in values):
        raise ExpressionError("at least one operand must be a tensor, a scope or a shape")
    return _map(lambda x, y: Binary(op, x, y), values)


@_builder("add")
def add(a: Operand | float, b: Operand | float) -> Scope:
    """``a + b`` element-wise with broadcasting (see ``binary``)."""
    return binary("+", a, b)


@_builder("sub")
def sub(a: Operand | float, b: Operand | float) -> Scope:
    """``a - b`` element-wise with broadcasting (see ``binary``)."""
    return binary("-", a, b)


@_builder("mul")
def mul(a: Operand | float, b: Operand | float) -> Scope:
    """``a * b`` element-wise with broadcasting (see ``binary``)."""
    return binary("*", a, b)


@_builder("div")
def div(a: Operand | float, b: Operand | float) -> Scope:
    """``a / b`` element-wise with broadcasting (see ``binary``)."""
    return binary("/", a, b)


@_builder("maximum")
def maximum(a: Operand | float, b: Operand | float) -> Scope:
    """``max(a, b)`` element-wise with broadcasting (see ``binary``)."""
    return binary("max", a, b)


@_builder("minimum")
def minimum(a: Operand | float, b: Operand | float) -> Scope:
    """``min(a, b)`` element-wise with broadcasting (see ``binary``)."""
    return binary("min", a, b)


@_builder("power")
def power(a: Operand | float, b: Operand | float) -> Scope:
    """``pow(a, b)`` element-wise with broadcasting (see ``binary``)."""
    return binary("pow", a, b)


@_builder("compare")
def compare(op: str, a: Operand | float, b: Operand | float) -> Scope:
    """A mask: ``op(a, b)`` is 1.0 where the comparison holds and 0.0 elsewhere, for op in less,
    less_equal, greater, greater_equal, equal, with broadcasting (see ``binary``).

    Against an infinite number (attention's ``scores == -inf``): constants are finite, an
    infinity clamped to the float32 range (``where``), so a value past half of it is taken for
    the infinity (``x == -inf`` is ``x <= -FLOAT32_MAX/2``; ``x >= -inf`` always holds)."""
    if op not in COMPARISONS:
        raise ExpressionError(f"unknown comparison {op!r}; known: {', '.join(COMPARISONS)}")
    if _is_number(b) and math.isinf(b):
        return _against_infinity(op, a, b)
    if _is_number(a) and math.isinf(a):
        return _against_infinity(_MIRRORED[op], b, a)
    return binary(op, a, b)


FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
_MIRRORED = {  # a op b is b mirrored(op) a
    "less": "greater",
    "less_equal": "greater_equal",
    "greater": "less",
    "greater_equal": "less_equal",
    "equal": "equal",
}


def _against_infinity(op: str, x: Operand, infinity: float) -> Scope:
    """``x op infinity`` where the program holds an infinity as a value past ``FLOAT32_MAX / 2``:
    a comparison with that threshold, or a constant mask where it always or never holds."""
    below = infinity < 0
    always, never = {("greater_equal", True), ("less_equal", False)}, {("less", True), ("greater", False)}
    if (op, below) in always | never:
        return _map(lambda _: Num(float((op, below) in always)), _elementwise_operands([("a", x, "A")]))
    as_threshold = {"equal": "less_equal" if below else "greater_equal"}.get(op, op)
    return binary(as_threshold, x, -FLOAT32_MAX / 2 if below else FLOAT32_MAX / 2)


@_builder("where")
def where(condition: Operand | float, a: Operand | float, b: Operand | float) -> Scope:
    """``a`` where ``condition`` (a 0/1 mask) is 1, ``b`` where it is 0, with broadcasting:
    ``select(c, a) + select(1 - c, b)`` (default names C, A, B), exact: the branch not chosen
    never reaches the result, even an infinity or a NaN (``where(d != 0, n / d, 0)``). A constant
    branch is clamped to the finite float32 range, as constants are finite (a ``-inf`` mask fill
    becomes -3.4e38)."""
    values = _elementwise_operands([("condition", condition, "C"), ("a", a, "A"), ("b", b, "B")])
    if not any(isinstance(v, _Operand) for v in values):
        raise ExpressionError("at least one operand must be a tensor, a scope or a shape")
    c, *branches = values
    values = [c, *(min(max(v, -FLOAT32_MAX), FLOAT32_MAX) if isinstance(v, float) else v for v in branches)]
    return _map(_selected, values)


def _selected(c: Scalar, a: Scalar, b: Scalar) -> Scalar:
    """``select(c, a) + select(1 - c, b)``, less a term whose branch is the constant 0."""
    terms = [Binary("select", mask, x) for mask, x in ((c, a), (Num(1.0) - c, b)) if x != Num(0.0)]
    return Num(0.0) if not terms else terms[0] if len(terms) == 1 else terms[0] + terms[1]


@_builder("clip")
def clip(x: Operand, lo: float | None = None, hi: float | None = None) -> Scope:
    """``min(max(x, lo), hi)`` element-wise; a bound that is None is left out."""
    (x,) = _operands(("x", x, "A"))

    def clipped(a):
        a = Binary("max", a, Num(lo)) if lo is not None else a
        return Binary("min", a, Num(hi)) if hi is not None else a

    return _map(clipped, [x])


# --------------------------------------------------------------------------------------------
# Reductions, softmax, layer norm


def _axes(axes: object, rank: int) -> tuple[int, ...]:
    """Normalised, sorted axes from an int, a tuple of ints (negative counts from the end) or
    None (every axis)."""
    if axes is None:
        return tuple(range(rank))
    raw = axes if isinstance(axes, (tuple, list)) else (axes,)
    result = []
    for axis in raw:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ExpressionError(f"axis {axis!r} is not an integer")
        if not -rank <= axis < rank:
            raise ExpressionError(f"axis {axis} is out of range for rank {rank}")
        if axis % rank in result:
            raise ExpressionError(f"axis {axis} is repeated in {tuple(raw)}")
        result.append(axis % rank)
    return tuple(sorted(result))


def _reduce(
    x: _Operand, axes: tuple[int, ...], keepdims: bool, kind: str, body: Callable[[Scalar], Scalar] = lambda a: a
) -> Scope:
    """``L i<kept> ; S r<reduced> ; body(A[...])``; keepdims keeps a size-1 ``i<axis>``."""
    traversal = [
        (f"i{axis}", 1 if axis in axes else size) for axis, size in enumerate(x.shape) if keepdims or axis not in axes
    ]
    summation = [(f"r{axis}", x.shape[axis]) for axis in axes]
    read = x.read(*(f"r{axis}" if axis in axes else f"i{axis}" for axis in range(x.rank)))
    return Scope(_its(*traversal), _its(*summation), body(read), kind)


@_builder("reduce_sum")
def reduce_sum(x: Operand, axes=None, keepdims: bool = False) -> Scope:
    """Sum over ``axes`` (an int, a tuple, negative counts from the end; None for all), default
    name A. Kept axes traverse as ``i<axis>``, reduced ones sum as ``r<axis>``::

        reduce_sum((2, 3, 4), 1)  ->  L i0:2, i2:4 ; S r1:3 ; A[i0, r1, i2]

    ``keepdims`` keeps each reduced axis as a size-1 output axis (``i1:1``), as numpy does.
    """
    (x,) = _operands(("x", x, "A"))
    return _reduce(x, _axes(axes, x.rank), keepdims, "sum")


@_builder("cumsum")
def cumsum(x: Operand, axis: int, exclusive: bool = False, reverse: bool = False) -> Scope:
    """Running sum along ``axis`` (ONNX CumSum, torch's cumsum), default name A: a sum over the
    distance ``d`` back along the axis, reads before its start being 0::

        cumsum((2, 5), 1)  ->  L i0:2, i1:5 ; S d:5 ; A[i0, i1-d]

    ``exclusive`` leaves the element itself out (``A[i0, i1-d-1]``), ``reverse`` runs from the
    end (``A[i0, i1+d]``).
    """
    (x,) = _operands(("x", x, "A"))
    (axis,) = _axes(axis, x.rank)
    names = [f"i{k}" for k in range(x.rank)]
    step = _linear((1, Var(names[axis])), (-1 if not reverse else 1, Var("d")), (1 if reverse else -1) * int(exclusive))
    read = x.read(*(step if k == axis else names[k] for k in range(x.rank)))
    return Scope(_its(*zip(names, x.shape)), _its(("d", x.shape[axis])), read)


@_builder("reduce_max")
def reduce_max(x: Operand, axes=None, keepdims: bool = False) -> Scope:
    """Maximum over ``axes``, like ``reduce_sum`` but printed with ``M`` (reduce="max")::

    reduce_max((2, 3), -1)  ->  L i0:2 ; M r1:3 ; A[i0, r1]
    """
    (x,) = _operands(("x", x, "A"))
    return _reduce(x, _axes(axes, x.rank), keepdims, "max")


@_builder("reduce_mean")
def reduce_mean(x: Operand, axes=None, keepdims: bool = False) -> Scope:
    """Mean over ``axes``: the sum of each element times the constant 1/n::

    reduce_mean((2, 4), 1)  ->  L i0:2 ; S r1:4 ; A[i0, r1] * 0.25
    """
    (x,) = _operands(("x", x, "A"))
    axes = _axes(axes, x.rank)
    scale = Num(1.0 / math.prod(x.shape[a] for a in axes))
    return _reduce(x, axes, keepdims, "sum", lambda a: a * scale)


@_builder("reduce_norm")
def reduce_norm(x: Operand, axes=None, ord: int = 2, keepdims: bool = False) -> Scope:
    """The L1 or L2 norm over ``axes`` (ONNX ReduceL1/ReduceL2, torch's vector_norm), default
    name A: ``S |A|`` for ord 1, ``sqrt(S A*A)`` for ord 2::

        reduce_norm((2, 4), 1)  ->  L i0:2 ; sqrt({ L i0:2 ; S r1:4 ; A[i0, r1] * A[i0, r1] }[i0])
    """
    (x,) = _operands(("x", x, "A"))
    if ord not in (1, 2):
        raise ExpressionError(f"reduce_norm: ord {ord!r} is not 1 or 2")
    axes = _axes(axes, x.rank)
    if ord == 1:
        return _reduce(x, axes, keepdims, "sum", lambda a: Unary("abs", a))
    return sqrt(_reduce(x, axes, keepdims, "sum", lambda a: a * a))


@_builder("softmax")
def softmax(x: Operand, axis: int = -1) -> Scope:
    """Numerically stable softmax along ``axis``, default name A, as four scopes::

        m = reduce_max(x, axis, keepdims)      L i0:N, i1:1 ; M r1:D ; A[i0, r1]
        e = exp(x - m)                         L i0:N, i1:D ; exp(A[i0, i1] - {m}[i0, 0])
        s = reduce_sum(e, axis, keepdims)      L i0:N, i1:1 ; S r1:D ; {e}[i0, r1]
        result = e / s                         L i0:N, i1:D ; {e}[i0, i1] / {s}[i0, 0]

    (shown for a rank-2 input and axis 1). The reductions keep the axis so every nested read
    has at least one index, which the notation needs, whatever the rank.
    """
    if isinstance(axis, (tuple, list)):
        raise ExpressionError(f"softmax takes a single axis, got {axis!r}")
    (x,) = _operands(("x", x, "A"))
    axes = _axes(axis, x.rank)
    peak = _Operand(_reduce(x, axes, True, "max"), "max")
    shifted = _Operand(_map(lambda a, m: Unary("exp", a - m), [x, peak]), "exp")
    total = _Operand(_reduce(shifted, axes, True, "sum"), "sum")
    return _map(lambda e, s: e / s, [shifted, total])


@_builder("log_softmax")
def log_softmax(x: Operand, axis: int = -1) -> Scope:
    """``log(softmax(x))`` along ``axis``, stable: ``x - m - log(sum(exp(x - m)))`` with m the
    maximum along the axis (the max and the sum are scopes, as in ``softmax``); default name A."""
    if isinstance(axis, (tuple, list)):
        raise ExpressionError(f"log_softmax takes a single axis, got {axis!r}")
    (x,) = _operands(("x", x, "A"))
    axes = _axes(axis, x.rank)
    peak = _Operand(_reduce(x, axes, True, "max"), "max")
    total = _Operand(
        _reduce(_Operand(_map(lambda a, m: Unary("exp", a - m), [x, peak]), "exp"), axes, True, "sum"), "sum"
    )
    return _map(lambda a, m, s: a - m - Unary("log", s), [x, peak, total])


@_builder("layer_norm")
def layer_norm(
    x: Operand, axes=-1, eps: float = 1e-5, weight: Operand | None = None, bias: Operand | None = None
) -> Scope:
    """Layer normalisation over trailing ``axes`` (PyTorch's ``layer_norm``, biased variance),
    default names A (input), W (weight), B (bias)::

        mean = reduce_mean(x, axes, keepdims)      L i0:N, i1:1 ; S r1:D ; A[i0, r1] * (1/D)
        d = x - mean                               L i0:N, i1:D ; A[i0, i1] - {mean}[i0, 0]
        var = mean of d*d (keepdims)               L i0:N, i1:1 ; S r1:D ; {d}[i0, r1] * {d}[i0, r1] * (1/D)
        result                                     L i0:N, i1:D ; {d}[i0, i1] / sqrt({var}[i0, 0] + eps) * W[i1] + B[i1]

    (shown for a rank-2 input and axes -1). ``weight`` and ``bias`` are optional and have the
    normalised shape (the sizes of ``axes``).
    """
    specs = [("x", x, "A")] + [(p, v, d) for p, v, d in (("weight", weight, "W"), ("bias", bias, "B")) if v is not None]
    ops = dict(zip((p for p, _, _ in specs), _operands(*specs)))
    x = ops["x"]
    axes = _axes(axes, x.rank)
    if axes != tuple(range(x.rank - len(axes), x.rank)):
        raise ExpressionError(f"axes {axes} must be the trailing axes of the input (shape {x.shape})")
    if not _is_number(eps) or not math.isfinite(eps) or eps < 0:
        raise ExpressionError(f"eps must be a non-negative number, got {eps!r}")
    normalized = x.shape[x.rank - len(axes) :]
    for param in ("weight", "bias"):
        if param in ops and ops[param].shape != normalized:
            raise ExpressionError(
                f"{param} {ops[param].label} has shape {ops[param].shape}, the normalised shape is {normalized}"
            )
    scale = Num(1.0 / math.prod(normalized))
    mean = _Operand(_reduce(x, axes, True, "sum", lambda a: a * scale), "mean")
    centered = _Operand(_map(lambda a, m: a - m, [x, mean]), "centered")
    var = _Operand(_reduce(centered, axes, True, "sum", lambda d: d * d * scale), "variance")

    def normalise(d, v, *affine):
        out = d / Unary("sqrt", v + Num(float(eps)))
        if "weight" in ops:
            out = out * affine[0]
        if "bias" in ops:
            out = out + affine[-1]
        return out

    extras = [ops[p] for p in ("weight", "bias") if p in ops]
    return _map(normalise, [centered, var] + extras)


@_builder("group_norm")
def group_norm(
    x: Operand, groups: int, eps: float = 1e-5, weight: Operand | None = None, bias: Operand | None = None
) -> Scope:
    """Group normalisation (PyTorch's ``group_norm``): the channels (axis 1) of each sample in
    ``groups`` groups of Cg = C/groups, each group normalised over its channels and the axes
    after them (biased variance), then ``weight[c]`` and ``bias[c]`` (optional, shape (C,));
    default names A, W, B::

        mean = L n:N, g:G ; S c:Cg, s:S ; A[n, Cg*g+c, s] * (1/(Cg*S))
        d    = L n:N, c:C, s:S ; A[n, c, s] - {mean}[n, c/Cg]
        var  = L n:N, g:G ; S c:Cg, s:S ; {d}[n, Cg*g+c, s] * {d}[n, Cg*g+c, s] * (1/(Cg*S))
        out  = L n:N, c:C, s:S ; {d}[n, c, s] / sqrt({var}[n, c/Cg] + eps) * W[c] + B[c]

    (one spatial axis shown). InstanceNormalization is ``groups = C``.
    """
    specs = [("x", x, "A")] + [(p, v, d) for p, v, d in (("weight", weight, "W"), ("bias", bias, "B")) if v is not None]
    ops = dict(zip((p for p, _, _ in specs), _operands(*specs)))
    x = ops["x"]
    if x.rank < 2:
        raise ExpressionError(f"input {x.label} must have a channel axis (rank 2 or more), got shape {x.shape}")
    groups = _int(groups, "groups", 1)
    channels, spatial = x.shape[1], x.shape[2:]
    if channels % groups:
        raise ExpressionError(f"groups={groups} must divide the {channels} channels of input {x.label}")
    if not _is_number(eps) or not math.isfinite(eps) or eps < 0:
        raise ExpressionError(f"eps must be a non-negative number, got {eps!r}")
    for param in ("weight", "bias"):
        if param in ops and ops[param].shape != (channels,):
            raise ExpressionError(f"{param} {ops[param].label} has shape {ops[param].shape}, expected ({channels},)")
    cg = channels // groups
    scale = Num(1.0 / (cg * math.prod(spatial)))
    n, c, g = Var("n"), Var("c"), Var("g")
    axes = tuple(Var(f"s{k}") for k in range(len(spatial)))
    over = _its(*((f"s{k}", size) for k, size in enumerate(spatial)))
    member = _linear((cg, g), (1, c))  # channel c of group g
    group = c if cg == 1 else c // Lit(cg)  # the group of channel c
    whole = _its(("n", x.shape[0]), ("c", channels)) + over
    per_group, within = _its(("n", x.shape[0]), ("g", groups)), _its(("c", cg)) + over
    mean = Scope(per_group, within, x.read(n, member, *axes) * scale)
    centred = Scope(whole, (), x.read(n, c, *axes) - mean[n, group])
    var = Scope(per_group, within, centred[(n, member) + axes] * centred[(n, member) + axes] * scale)
    out = centred[(n, c) + axes] / Unary("sqrt", var[n, group] + Num(float(eps)))
    if "weight" in ops:
        out = out * ops["weight"].read(c)
    if "bias" in ops:
        out = out + ops["bias"].read(c)
    return Scope(whole, (), out)


# --------------------------------------------------------------------------------------------
# einsum


def _default_names():
    """A, B, C, ... skipping the notation's keywords (L, M, S), then A1, B1, ..."""
    letters = [chr(c) for c in range(ord("A"), ord("Z") + 1) if chr(c) not in KEYWORDS]
    round_ = 0
    while True:
        for letter in letters:
            yield letter if round_ == 0 else f"{letter}{round_}"
        round_ += 1


def _iterator_name(letter: str) -> str:
    # L, S and M are keywords of the notation; a trailing underscore keeps the letter visible
    return f"{letter}_" if letter in KEYWORDS else letter


def _parse_subscripts(subscripts: object, count: int) -> tuple[list[str], str]:
    """Operand subscripts and the output subscript (numpy's implicit output when no '->')."""
    if not isinstance(subscripts, str):
        raise ExpressionError(f"subscripts must be a string, got {subscripts!r}")
    text = "".join(subscripts.split())
    if "..." in text:
        raise ExpressionError("ellipsis ('...') is not supported")
    inputs, arrow, output = text.partition("->")
    if "->" in output:
        raise ExpressionError(f"subscripts {subscripts!r} have more than one '->'")
    terms = inputs.split(",")
    for term in terms + [output]:
        bad = [ch for ch in term if not ch.isascii() or not ch.isalpha()]
        if bad:
            raise ExpressionError(f"subscript character {bad[0]!r} is not a letter")
    if len(terms) != count:
        raise ExpressionError(f"subscripts {subscripts!r} name {len(terms)} operand(s), {count} given")
    if not arrow:
        # numpy: the letters that appear exactly once, in alphabetical (ASCII) order
        letters = "".join(terms)
        output = "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    return terms, output


@_builder("einsum")
def einsum(subscripts: str, *operands: Operand) -> Scope:
    """``np.einsum`` as a scope: one iterator per subscript letter (default names A, B, C, ...)::

        einsum("ij,jk->ik", (M, K), (K, N))  ->  L i:M, k:N ; S j:K ; A[i, j] * B[j, k]

    The output letters traverse in output order, the other letters sum (in order of first
    appearance), and the body is the product of the operands read at their letters. Without
    '->' the output is numpy's: the letters appearing once, in alphabetical order. A letter
    repeated in one operand reads its diagonal ("ii->i"). A letter must have the same size
    everywhere (numpy's broadcasting of size-1 axes is not done); ellipses are not supported.
    """
    if not operands:
        raise ExpressionError("at least one operand is needed")
    terms, output = _parse_subscripts(subscripts, len(operands))
    names = _default_names()
    ops = _operands(*((f"operand {k}", value, next(names)) for k, value in enumerate(operands)))
    sizes: dict[str, tuple[int, str]] = {}  # letter -> (size, where it was first seen)
    for op, term in zip(ops, terms):
        if len(term) != op.rank:
            raise ExpressionError(
                f"subscript {term!r} has {len(term)} letter(s) but {op.label} has rank {op.rank} (shape {op.shape})"
            )
        for axis, (letter, size) in enumerate(zip(term, op.shape)):
            where = f"{op.label} (axis {axis})"
            seen = sizes.setdefault(letter, (size, where))
            if seen[0] != size:
                raise ExpressionError(f"letter {letter!r} has size {seen[0]} in {seen[1]} but {size} in {where}")
    if len(set(output)) != len(output):
        raise ExpressionError(f"output subscript {output!r} repeats a letter")
    missing = [ch for ch in output if ch not in sizes]
    if missing:
        raise ExpressionError(f"output letter {missing[0]!r} appears in no operand")
    summed = [ch for ch in dict.fromkeys("".join(terms)) if ch not in output]
    body = None
    for op, term in zip(ops, terms):
        read = op.read(*(Var(_iterator_name(ch)) for ch in term))
        body = read if body is None else body * read
    traversal = _its(*((_iterator_name(ch), sizes[ch][0]) for ch in output))
    return Scope(traversal, _its(*((_iterator_name(ch), sizes[ch][0]) for ch in summed)), body)
