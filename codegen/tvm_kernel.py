"""eOperators: any expression ``Scope`` compiled into a CPU kernel with TVM (DESIGN.md, "Instantiation").

``compile_scope(scope)`` lowers the scope to TVM tensor expressions, applies a loop schedule and
compiles it with LLVM for the host CPU. The lowering reproduces ``rewriter.semantics.evaluate``:

* every scope is a ``tvm.te.compute`` stage over its own box (element ``[x - lo]`` holds iterator value
  ``x``); a nested scope is a closed term, so equal nested scopes share one stage, evaluated once;
* a nested scope that only re-indexes (no summation, body one access) is inlined: its indices are
  substituted into the read, and "inside its box" joins the read's bounds conditions;
* a nested scope that sums nothing, read once in its stage and injectively over the stage's box
  (each element at one point of its traversal and summation), is composed into that stage's
  loop nest: its body is substituted at the read, 0 outside its box (SOUFFLE's vertical
  transformation of one-relies-on-one expressions: nothing is computed twice, no buffer between;
  softmax's exp inside its sum);
* a read outside a tensor's (or stage's) bounds is 0. Exact index bounds (``index_bounds``) drop
  the conditions that always hold and the reads that are always outside; what remains reads a
  zero-padded copy of the source (a padding stage: loads stay unconditional, so they vectorise)
  or, without padding or when padding would be too large, a guarded load (``if_then_else``);
* a summing stage whose vector lanes would read k apart (a convolution of stride k) reads a copy
  of its input deinterleaved by k (``_Lowering._split``), contiguous along the lanes;
* a summing stage whose lanes' extent no half vector divides (197 tokens) is computed over whole
  vectors and register tiles and its box copied out (``_widened``).

Compiled kernels are cached on disk, keyed by a content hash (see ``cache_dir``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import itertools
import math
import os
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from rewriter.index import (
    LinearForm,
    affine_coefficients,
    affine_index,
    index_bounds,
    is_injective,
    normalize,
    row_major,
    to_index,
)
from rewriter.ir import (
    Access,
    Binary,
    ExpressionError,
    Index,
    IndexNeg,
    IndexOp,
    Iterator,
    Lit,
    Num,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
    accesses,
    constant_value,
    index_vars,
    nested_scopes,
    rename_tensors,
    substitute,
    substitute_index,
    tensor_shapes,
)

from .merged import merge_loops

_LOWERING = ("tvm_kernel.py", "merged.py")  # the modules whose source makes a kernel's machine code


class _Deferred:
    """A module imported on first attribute access (``before_import()`` runs just before). TVM
    takes seconds to import (and its FFI imports torch where torch is installed), so
    ``import rewriter`` stays fast and torch-free until the first kernel is compiled."""

    def __init__(self, name: str, before_import: Callable[[], None] = lambda: None):
        self._name, self._module, self._before_import = name, None, before_import

    def __getattr__(self, attribute: str):
        if self._module is None:
            self._before_import()
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)


def physical_cores() -> int:
    """The physical cores this process may run on (hardware threads of one core count once)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(tuple((topology / f).read_text().strip() for f in ("physical_package_id", "core_id")))
        except OSError:
            cores.add(("cpu", str(cpu)))  # no topology: count the CPU itself
    return max(1, len(cores))


def _one_thread_per_core() -> None:
    """TVM's thread pool takes half the CPUs unless told (it assumes two hardware threads per
    core), so on a 2-core machine without them every kernel ran on one core, against libraries
    that use both. It reads ``TVM_NUM_THREADS`` when it starts; where the user set it, that
    still decides."""
    os.environ.setdefault("TVM_NUM_THREADS", str(physical_cores()))


tvm = _Deferred("tvm", _one_thread_per_core)

# The source of this module and of the loop merging it lowers through is part of every cache
# key: a change to the lowering never loads a kernel compiled by the old one.
_SOURCE_HASH = hashlib.sha256(b"".join(Path(__file__).with_name(n).read_bytes() for n in _LOWERING)).hexdigest()
# The code generators' version, part of every measured time's key (codegen.program's signatures):
# every module of this package, whose code makes what a kernel runs (the lowering, the packed and
# transposed products' layouts, the panels), so a time is reused only by the code it measured.
CODEGEN_VERSION = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
).hexdigest()[:16]
_INT32 = 2**31 - 1
PAD_EVERY = "every"  # lower_to_te's pad: every zero-padded read a padding stage (the GPU schedules)


class CodegenError(RuntimeError):
    """A scope that TVM could not lower or compile; the message names the scope."""


# Steps of a register tile's summation loop ahead at which it prefetches the weight it reads
# from panels (``Schedule.prefetch``, ``_prefetching``). A weight streams from memory once per
# run of a model; the first tile to read each part of it waits on memory, and the hardware's
# prefetchers, which stop at page boundaries, leave part of that wait. Measured here (Intel
# Xeon, family 6 model 167, AVX-512, 48 KiB L1; products in panels with their bias and ReLU,
# weights cold, ms, none / 16 steps ahead / 32, onnxruntime's MatMul, Add and Relu in
# brackets): 32x3072 @ 3072x768 in rows of two vectors 1.03 / - / 0.85, of six (``wide_tile``)
# 0.95 / 0.87 / 0.87 (0.87); 32x768 @ 768x3072 six wide 0.93 / 0.88 / 0.90 (0.84-1.00);
# 32x768 @ 768x768 0.26 / 0.22 / 0.23 (0.29); 197x768 @ 768x3072 3.60 / 3.41 / 3.42 (3.82);
# 197x3072 @ 3072x768 3.62 / 3.27 / 3.25 (3.37); 64 steps ahead 3.46 and 3.31; the next block
# of a six-wide tile's summation (128 steps) 0.99 and 1.03, slower than none.
_PREFETCH_STEPS = 16


@dataclass(frozen=True)
class Schedule:
    """Loop schedule parameters applied to every stage of a kernel (a tuner enumerates these).

    Per stage, vector lanes go along the innermost traversal loop, or along a summation loop
    that the reads run along contiguously where traversal lanes would gather (rfactor: partial
    sums in registers, summed across lanes at the end). A register tile of ``tile`` rows of
    lanes sits inside the summation loops, and the outer traversal loops are fused into one
    parallel loop. A stage without summation whose lanes gather (a transposition) is blocked:
    ``block`` rows of the loop its reads run along go just outside the lanes, so each cache
    line read serves ``block`` rows before it is evicted. A schedule that a TVM primitive
    refuses for some stage falls back to the plain loops for the whole kernel, which are always
    sound.
    """

    vector: int | None = None  # vector lanes; None: the target's width, 1: none
    # unrolled rows of vectors inside the reduction loops (register blocking); 1: none; None: 16
    # where a vector holds 16 lanes (float32 on AVX-512, which has 32 vector registers), else 8
    # (AVX2's 16 registers); rows two vectors wide: 14 and 6 (``_tile_rows``)
    tile: int | None = None
    # vectors per row of the register tile, each row's broadcast read feeding them all; None: 2
    # where a vector holds 8 lanes or more and an even number of vectors is left (one where that
    # tiles worse, three on AVX2 where that makes more accumulators, ``_register_tile``), else 1
    width: int | None = None
    parallel: int | None = None  # outer spatial loops fused into the parallel loop; None: enough, 0: serial
    unroll: int = 1  # unroll factor of the innermost summation loop (with traversal lanes)
    pad: bool = True  # reads whose bounds checks vary along vector lanes use zero-padded copies
    reduction_vector: bool | None = None  # lanes along a summation loop; None: where traversal lanes would gather
    block: int = (
        32  # a summation-free stage whose lanes gather: rows of the loop its reads run along, inside (transposes)
    )
    # weights the kernel reads from panels, (tensor, its dimension along the lanes, the panels'
    # width): the caller lays each out once (``panel_layout``) and passes that in its place
    # (``codegen.packed``)
    panels: tuple[tuple[str, int, int], ...] = ()
    # steps of the summation loop per block, the loops over the tiles that share the vector
    # operand's block inside it; None: where the tile's broadcast reads step across lines
    # (``_summation_block``), 1: none
    kblock: int | None = None
    # steps of the summation loop ahead at which the register tile prefetches what it reads from
    # ``panels`` (``_prefetching``); 0: none
    prefetch: int = _PREFETCH_STEPS

    def __post_init__(self):  # a saved schedule's panels come back as lists
        object.__setattr__(self, "panels", tuple((str(n), int(d), int(w)) for n, d, w in self.panels))


DEFAULT_SCHEDULE = Schedule()


def vector_lanes(dtype: str = "float32") -> int:
    """Lanes of ``dtype`` in this CPU's widest vector register (16 float32 on AVX-512, 8 on AVX2)."""
    return _native_lanes(host_target(), dtype)


@lru_cache(maxsize=None)
def panel_width() -> int:
    """A panel's width: a register tile's row, two vectors of float32 on this CPU (32 columns on
    AVX-512, 16 on AVX2), so that a tile uses each line of the panel it loads. Two AVX2 tiles
    sharing panels of 32 each loaded every line and used half of them (measured on AMD EPYC,
    Zen 3, weights cold, the ratio to onnxruntime's time in one process: 197x768 @ 768x3072
    1.03 to 0.97, 197x3072 @ 3072x768 1.07 to 1.01, 32x768 @ 768x3072 1.00 to 0.92)."""
    return 2 * _native_lanes(host_target(), "float32")


def panel_shape(shape, dim: int, width: int) -> tuple[int, ...]:
    """The shape of a tensor laid out in panels ``width`` wide along ``dim``: ``(panels, other
    dims.., width)``."""
    rest = [d for k, d in enumerate(shape) if k != dim]
    return (-(-shape[dim] // width), *rest, width)


def panel_layout(value: np.ndarray, dim: int, dtype, width: int) -> np.ndarray:
    """``value`` in panels ``width`` wide along ``dim`` (zero past its end), aligned:
    ``P[j, rest.., l] = value[.., width*j + l (at dim), ..]``."""
    moved = np.moveaxis(np.asarray(value), dim, -1)
    count = -(-moved.shape[-1] // width)
    wide = np.zeros((*moved.shape[:-1], count * width), dtype)
    wide[..., : moved.shape[-1]] = moved
    panels = aligned_empty(panel_shape(value.shape, dim, width), dtype)
    panels[...] = np.moveaxis(wide.reshape(*moved.shape[:-1], count, width), -2, 0)
    return panels


def cache_dir() -> Path:
    """Where compiled kernels live: ``$REWRITER_CACHE``, else ``~/.cache/rewriter/kernels``."""
    return Path(os.environ.get("REWRITER_CACHE") or Path.home() / ".cache" / "rewriter" / "kernels")


def host_target(target: str | dict = "llvm") -> tvm.target.Target:
    """The target; plain ``"llvm"`` means this CPU (TVM's generic x86 would stop at SSE2)."""
    if target == "llvm":
        return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    return tvm.target.Target(target)


# --------------------------------------------------------------------------------------------
# Lowering a scope to tensor expressions


def _is_reindexing(scope: Scope) -> bool:
    """A scope that only moves elements: inlining it costs nothing and saves a stage."""
    return not scope.summation and isinstance(scope.body, Access)


def _all_reads(body: Scalar):
    """Every access in ``body`` and in the bodies of the scopes it reads, however deep."""
    for access in accesses(body):
        yield access
        if isinstance(access.source, Scope):
            yield from _all_reads(access.source.body)


def _readers(scope: Scope) -> dict[Scope, set[Scope]]:
    """For each scope nested in ``scope``, the distinct scopes whose bodies read it directly."""
    readers: dict[Scope, set[Scope]] = {}
    for reader in (scope, *nested_scopes(scope)):
        for access in accesses(reader.body):
            if isinstance(access.source, Scope):
                readers.setdefault(access.source, set()).add(reader)
    return readers


def _box(scope: Scope) -> dict[str, tuple[int, int]]:
    return scope.box


def _subindices(ix: Index):
    yield ix
    if isinstance(ix, IndexNeg):
        yield from _subindices(ix.arg)
    elif isinstance(ix, IndexOp):
        yield from _subindices(ix.lhs)
        yield from _subindices(ix.rhs)


def _divided(scope: Scope) -> set[str]:
    """Iterators under an index division or modulo in the scope's own reads."""
    return {
        name
        for access in accesses(scope.body)
        for ix in access.indices
        for sub in _subindices(ix)
        if isinstance(sub, IndexOp) and sub.op in ("/", "%")
        for name in index_vars(sub.lhs)
    }


@dataclass
class _Stage:
    """A ``tvm.te.compute`` stage and what the scheduler needs to know about it."""

    tensor: tvm.te.Tensor
    shape: tuple[int, ...]
    summation: tuple[Iterator, ...] = ()
    traversal: tuple[str, ...] = ()  # iterator names (none for a padding stage)
    reads: tuple[tuple[tuple[Index, ...], tuple[int, ...]], ...] = ()  # (indices, buffer shape)
    divided: frozenset[str] = frozenset()  # iterators under an index division or modulo
    work: int = 1  # arithmetic per point, in multiply-adds (``_Building.work``)
    # iterators choosing the plane of a copy the stage reads plane by plane (``_Building.planes``)
    planes: frozenset[str] = frozenset()
    before: int = 0  # a padded copy's zeros before each row (along its last dimension)

    @property
    def total_work(self) -> int:
        """Multiply-adds over the whole stage, a gathering transposition's counted twice."""
        work = math.prod(self.shape) * math.prod(it.size for it in self.summation) * self.work
        if not self.summation and self.inner is not None and _gathers(self, self.inner):
            work *= _GATHER_WORK
        return work

    @property
    def inner(self) -> str | None:
        """The innermost traversal iterator, where vector lanes go by default."""
        return self.traversal[-1] if self.traversal else None


@dataclass
class _Building:
    """What ``read`` records about the stage under construction."""

    scope: Scope
    reads: list = field(default_factory=list)
    divided: set = field(default_factory=set)
    work: int = 1  # arithmetic per point: 1, plus each function's (``_FUNCTION_WORK``)
    # reads a copy whose leading dimensions it indexes by traversal iterators only (a depthwise
    # convolution's channel, not a full one's summed channels): each output plane needs one
    # plane, chosen by these iterators
    planes: set = field(default_factory=set)
    # a widened stage's box before ``_widened`` rounded it up: what its readers read
    narrow: dict | None = None


class _Lowering:
    """The stages of one kernel: inputs are placeholders, every non-inlined scope a stage."""

    def __init__(self, scope: Scope, dtype: str, pad: bool | str, ix_dtype: str, lanes: int = 1, panels=()):
        self.dtype = dtype
        self.pad = pad
        self.lanes = lanes  # the target's vector lanes: a summing stage may be widened to whole vectors
        self.ix_dtype = ix_dtype
        self.fits_int32 = True  # no index or buffer offset can exceed int32 (else lower with int64)
        self.panels = {name: (dim, width) for name, dim, width in panels}  # given in panels: along, how wide
        shapes = tensor_shapes(scope)
        self.inputs = {
            name: tvm.te.placeholder(self._shape(_given_shape(name, shape, self.panels)), dtype, name)
            for name, shape in shapes.items()
        }
        self.scopes: dict[Scope, tvm.te.Tensor] = {}
        self.readers = _readers(scope)
        self.padded: dict[tuple, tvm.te.Tensor] = {}
        self.narrow: dict[Scope, Scope] = {}  # a widened scope -> the scope it widens
        self.stages: list[_Stage] = []
        self.building: list[_Building] = []  # a stack: stages build their nested stages
        self.names = (f"s{k}" for k in itertools.count())  # block names, unique
        self.output = self.stage(scope, "out")

    def _shape(self, shape) -> tuple:
        return tuple(tvm.tirx.const(d, self.ix_dtype) for d in shape)

    # -- stages
    def stage(self, scope: Scope, name: str) -> tvm.te.Tensor:
        """The stage computing ``scope`` over its box (memoised: equal scopes share a value)."""
        widen = self.pad is True and scope not in self.scopes
        itemsize = np.dtype(self.dtype).itemsize
        wider = _widened(scope, self.lanes, name != "out", frozenset(self.panels), itemsize) if widen else None
        if wider is not None:
            self.narrow.setdefault(wider, scope)
        if wider is not None and name == "out":  # the output is the box copied out of the wider stage
            self.scopes[scope] = self.stage(
                Scope(scope.traversal, (), wider[tuple(Var(it.name) for it in scope.traversal)]), name
            )
        elif wider is not None:  # readers read the wider stage, within the box (``read`` checks the box)
            self.scopes[scope] = self.stage(wider, name)
        if scope not in self.scopes:
            narrow = self.narrow.get(scope)
            self.building.append(_Building(scope, narrow=None if narrow is None else _box(narrow)))
            names = [it.name for it in scope.traversal]
            fcompute = lambda *axes: self._compute(scope, axes)  # noqa: E731 (tvm.te.compute reads its signature)
            tensor = tvm.te.compute(self._shape(scope.shape), fcompute, name, varargs_names=names)
            built = self.building.pop()
            reads, divided = tuple(built.reads), frozenset(built.divided)
            planes = frozenset(built.planes)
            stage = _Stage(tensor, scope.shape, scope.summation, tuple(names), reads, divided, built.work, planes)
            self.stages.append(stage)
            self.scopes[scope] = tensor
        return self.scopes[scope]

    def _compute(self, scope: Scope, axes) -> tvm.tirx.PrimExpr:
        env = {it.name: ax + tvm.tirx.const(it.lo, self.ix_dtype) for it, ax in zip(scope.traversal, axes)}
        reduce_axes = [tvm.te.reduce_axis(self._range(it.size), name=it.name) for it in scope.summation]
        env.update(
            {it.name: ax.var + tvm.tirx.const(it.lo, self.ix_dtype) for it, ax in zip(scope.summation, reduce_axes)}
        )
        value = self.scalar(scope.body, env, _box(scope))
        if not reduce_axes:
            return value
        return (tvm.te.max if scope.reduce == "max" else tvm.te.sum)(value, axis=reduce_axes)

    def _range(self, size: int) -> tuple:
        return (tvm.tirx.const(0, self.ix_dtype), tvm.tirx.const(size, self.ix_dtype))

    def padded_copy(self, key, source: tvm.te.Tensor, shape, pads, split: int = 1) -> tvm.te.Tensor:
        """``source`` with ``pads[d] = (before, after)`` zeros around each dimension d; with
        ``split`` k > 1 its last dimension deinterleaved into k phases, ``copy[.., p, j]`` =
        ``padded[.., k*j + p]`` (``deinterleaved``), so that reads k apart become contiguous:
        the padded rows first (their last dimension rounded up to k columns), then the phases
        out of them (``_deinterleaving`` decides how the two are made)."""
        if (key, pads, split) not in self.padded:
            if split > 1:
                before, after = pads[-1]
                columns = -(-(shape[-1] + before + after) // split)
                rows = self.padded_copy(
                    key, source, shape, (*pads[:-1], (before, columns * split - shape[-1] - before))
                )
                big = tuple(int(d) for d in rows.shape[:-1]) + (split, columns)
                fcompute = lambda *p: rows[(*p[:-2], p[-1] * split + p[-2])]  # noqa: E731
            else:
                big = tuple(d + a + b for d, (a, b) in zip(shape, pads))

                def fcompute(*p):
                    inside = [
                        cond
                        for x, d, (a, b) in zip(p, shape, pads)
                        for cond in ((x >= a) if a else None, (x < a + d) if b else None)
                        if cond is not None
                    ]
                    position = [x - a for x, (a, _) in zip(p, pads)]
                    if not inside:  # rows only rounded up to whole phases that end inside them
                        return source[tuple(position)]
                    return tvm.tirx.if_then_else(tvm.tirx.all(*inside), source[tuple(position)], self.zero)

            tensor = tvm.te.compute(self._shape(big), fcompute, f"pad_{next(self.names)}")
            self.stages.append(_Stage(tensor, big, before=pads[-1][0]))
            self.padded[key, pads, split] = tensor
        return self.padded[key, pads, split]

    def deinterleaved(self, ix: Index, lo: int, split: int, env, box) -> tuple:
        """Where ``ix - lo`` lies in a copy deinterleaved by ``split`` (k): with ``ix = k*w + rest``
        (w the lanes' iterator), phase ``rest' % k`` and column ``w + rest' / k`` (rest' = rest -
        lo): TVM code, and IR indices for the scheduler, in which w steps the column by one."""
        coefficients, constant = affine_coefficients(ix)
        lanes = self.building[-1].scope.traversal[-1].name
        rest = {n: c for n, c in coefficients.items() if n != lanes}
        low = index_bounds(affine_index(rest, constant - lo), box)[0]
        shift = max(0, -(low // split))  # a non-negative numerator: truncated division is floor division
        numerator = affine_index(rest, constant - lo + shift * split)
        self.building[-1].divided.update(rest)
        value = self.index(numerator, env, box)
        k = tvm.tirx.const(split, self.ix_dtype)
        phase = tvm.tirx.truncmod(value, k)
        column = env[lanes] + tvm.tirx.truncdiv(value, k) - tvm.tirx.const(shift, self.ix_dtype)
        ir = (IndexOp("%", numerator, Lit(split)), Var(lanes) + IndexOp("/", numerator, Lit(split)) - Lit(shift))
        return (phase, column), ir

    # -- scalars
    @property
    def zero(self) -> tvm.tirx.PrimExpr:
        return tvm.tirx.const(0.0, self.dtype)

    def scalar(self, body: Scalar, env, box) -> tvm.tirx.PrimExpr:
        match body:
            case Num(value):
                return tvm.tirx.const(value, self.dtype)
            case Access(source, indices):
                return self.read(source, indices, [], env, box)
            case Unary(fn, arg):
                self.building[-1].work += _FUNCTION_WORK.get(fn, 0)
                return self.unary(fn, self.scalar(arg, env, box))
            case Binary(op, lhs, rhs):
                return self.binary(op, self.scalar(lhs, env, box), self.scalar(rhs, env, box))
        raise CodegenError(f"cannot lower {body!r}")

    def unary(self, fn: str, x: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        half = tvm.tirx.const(0.5, self.dtype)
        match fn:
            case "neg":
                return -x
            case "relu":
                return tvm.tirx.max(x, self.zero)
            case "exp" | "tanh" | "erf" if self.dtype == "float32":
                return _bound(x, {"exp": _fast_exp, "tanh": _fast_tanh, "erf": _fast_erf}[fn])
            case "exp":
                return tvm.tirx.exp(x)
            case "tanh":
                return tvm.tirx.tanh(x)
            case "sigmoid":  # the reference's formula, so results agree to rounding
                return half * (tvm.tirx.const(1.0, self.dtype) + self.unary("tanh", half * x))
            case "sqrt":
                return tvm.tirx.sqrt(x)
            case "rsqrt":
                return tvm.tirx.const(1.0, self.dtype) / tvm.tirx.sqrt(x)  # as the reference: rsqrt may be approximate
            case "log" | "erf" | "abs" | "floor" | "ceil" | "sin" | "cos":
                return getattr(tvm.tirx, fn)(x)
        raise CodegenError(f"unknown function {fn!r}")

    def binary(self, op: str, a: tvm.tirx.PrimExpr, b: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        match op:
            case "+":
                return a + b
            case "-":
                return a - b
            case "*":
                return a * b
            case "/":
                return a / b
            case "max":
                return tvm.tirx.max(a, b)
            case "min":
                return tvm.tirx.min(a, b)
            case "pow" if isinstance(b, tvm.tirx.FloatImm) and b.value in (2.0, 3.0, 4.0):
                # a small integer power as products (a compiler's powi): equal to rounding, and
                # TVM's power warns about integer exponents above 2 at every compile
                product = a
                for _ in range(int(b.value) - 1):
                    product = product * a
                return product
            case "pow":
                return tvm.tirx.power(a, b)
            case "less" | "less_equal" | "greater" | "greater_equal" | "equal":
                holds = {"less": a < b, "less_equal": a <= b, "greater": a > b, "greater_equal": a >= b}.get(op)
                holds = tvm.tirx.EQ(a, b) if op == "equal" else holds
                return tvm.tirx.Select(holds, tvm.tirx.const(1.0, self.dtype), self.zero)
            case "select":
                return tvm.tirx.Select(tvm.tirx.NE(a, self.zero), b, self.zero)
        raise CodegenError(f"unknown operator {op!r}")

    # -- reads
    def read(self, source, indices, conditions, env, box) -> tvm.tirx.PrimExpr:
        """``source[indices]``, 0 outside its bounds and wherever a ``(index, lo, hi)`` condition
        of an inlined scope fails; only conditions the bounds do not prove become code."""
        if isinstance(source, Scope) and _is_reindexing(source):
            mapping = {it.name: ix for it, ix in zip(source.traversal, indices)}
            inner = source.body
            own = [(ix, it.lo, it.hi) for ix, it in zip(indices, source.traversal)]
            composed = tuple(substitute_index(ix, mapping) for ix in inner.indices)
            return self.read(inner.source, composed, conditions + own, env, box)
        if isinstance(source, Scope) and self._composes(source, indices, box):
            checks = conditions + [(ix, it.lo, it.hi) for ix, it in zip(indices, source.traversal)]
            guards = self._guards(checks, env, box)
            if not guards or self.pad != PAD_EVERY:
                mapping = {it.name: ix for it, ix in zip(source.traversal, indices)}
                value = self.scalar(substitute(source.body, mapping), env, box)
                return tvm.tirx.if_then_else(tvm.tirx.all(*guards), value, self.zero) if guards else value
        lows = [0] * source.rank if isinstance(source, Tensor) else [it.lo for it in source.traversal]
        shape = tuple(source.shape)
        if isinstance(source, Tensor) and source.name in self.panels:  # zeros past the end, up to whole panels
            dim, width = self.panels[source.name]
            shape = shape[:dim] + (-(-shape[dim] // width) * width,) + shape[dim + 1 :]
        clamped = self._clamped(source, indices, lows, shape, box)
        checks = conditions + [
            (ix, lo, lo + d) if k not in clamped else (Lit(lo), lo, lo + d)
            for k, (ix, lo, d) in enumerate(zip(indices, lows, shape))
        ]
        bounds = [index_bounds(ix, box) for ix, _, _ in checks]
        if any(b_hi < lo or b_lo >= hi for (_, lo, hi), (b_lo, b_hi) in zip(checks, bounds)):
            return self.zero  # always outside: every read is padding (and no stage is needed)
        if isinstance(source, Tensor):
            key, buffer = source.name, self.inputs[source.name]
        else:
            key, buffer = source, self.stage(source, next(self.names))
        own = zip(checks[len(conditions) :], bounds[len(conditions) :])
        pads = tuple((max(0, lo - b_lo), max(0, b_hi - hi + 1)) for (_, lo, hi), (b_lo, b_hi) in own)
        outside = [ix for ix, (a, b) in zip(indices, pads) if a or b]
        pays = self.pad == PAD_EVERY or (_pad_fits(shape, pads) and self._along_lanes(outside, indices, shape))
        padding = bool(self.pad and outside and pays)
        split = self._split(indices, shape) if self.pad is True else 1
        if padding or split > 1:
            pads = pads if padding else tuple((0, 0) for _ in pads)
            buffer = self.padded_copy(key, buffer, shape, pads, split)
            lows = [lo - a for lo, (a, _) in zip(lows, pads)]
        if padding:
            checks, bounds = checks[: len(conditions)], bounds[: len(conditions)]
        if padding or split > 1:
            summed = {it.name for it in self.building[-1].scope.summation if it.size > 1}
            if not any(index_vars(ix) & summed for ix in indices[:-2]):
                traversal = {it.name for it in self.building[-1].scope.traversal}
                self.building[-1].planes |= {v for ix in indices[:-2] for v in index_vars(ix) & traversal}
        position = tuple(
            self._clamp(self.index(ix, env, box), ix, lo, d, box) if k in clamped else self.index(ix, env, box)
            for k, (ix, lo, d) in enumerate(zip(indices, lows, shape))
        )
        position = tuple(x - tvm.tirx.const(lo, self.ix_dtype) for x, lo in zip(position, lows))
        recorded = tuple(indices)
        if split > 1:
            last, ir = self.deinterleaved(indices[-1], lows[-1], split, env, box)
            position, recorded = position[:-1] + last, recorded[:-1] + ir
        buffer_shape = tuple(int(d) for d in buffer.shape)
        guards = self._guards(checks, env, box)
        if isinstance(source, Tensor) and source.name in self.panels:
            if padding or split > 1 or guards:
                raise CodegenError(f"{source.name} in panels is read outside its bounds in {self.building[-1].scope}")
            dim, width = self.panels[source.name]
            position = self.in_panels(position, dim, width)
            # seen as it lies with its panels' dimension innermost: contiguous along the lanes
            # there, whichever dimension that is (a weight's rows read as W[16*fo + fi, ..])
            recorded = (*recorded[:dim], *recorded[dim + 1 :], recorded[dim])
            buffer_shape = (*shape[:dim], *shape[dim + 1 :], shape[dim])
        load = buffer[position]
        self.building[-1].reads.append((recorded, buffer_shape))
        self.fits_int32 = self.fits_int32 and _fits_int32(indices, lows, buffer_shape, box)
        return tvm.tirx.if_then_else(tvm.tirx.all(*guards), load, self.zero) if guards else load

    def _clamped(self, source, indices, lows, shape, box) -> set[int]:
        """The dimensions of a read in a widened stage (``_widened``) that leave ``source``'s
        bounds only past the stage's own box: they are read clamped into the bounds (``_clamp``),
        not guarded. What the widened points compute is never read, and a guard would test
        every load of the inner loop: ViT-Base's 197x768 @ 768x3072 product with its bias and
        GELU, its 197 rows widened to 198, took 7.5 ms guarded and 5.3 clamped (the product
        alone 4.9, in one slow spell of the machine). A dimension the vector lanes run along
        keeps its guard (or padding): clamped, its loads would no longer be one vector."""
        narrow = self.building[-1].narrow
        scope = self.building[-1].scope
        if narrow is None or (isinstance(source, Tensor) and source.name in self.panels):
            return set()
        lanes = scope.traversal[-1].name if scope.traversal else None
        return {
            k
            for k, (ix, lo, d) in enumerate(zip(indices, lows, shape))
            if lanes not in index_vars(ix)
            and _within_range(index_bounds(ix, narrow), lo, lo + d)
            and not _within_range(index_bounds(ix, box), lo, lo + d)
        }

    def _clamp(self, value, ix, lo: int, size: int, box) -> tvm.tirx.PrimExpr:
        """``value`` (index ``ix``) clamped into ``[lo, lo + size)`` on the sides its bounds
        over ``box`` cross."""
        b_lo, b_hi = index_bounds(ix, box)
        if b_lo < lo:
            value = tvm.tirx.max(value, tvm.tirx.const(lo, self.ix_dtype))
        if b_hi >= lo + size:
            value = tvm.tirx.min(value, tvm.tirx.const(lo + size - 1, self.ix_dtype))
        return value

    def in_panels(self, position, dim: int, width: int) -> tuple:
        """Where a tensor's element lies in its panels ``width`` wide along ``dim``
        (``panel_layout``): a vector of lanes along ``dim`` is one contiguous run there, since
        the scheduler's lanes and a register tile's row (``_tile_width``) divide a panel."""
        panel = tvm.tirx.const(width, self.ix_dtype)
        along = position[dim]
        rest = [x for k, x in enumerate(position) if k != dim]
        return (tvm.tirx.floordiv(along, panel), *rest, tvm.tirx.floormod(along, panel))

    def _guards(self, checks, env, box) -> list:
        """``lo <= index < hi`` for each check the index's bounds over ``box`` do not prove."""
        guards = []
        for ix, lo, hi in checks:
            b_lo, b_hi = index_bounds(ix, box)
            value = self.index(ix, env, box)
            if b_lo < lo:
                guards.append(value >= tvm.tirx.const(lo, self.ix_dtype))
            if b_hi >= hi:
                guards.append(value < tvm.tirx.const(hi, self.ix_dtype))
        return guards

    def _composes(self, source: Scope, indices, box) -> bool:
        """Whether a nested scope is composed into the stage being built rather than computed as a
        stage of its own: it sums nothing, and the stage reads it once, injectively over the
        stage's box (each element at one point of the traversal and summation: nothing is
        computed twice; a matmul's operand, read once per column, stays a stage). A scope that
        several scopes of the kernel read is one stage they all read, whichever is built first
        (softmax's exponentials, read by its sum and by its division: 1.07 ms for ViT's
        12x197x197 attention scores with them composed into the sum as well, 0.32 once)."""
        stage = self.building[-1].scope
        if source.summation or len(self.readers.get(source, ())) > 1:
            return False
        if sum(1 for a in _all_reads(stage.body) if a.source == source) != 1:
            return False
        own = {n: r for n, r in box.items() if n in {it.name for it in stage.iterators}}
        return not any(index_vars(ix) - set(own) for ix in indices) and is_injective(indices, own)

    def _split(self, indices, shape) -> int:
        """k where a summing stage's lanes would read ``indices`` k > 1 apart along the last
        dimension (a convolution of stride k, NCHW): the read then goes through a copy
        deinterleaved by k, made once per slice and read contiguously by every tap (measured
        here: ResNet-50's 7x7 stem, 3.97 ms with lanes along the window's columns, 0.72 through
        the copy; a 128-channel 3x3 convolution at 28x28, 1.40 and 0.73; MobileNetV2's stride-2
        depthwise convolutions, 0.19 and 0.17, 0.17 and 0.09). 1: read as it is."""
        scope = self.building[-1].scope
        if not scope.summation or not scope.traversal:
            return 1
        lanes = scope.traversal[-1]
        form = affine_coefficients(indices[-1])
        if lanes.size < 2 or lanes.name in _divided(scope) or form is None:
            return 1
        if any(lanes.name in index_vars(ix) for ix in indices[:-1]):
            return 1
        step = form[0].get(lanes.name, 0)
        return step if 1 < step <= _DEINTERLEAVED and shape[-1] >= 2 * step else 1

    def _along_lanes(self, outside, indices, shape) -> bool:
        """Whether a bounds check would vary along vector lanes: the innermost traversal loop, or
        a summation loop the read runs along; or whether it would be made at every step of a
        sum for each row of a register tile: a read the same for every lane (a broadcast, as
        an NCHWc convolution reads its input), outside its bounds along a summation loop. Only
        then does a padded copy pay for itself; a check that is the same for all lanes and
        steps is hoisted out of the vector loop."""
        scope = self.building[-1].scope
        lanes = {it.name for it in scope.traversal[-1:]}
        lanes |= {it.name for it in scope.summation if _stride(it.name, indices, shape) == 1}
        if lanes and not any(index_vars(ix) & {it.name for it in scope.traversal[-1:]} for ix in indices):
            lanes |= {it.name for it in scope.summation}  # a broadcast read inside the sum
        lanes -= _divided(scope)  # the scheduler keeps lanes off these: no check varies along lanes
        return any(index_vars(ix) & lanes for ix in outside)

    def index(self, ix: Index, env, box) -> tvm.tirx.PrimExpr:
        match ix:
            case Var(name):
                return env[name]
            case Lit(value):
                return tvm.tirx.const(value, self.ix_dtype)
            case IndexNeg(arg):
                return -self.index(arg, env, box)
            case IndexOp("/" | "%" as op, lhs, rhs):
                return self.floor(op, lhs, constant_value(rhs), env, box)
            case IndexOp(op, lhs, rhs):
                a, b = self.index(lhs, env, box), self.index(rhs, env, box)
                return a + b if op == "+" else a - b if op == "-" else a * b
        raise CodegenError(f"cannot lower index {ix!r}")

    def floor(self, op: str, lhs: Index, divisor: int, env, box) -> tvm.tirx.PrimExpr:
        """Floor division or modulo as truncated ones of a numerator shifted to be non-negative
        over the box (``x/d = (x + k*d)/d - k``). TVM 0.27's buffer flattening simplifies
        ``floordiv``/``floormod`` of numerators with negative coefficients wrongly (e.g.
        ``A[(-i-3)//2 + 4]`` becomes ``A[i//-2 + 2]``); truncated division of a non-negative
        numerator comes out right. Its vectoriser gets ``truncmod`` of a decreasing ramp wrong,
        so the scheduler keeps lanes off iterators recorded here."""
        self.building[-1].divided.update(index_vars(lhs))
        shift = max(0, -(index_bounds(lhs, box)[0] // divisor))  # k = ceil(-lo / d) when lo < 0
        numerator = self.index(lhs, env, box) + tvm.tirx.const(shift * divisor, self.ix_dtype)
        d = tvm.tirx.const(divisor, self.ix_dtype)
        if op == "%":
            return tvm.tirx.truncmod(numerator, d)
        return tvm.tirx.truncdiv(numerator, d) - tvm.tirx.const(shift, self.ix_dtype)


def _fits_int32(indices, lows, shape, box) -> bool:
    """Whether every sub-index and the flat offset of a read stay in int32 over the box (a
    guarded read computes its offset even where it reads nothing)."""
    subs = [abs(b) for ix in indices for sub in _subindices(ix) for b in index_bounds(sub, box)]
    reach = [max(abs(b - lo) for b in index_bounds(ix, box)) for ix, lo in zip(indices, lows)]
    offset = sum(r * step for r, step in zip(reach, row_major(shape)))
    return max(subs + [offset, math.prod(shape)]) <= _INT32


def _given_shape(name: str, shape, panels) -> tuple[int, ...]:
    return panel_shape(shape, *panels[name]) if name in panels else tuple(shape)


def lower_to_te(scope: Scope, dtype: str, pad: bool | str, lanes: int = 1, panels=(), wide: bool = False) -> _Lowering:
    """``scope`` as TVM tensor expressions (its stages, the placeholders ``inputs`` named by the
    scope's tensors, the ``output`` stage named "out"): int32 indices (the fast common case),
    int64 where a far read needs them. Both targets, CPU here and CUDA (``codegen.cuda_kernel``),
    start from it. A zero-padded read is guarded (``pad=False``), a padding stage where a guard
    would vary along vector lanes (``pad=True``), or always a padding stage, no guard written
    inside a compute (``pad=PAD_EVERY``: schedules that re-index reads keep the guards). The
    tensors in ``panels`` ((name, dimension, width)) are given laid out in panels (``panel_layout``).
    ``wide``: int64 indices whatever the reads reach."""
    lowering = None if wide else _Lowering(scope, dtype, pad, "int32", lanes, panels)
    return lowering if lowering and lowering.fits_int32 else _Lowering(scope, dtype, pad, "int64", lanes, panels)


# Strides up to this are read through a deinterleaved copy (``_Lowering._split``): convolutions
# of stride 2 (and 3, 4); a wider stride reads too little of each cache line to be worth copying.
_DEINTERLEAVED = 4


def _widened(
    scope: Scope, lanes: int, nested: bool = False, panels: frozenset[str] = frozenset(), itemsize: int = 4
) -> Scope | None:
    """``scope`` over a wider box, or None: a summing scope whose innermost traversal extent no
    full vector divides (ViT's 197 tokens: one lane; 56 columns: 14) is computed with that
    extent rounded up to whole vectors (where at most a quarter of their lanes fall past the
    end), and the loop its register tile would run along (the one whose rows share the most
    vector reads) rounded up to whole tiles (where that adds at most an eighth); a ``nested``
    one (read by an epilogue, which then runs at its tile) has its tile's loop rounded up even
    where the lanes' is whole (a guarded tile's accumulators stay in memory there), and so does
    one whose tile's rows span two steps of another loop (``_columns``: a blocked 1x1
    convolution's two blocks of output channels), to whole tiles of such rows: 49 pixels to 54,
    6 rows of two blocks where 7 rows of one block tiled them before (NCHW8c 2048 -> 512 channels
    at 7x7 with bias and ReLU, weights cold, 1.07 to 0.82 ms; 512 -> 2048 1.03 to 0.83;
    onnxruntime 0.81 and 0.84; a weight in ``panels`` is read along its panels). The kernel's
    output copies its box out of the wider stage; a stage reading a nested one reads the wider
    stage where it lies, within the box (an epilogue over 7x7 pixels widened to 64: 0.078 to
    0.075 ms for 960 channels over 160, ViT's scaled attention scores 0.255 to 0.223, against a
    copy of the box first). What the wider box computes past the
    scope's is never read (reads there are zero or in bounds, as anywhere). Measured here: ViT's
    attention scores, 12x197x197 over 64, 4.21 ms with one lane, 0.42 with the tokens' loop
    widened to 208, 0.21 with the rows' too (numpy's BLAS 0.43). Here, where the box is copied
    out anyway, whole tiles still beat the guarded ones ``_tile_axis`` makes elsewhere (0.215-0.221
    ms against 0.230-0.242, two runs of each)."""
    if not scope.summation or not scope.traversal or lanes < 2:
        return None
    inner = scope.traversal[-1].name
    narrow = _lanes(scope.traversal[-1].size, lanes) < lanes
    reads = [(a.indices, a.source.shape) for a in accesses(scope.body)]
    columns = _columns_tile(scope, reads, lanes)
    if not (narrow or nested or columns):
        return None
    # whole vectors that gather (a softmax's maximum along rows) gain nothing; a weight in
    # panels is read along its panels, whatever its indices say
    gathers = [a for a in accesses(scope.body) if _stride(inner, a.indices, a.source.shape) not in (0, 1)]
    if any(not (isinstance(a.source, Tensor) and a.source.name in panels) for a in gathers):
        return None
    sizes = {inner: _rounded_up(scope.traversal[-1].size, lanes, _LANES_WASTE) if narrow else scope.traversal[-1].size}
    if sizes[inner] is None:
        return None
    vectors = sizes[inner] // lanes
    rows = _tile_rows(DEFAULT_SCHEDULE, lanes, _COLUMNS if columns else 2 if vectors % 2 == 0 else 1)
    others = [it for it in scope.traversal[:-1] if it.size > 1]
    if others:
        tile = max(others, key=lambda it: _shared_elements(reads, inner, it.name))
        rows = min(rows, _set_rows(reads, inner, tile.name, itemsize))
        whole = _rounded_up(tile.size, rows)
        if _lanes(tile.size, rows) * 2 <= rows and whole:
            # a deep tile takes the least rounding that whole tiles of more than half its rows
            # allow (a row fewer costs it little): ViT's 197 tokens to 198 in tiles of 11, not
            # 210 in tiles of 14 (its 197x768 @ 768x3072 product with bias and GELU, weights
            # cold: 4.58 ms in 210 rows, 4.43 in 198, apart 4.18 + 0.15)
            deep = range(rows // 2 + 1, rows + 1) if rows >= _DEEP_ROWS else ()
            sizes[tile.name] = min((_rounded_up(tile.size, r) or whole for r in deep), default=whole)
    if not narrow and len(sizes) == 1:
        return None
    wider = scope.with_traversal(
        Iterator(it.name, it.lo, it.lo + sizes.get(it.name, it.size)) for it in scope.traversal
    )
    return None if _reads_past(scope, wider) else wider


# Rows from which a register tile is deep (AVX-512's 14 rows of two vectors): rounding the
# rows' loop up to whole tiles may take fewer of them where that rounds less.
_DEEP_ROWS = 8


def _reads_past(scope: Scope, wider: Scope) -> bool:
    """Whether ``wider`` reads a tensor past its bounds through ``/`` or ``%`` where ``scope``
    reads it within them: a stride-2 1x1 convolution's input read at ``2*(t/7), 2*(t%7)``, 49
    pixels widened to 54, measured 2.2 to 2.5 ms (1024 -> 2048 channels; onnxruntime 1.8),
    where a 1x1 convolution's plain read past its 49 pixels cost nothing (1.05 to 0.82)."""
    for access in accesses(scope.body):
        if isinstance(access.source, Tensor):
            for ix, size in zip(access.indices, access.source.shape):
                inside = _within(index_bounds(ix, scope.box), size)
                if inside and affine_coefficients(ix) is None and not _within(index_bounds(ix, wider.box), size):
                    return True
    return False


def _within(bounds: tuple[int, int], size: int) -> bool:
    return bounds[0] >= 0 and bounds[1] < size


def _within_range(bounds: tuple[int, int], lo: int, hi: int) -> bool:
    return bounds[0] >= lo and bounds[1] < hi


def _columns_tile(scope: Scope, reads, lanes: int) -> bool:
    """Whether ``scope``'s register tile spans ``_COLUMNS`` steps of another loop (``_columns``):
    its lanes' loop is one vector."""
    if scope.traversal[-1].size != lanes:
        return False
    names = tuple(it.name for it in scope.traversal)
    stage = _Stage(None, scope.shape, scope.summation, names, tuple(reads))
    return _columns([*scope.shape[:-1], 1], stage, DEFAULT_SCHEDULE) is not None


# The most a widened box may add along the lanes' loop, as a fraction of the wider extent: 49
# pixels (a 7x7 image, merged) in 64 lanes waste 15, against 9 of every 16 with lanes of 7
# (measured: 1x1 convolutions over 7x7, 160 -> 960 0.097 to 0.071 ms, 512 -> 2048 0.93 to 0.31).
_LANES_WASTE = (1, 4)


def _rounded_up(size: int, multiple: int, waste: tuple[int, int] = (1, 9)) -> int | None:
    """``size`` rounded up to a multiple, or None where that adds more than the fraction
    ``waste`` of the result (by default a ninth: at most an eighth more work)."""
    wide = -(-size // multiple) * multiple
    return wide if (wide - size) * waste[1] <= wide * waste[0] else None


def _pad_fits(shape, pads) -> bool:
    """Padding pays while the copy stays small; reads that reach far out are guarded instead."""
    size = math.prod(shape)
    return math.prod(d + a + b for d, (a, b) in zip(shape, pads)) <= 4 * size + (1 << 16)


# --------------------------------------------------------------------------------------------
# Scheduling


class _Refused(Exception):
    """The loop nest is not the shape a schedule expects: the plain loops are used instead."""


def _fallback() -> tuple[type[Exception], ...]:
    """What makes the plain loops stand in for a schedule (looked up when raised: TVM loads lazily)."""
    return (tvm.s_tir.ScheduleError, _Refused)


def _lanes(extent: int, wanted: int) -> int:
    """The vector width for a loop: the largest divisor of ``extent`` up to ``wanted``."""
    return max((d for d in range(1, min(extent, wanted) + 1) if extent % d == 0), default=1)


def _stride(name: str, indices, shape) -> int | None:
    """Elements between reads at ``name`` and ``name + 1`` (None: ``name`` under a division or
    modulo; a term without ``name``, ``w + s/2``, does not matter)."""
    total = 0
    for ix, step in zip(indices, row_major(shape)):
        if name not in index_vars(ix):
            continue
        coefficient = 0
        for atom, c in normalize(ix).terms:
            if atom == name:
                coefficient = c
            elif not isinstance(atom, str) and name in index_vars(to_index(LinearForm.atom(atom))):
                return None
        total += coefficient * step
    return total


def _gathers(stage: _Stage, name: str) -> bool:
    """Whether vector lanes along ``name`` would gather: some read is neither contiguous nor
    the same element for every lane."""
    return any(_stride(name, indices, shape) not in (0, 1) for indices, shape in stage.reads)


# Lanes along a summation loop pay for the reduction across lanes at the end: with fewer than
# these (a 3x3 window's 3 columns), gathering traversal lanes are faster (measured: MobileNetV2's
# stride-2 depthwise convolution, 0.45 ms with 3 summation lanes, 0.31 with gathering ones).
_FEWEST_SUMMATION_LANES = 4


def _lane_summation(stage: _Stage, params: Schedule, native: int) -> int | None:
    """The summation loop to vectorise (its position), when reads are contiguous along it and
    the innermost traversal loop would gather (``params.reduction_vector`` None), or always (True)."""
    if params.reduction_vector is False or stage.inner is None:
        return None
    if params.reduction_vector is None and not _gathers(stage, stage.inner) and stage.inner not in stage.divided:
        return None
    candidates = [
        (it.size, k)
        for k, it in enumerate(stage.summation)
        if _lanes(it.size, params.vector or native) >= _FEWEST_SUMMATION_LANES
        and not _gathers(stage, it.name)
        and it.name not in stage.divided
        and any(_stride(it.name, ix, shape) == 1 for ix, shape in stage.reads)
    ]
    return max(candidates)[1] if candidates else None


def _read_axis(stage: _Stage) -> int | None:
    """The outer traversal loop along which a read that gathers along the innermost one runs
    contiguously (a transposition's input rows)."""
    gathering = [(ix, shape) for ix, shape in stage.reads if _stride(stage.inner, ix, shape) not in (0, 1)]
    return next(
        (
            k
            for k, name in enumerate(stage.traversal[:-1])
            if any(_runs_along(name, ix, shape) for ix, shape in gathering)
        ),
        None,
    )


def _runs_along(name: str, indices, shape) -> bool:
    """Whether a read runs contiguously along ``name``: stride 1, or ``name`` split by a
    constant, ``[.., name / c, name % c]`` (a flattened image read back as rows of an NCHW
    tensor: Segformer's tokens), which runs along ``name`` for ``c`` elements at a time."""
    if _stride(name, indices, shape) == 1:
        return True
    *outer, last = indices
    match last:
        case IndexOp("%", Var(n), Lit(c)) if n == name and c > 1:
            split = IndexOp("/", Var(name), Lit(c))
            return all(ix == split or name not in index_vars(ix) for ix in outer)
    return False


_AVX2_ACCUMULATORS = 12  # of AVX2's 16 vector registers, those a register tile of rows wider than one vector takes
_AVX512_ACCUMULATORS = 28  # of AVX-512's 32: 14 rows of two vectors, 4 of six (``_SIX_WIDE``)


def _tile_rows(params: Schedule, native: int, width: int = 1) -> int:
    """Rows of the register tile: ``params.tile``, else as many as leave room for the loads
    beside the accumulators: on AVX-512 (16 float32 lanes, 32 registers) 16 rows, 14 rows
    two vectors wide, or 4 six wide; with 16 registers (AVX2) 8 rows, 6 two vectors wide, or 4
    three wide (12 accumulators either way; measured on AMD EPYC, Zen 3: 197x768 @ 768x3072 in panels
    6.0 ms with 6 rows of two vectors, 9.8 with 6 of one, 11.6 with 4 of two; onnxruntime 6.5)."""
    if params.tile:
        return params.tile
    if native >= 16:
        return 16 if width == 1 else _AVX512_ACCUMULATORS // width
    return 8 if width == 1 else max(1, _AVX2_ACCUMULATORS // width)


def _tile_width(params: Schedule, native: int, vectors: int) -> int:
    """Vectors per row of the register tile, of ``vectors`` along the lanes' loop. A row's two
    vectors share one broadcast read, so the loads per multiply-add fall from 17/16 to 16/28
    (measured here, AVX-512: an NCHW 1x1 convolution computed transposed, 1024x256x196, 0.29 ms
    with one vector per row, 0.24 with two; 2048x512x49 0.55 and 0.35; a product whose lanes'
    loop is one vector is left as it was)."""
    wanted = params.width if params.width is not None else (2 if native >= 8 else 1)
    return _lanes(vectors, wanted)


# Vectors per row where the rows' loop has a divisor of 4 but not of 6 (a transformer's 32
# tokens, ConvNeXt's 196, 784 or 3136 pixels) and the CPU has 16 vector registers (AVX2): 4
# rows of three vectors are 12 accumulators, against 8 in 4 rows of two. Measured on AMD EPYC
# (Zen 3), products in panels as wide as the rows, weights cold (8 copies), two of two against
# three, ms: 32x768 @ 768x3072 1.32 and 1.16 against 1.14 and 1.06; 32x768 @ 768x2304 0.95
# against 0.80; 32x768 @ 768x768 0.33 against 0.28; 32x3072 @ 3072x768 1.20 and 1.32 against
# 1.16 and 1.27; 196x384 @ 384x1536 1.84 against 1.60; 3136x96 @ 96x384 1.57 against 1.40;
# 784x768 @ 768x192 1.73 against 1.55.
_THREE_WIDE = 3

# Vectors per row on AVX-512 (32 vector registers) that a schedule may ask for (``wide_tile``)
# where the rows' loop tiles in two-vector rows no deeper than 8 (a transformer's 32 tokens: 16
# accumulators): 4 rows of six vectors are 24, and each step loads six vectors for four
# broadcasts. Their rows sweep a weight's panel 96 floats wide, so the summation runs in blocks
# (``_WIDE_BLOCK_BYTES``) that stay in L1 while the tiles of every row share them. It is not
# the default, since which is faster depends on the CPU, not on its vector registers: products
# in panels, weights cold, ms, eight rows of two vectors against four of six with blocks of
# 128 steps, onnxruntime in brackets. On an Intel Xeon (48 KiB L1): 32x3072 @ 3072x768
# 1.13-1.19 against 0.97-0.98 (0.95-1.00); 32x768 @ 768x3072 1.03-1.15 against 0.96-1.06
# (0.95-1.06); 32x768 @ 768x2304 0.86 against 0.80 (0.85); six wide without the blocks 1.16,
# 1.12, 0.81. On AMD EPYC Zen 4 (32 KiB L1, AVX-512 in two halves), the two interleaved in one
# process, three runs: 32x3072 @ 3072x768 0.81-1.07 against 0.82-1.01 (0.99-1.19); 32x768 @
# 768x3072 0.75-0.95 against 0.80-1.01; 32x768 @ 768x768 0.20-0.23 against 0.21-0.25; 32x768 @
# 768x2304 0.59-0.70 against 0.61-0.73 (blocks of 32 or 24 KiB no faster). So a product races
# both (``codegen.packed``). Where two-vector rows tile 14 deep (196, 784, 3136 rows: 28
# accumulators) six wide measured 0.93-1.04 times their time on the Xeon, and is not offered.
_SIX_WIDE = 6
_WIDE_BLOCK_BYTES = 48 << 10


def _register_tile(extents, stage: _Stage, params: Schedule, native: int, vector: bool):
    """(vectors per row, ``_tile_axis``'s (axis, rows) or None, ``_columns``' (axis, count) or
    None) of a summing stage's register tile: rows two vectors wide (``_tile_width``), or one
    where that tiles a loop whose rows share more of the vector reads, or makes more
    accumulators (the rows' loop has no divisor up to the wide tile's rows but one up to the
    narrow one's: on AVX2, a 3x3 convolution's 14 or 7 columns in 7 rows of one vector, not 2
    rows of two or 4 rows along the output channels; measured on AMD EPYC, Zen 3, in panels:
    256x14x14 2.4-2.9 to 1.8 ms, 512x7x7 3.5-4.6 to 2.4, onnxruntime 1.5-1.9); or, where the
    lanes' loop is one vector, rows of two vectors from two steps of another loop
    (``_columns``) where that makes more accumulators, or as many."""
    widths = [_tile_width(params, native, extents[-1]) if vector else 1]
    if params.width is None and vector and native < 16 and extents[-1] % _THREE_WIDE == 0:
        widths.append(_THREE_WIDE)  # after two: on a tie (6 rows of two, 4 of three) two stay
    if params.width is None and widths[0] > 1:
        widths.append(1)
    best = None
    for width in widths:
        found = _tile_axis([*extents[:-1], extents[-1] // width], _tile_rows(params, native, width), stage)
        shared = _shared_elements(stage.reads, stage.inner, stage.traversal[found[0]]) if found else 0
        key = (shared, width * (found[1] if found else 1))
        if best is None or key > best[0]:  # the wider on a tie: fewer loads per multiply-add
            best = (key, width, found, None)
    columns = _columns(extents, stage, params) if vector and extents[-1] == 1 else None
    if columns is not None:
        axis, count = columns
        found = _tile_axis(
            [1 if k == axis else e for k, e in enumerate(extents)], _tile_rows(params, native, count), stage
        )
        if found and extents[found[0]] % found[1] == 0:  # whole tiles: guarded rows of columns measured slow
            shared = _shared_elements(stage.reads, stage.inner, stage.traversal[found[0]])
            key = (shared, count * found[1])
            if key >= best[0]:
                best = (key, 1, found, columns)
    return best[1:]


# Steps of another loop a register tile's rows span where the lanes' loop is one vector
# (``_columns``): two, a row as wide as where the lanes' loop has two vectors.
_COLUMNS = 2


def _columns(extents, stage: _Stage, params: Schedule) -> tuple[int, int] | None:
    """(axis, ``_COLUMNS``): the loop whose steps a register tile's row spans, each step one
    vector, where the lanes' loop is one vector: the outermost that ``_COLUMNS`` divides along
    which a vector read varies and no broadcast read does, so each row's broadcast element feeds
    every step (an NCHW8c 1x1 convolution's blocks of output channels, ``L fo, hw, fi ; S c ;
    X[c, hw] * W[8*fo + fi, c]``, in tiles of 4 positions by 2 blocks, as MLAS's NCHWc kernels
    tile; measured on AMD EPYC, Zen 3, weights cold, against 7 positions of one block: 1024 ->
    256 channels at 14x14 1.05 to 0.95 ms, 256 -> 1024 1.01 to 0.82, 512 -> 128 at 28x28 0.88
    to 0.79, 64 -> 256 at 56x56 1.15 to 1.02). None where ``params.width`` sets the row, or no
    loop qualifies (a depthwise convolution: no broadcast read to share)."""
    if params.width is not None:
        return None
    vectors = [ix for ix, _ in stage.reads if _varies(stage.inner, ix)]
    broadcasts = [ix for ix, _ in stage.reads if not _varies(stage.inner, ix)]
    if not broadcasts:
        return None
    for axis, name in enumerate(stage.traversal[: len(extents) - 1]):
        if extents[axis] % _COLUMNS == 0 and any(_varies(name, ix) for ix in vectors):
            if not any(_varies(name, ix) for ix in broadcasts):
                return axis, _COLUMNS
    return None


# Rows of a register tile over a loop they do not divide (the last tile's rows past the loop
# skipped by a guard). Measured here, ViT's attention-weighted values (12 heads, 197x197 @
# 197x64; 197 is a prime): one row of four vectors 0.245 ms, 4 or 6 guarded rows of two
# vectors 0.146-0.162, 8 or more 0.31-0.42 (the guards then cost the tile its registers);
# 196 rows in whole tiles of 14, 0.129.
_GUARDED_ROWS = 6


def _tile_axis(extents, rows: int, stage: _Stage | None = None) -> tuple[int, int] | None:
    """(axis, rows) of the spatial loop to unroll into a register tile of 2..``rows`` rows: with
    ``stage``, the one whose rows share the most vector reads (a matrix product's rows share
    the weight's vector, loaded once for all of them), else the innermost that splits. Where
    that loop has no divisor to tile by and is long, its tile is ``_GUARDED_ROWS`` rows, the
    last one guarded (the split is not exact)."""
    most_rows = [rows] * len(extents)
    if stage is not None:  # no more rows than one set of the L1 cache holds (``_set_rows``)
        itemsize = np.dtype(str(stage.tensor.dtype)).itemsize if stage.tensor is not None else 4
        most_rows = [min(rows, _set_rows(stage.reads, stage.inner, name, itemsize)) for name in stage.traversal]
    axes = [axis for axis in reversed(range(len(extents))) if _lanes(extents[axis], most_rows[axis]) > 1]
    if stage is not None:
        shared = [_shared_elements(stage.reads, stage.inner, name) for name in stage.traversal[: len(extents)]]
        axes.sort(key=lambda axis: -shared[axis])
        best = max(reversed(range(len(extents))), key=lambda axis: shared[axis])
        most = shared[axes[0]] if axes else 0
        if shared[best] > most and extents[best] >= 4 * _GUARDED_ROWS and most_rows[best] >= _GUARDED_ROWS:
            return best, _GUARDED_ROWS
    if not axes:
        return None
    return axes[0], _lanes(extents[axes[0]], most_rows[axes[0]])


def _set_rows(reads, lanes: str | None, name: str, itemsize: int) -> int:
    """The most rows along iterator ``name`` a register tile may have before its rows' broadcast
    reads (those not along the ``lanes``), one cache line per row, crowd one set of the L1 data
    cache: rows a multiple of the cache's way apart (``_l1_cache``: its sets times its lines,
    4 KiB here) fall into one set, and more of them than its ways less one evict each other at
    every step of the sum. Measured here (AMD EPYC Zen 4, 8 ways of 64 sets), in panels, weights
    cold: 196x3072 @ 3072x768, its rows 12 KiB apart, 7.5 ms in tiles of 14 rows, 4.3 in tiles
    of 7 (4.6 in tiles of 4); 196x1536 @ 1536x384, 784x768 @ 768x192 and 3136x96 @ 96x384, the
    rows spread over two sets or more, the same in tiles of 14 and of 7."""
    ways, sets, line = _l1_cache()
    most = 1 << 30
    for indices, shape in reads:
        if _varies(lanes, indices) or not _varies(name, indices):
            continue
        stride = _stride(name, indices, shape)
        if stride:
            period = sets * line // math.gcd(abs(stride) * itemsize, sets * line)  # rows until the set recurs
            most = min(most, (ways - 1) * period)
    return most


@lru_cache(maxsize=1)
def _l1_cache() -> tuple[int, int, int]:
    """(ways, sets, line bytes) of this CPU's L1 data cache, from Linux's sysfs; 8 ways of 64 sets
    of 64 bytes (32 KiB, the smallest of the x86 CPUs measured here) where it says nothing."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(root.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() != "Instruction":
                return tuple(
                    int((index / f).read_text())
                    for f in ("ways_of_associativity", "number_of_sets", "coherency_line_size")
                )
        except (OSError, ValueError):
            break
    return 8, 64, 64


def _shared_elements(reads, lanes: str | None, name: str) -> int:
    """Elements of the vector reads (``(indices, shape)``) that do not vary along iterator
    ``name``: rows along it load each such vector once for all of them. A vector read varies
    along the ``lanes`` iterator; a read that does not is one broadcast element per row,
    whichever rows share it. (Counting every read, ConvNeXt's 3136x96 @ 96x384 tiled along the
    weight's columns, sharing the broadcast input element, and loaded 24 weight vectors per 24
    multiply-adds: 1.78 ms; along the input's rows, 14 of them sharing each weight vector, 0.47.)"""
    vectors = [(ix, shape) for ix, shape in reads if _varies(lanes, ix)] or reads
    return sum(math.prod(shape) for indices, shape in vectors if not _varies(name, indices))


def _varies(name: str | None, indices) -> bool:
    return any(name in index_vars(ix) for ix in indices)


def _schedule_stage(sch: tvm.s_tir.Schedule, stage: _Stage, params: Schedule, native: int) -> None:
    """Vectorise (a traversal loop, or a summation loop the reads run along) and parallelise."""
    if not stage.shape:
        return
    block = sch.get_sblock(stage.tensor.op.name)
    summed = _lane_summation(stage, params, native)
    if summed is None:
        _vector_traversal(sch, block, stage, params, native)
    else:
        _vector_summation(sch, block, stage, params, native, summed)


_PARALLEL_ITERATIONS = 128  # enough chunks to balance threads; more only adds index arithmetic
# For a stage that reads a copy plane by plane, made inside its parallel loop: each iteration a
# whole plane, copied once, rather than the rows of one output row, copied again for the next
# (measured here, depthwise 3x3 convolutions, parallel over channels against channels and rows:
# 96 channels 112x112 0.280 to 0.149 ms, 32 channels 0.108 to 0.049, 96 channels of stride 2 to
# 56x56 0.158 to 0.114).
_PLANE_ITERATIONS = 32
# Multiply-adds below which a stage runs on one thread (a copy's points count one each). Waking
# the pool's sleeping threads cost tens of microseconds when they slept at once (MobileNetV2's
# 104 kernels took 22 ms on 2 threads, 14 on 1, with 1 << 21 here). Since the worker yields its
# core for half a millisecond after each kernel (``rewriter._threads``), a program's kernels
# find it awake, and two threads pay from far less work. Measured on AMD EPYC (Zen 4, family 25
# model 17), kernels alone, one thread against two: MobileNetV2's stride-2 depthwise
# convolutions 144 -> 28x28 (1.0M multiply-adds) 0.171 against 0.098 ms, 576 -> 7x7 (0.25M)
# 0.042 against 0.034, a depthwise 3x3 over 384x14x14 (0.68M) 0.047 against 0.040; ViT's
# softmax over 12x197x197 (earlier), 0.25 ms with no stage parallel, 0.16 with its maximum, sum
# and division parallel (onnxruntime 0.11). Whole programs, each pair interleaved in one process
# (Zen 4): MobileNetV2 5.49-5.75 ms with 1 << 20 here, 5.29-5.43 with 1 << 16 (onnxruntime
# 4.49-4.63); ResNet-50 42.1-42.7 and 41.0-41.8 (38.6-38.9); BERT-base unchanged.
_PARALLEL_WORK = 1 << 16
# A function's arithmetic in multiply-adds beyond the one a point counts anyway (the polynomials
# below; log is libm's): a stage of exponentials is worth two threads long before a stage of
# additions of as many elements is. Measured here: GELU over 197x3072 (ViT's, with the erf
# that ``_fast_erf`` replaced), 0.40 ms on one thread, 0.24 on two; softmax's 2364x197
# exponentials, 0.13 and 0.08; the bias added alone, 0.079 and 0.084 (on the Zen 4, its data
# in cache, 0.103 and 0.056: a stream of as many points is over the bound above there too).
_FUNCTION_WORK = {"exp": 16, "tanh": 12, "sigmoid": 14, "erf": 14, "log": 20}
# A summation-free stage whose lanes gather (a transposition) counts each point this many times:
# its reads hop from line to line, and two threads halve the time sooner than for a stream.
# Measured here: 197x3072 transposed into 3072x200 (a packed product's A), 0.17 ms on one
# thread, 0.09 on two; 197x768, 0.034 and 0.040.
_GATHER_WORK = 2


def _parallel(sch: tvm.s_tir.Schedule, loops: list, params: Schedule, stage: _Stage) -> None:
    """Fuse the first ``params.parallel`` loops into a parallel loop; by default the fewest that
    give ``_PARALLEL_ITERATIONS`` iterations (fusing all makes tiny iterations that spend their
    time decoding the fused index; ``_PLANE_ITERATIONS`` for a stage reading a copy plane by
    plane), none for a stage with little work."""
    if params.parallel is None:
        extents = [int(sch.get(loop).extent) for loop in loops]
        wanted = _PLANE_ITERATIONS if stage.planes else _PARALLEL_ITERATIONS
        count = next((k for k in range(1, len(loops)) if math.prod(extents[:k]) >= wanted), len(loops))
        count = count if stage.total_work >= _PARALLEL_WORK else 0
    else:
        count = min(params.parallel, len(loops))
    if count:
        sch.parallel(sch.fuse(*loops[:count]) if count > 1 else loops[0])


def _vector_traversal(sch, block, stage: _Stage, params: Schedule, native: int) -> None:
    """Lanes along the innermost traversal loop, a register tile of ``tile`` rows of lanes
    around them (without summation: ``block`` rows of the loop the gathered reads run along),
    the summation loops outside the tile, the outer loops fused and parallel."""
    rank = len(stage.shape)
    loops = list(sch.get_loops(block))
    spatial, reduction = loops[:rank], loops[rank:]
    lanes, width, found, columns = _tile_plan(stage, params, native)
    extents = list(stage.shape)
    vector = []
    if lanes > 1:
        spatial[-1], inner = sch.split(spatial[-1], [None, lanes])
        extents[-1] //= lanes
        vector = [inner]
    wide = []
    if width > 1:
        spatial[-1], inner = sch.split(spatial[-1], [None, width])
        extents[-1] //= width
        wide = [inner]
    tile = []
    if found:
        axis, rows = found
        spatial[axis], inner = sch.split(spatial[axis], [None, rows])
        tile = [inner]
    if columns:
        axis, count = columns
        spatial[axis], inner = sch.split(spatial[axis], [None, count])
        wide = [inner]
        width = count  # the row's vectors, for the summation's blocks
    axis = _read_axis(stage) if vector and not reduction and params.block > 1 else None
    if axis is not None and _lanes(extents[axis], params.block) > 1:
        spatial[axis], inner = sch.split(spatial[axis], [None, _lanes(extents[axis], params.block)])
        tile = [inner]
    if found and params.kblock is None:  # (``kblock`` splits the scope's first summation loop: its order stays)
        reduction = _taps_outside(reduction, stage, stage.traversal[found[0]], found[1], width, native)
    unrolled = []
    if params.unroll > 1 and reduction:
        factor = _lanes(int(sch.get(reduction[-1]).extent), params.unroll)
        if factor > 1:
            reduction[-1], inner = sch.split(reduction[-1], [None, factor])
            unrolled = [inner]
    order = _outer_order(stage) if reduction else range(rank)  # the large operand's loops outermost
    outside, inside = [spatial[k] for k in order], []
    row = found and stage.traversal[found[0]]
    steps = reduction and _summation_block(stage, row, width * lanes, params, width)
    if steps:  # the loops over tiles that share the vector operand's block go inside the blocks
        vectors = [ix for ix, _ in stage.reads if _varies(stage.inner, ix)]
        shares = [k for k in order if not any(_varies(stage.traversal[k], ix) for ix in vectors)]
        if math.prod(int(sch.get(spatial[k]).extent) for k in order if k not in shares) >= _BLOCKED_ITERATIONS:
            reduction[0], inner = sch.split(reduction[0], [None, steps])
            outside = [spatial[k] for k in order if k not in shares]
            inside, reduction = [reduction[0], *(spatial[k] for k in shares)], [inner, *reduction[1:]]
    sch.reorder(*outside, *inside, *reduction, *unrolled, *tile, *wide, *vector)
    _parallel(sch, outside, params, stage)
    for loop in unrolled + tile + wide:
        sch.unroll(loop)
    if vector:
        sch.vectorize(vector[0])
    if reduction:  # initialise before the summation loops, not under a branch inside them
        sch.decompose_reduction(block, (inside or reduction)[0])


def _taps_outside(reduction: list, stage: _Stage, row: str, rows: int, width: int, native: int) -> list:
    """The summation loops, a window's taps along the register tile's rows outermost where the
    innermost loop is such a tap and its broadcasts would not fit in registers beside the
    tile's. A tap ``s`` read with the rows' iterator ``w`` (``X[.., w+s]``) is a loop LLVM
    unrolls whole, and the tile's rows then share its broadcast reads (``X[w+s]`` for row ``w``
    at tap ``s`` is row ``w+1``'s at tap ``s-1``): LLVM keeps rows + taps - 1 broadcasts live
    beside the rows x width accumulators, and where they do not fit it spills to the stack
    inside the summation. The spills' stores then alias the next loads 4 KiB apart or not,
    depending on where the stack lies, so one kernel ran at two speeds, process by process
    and with the call's depth: ResNet-50's 3x3 convolution over 64 channels at 56x56 (NCHW in
    panels, 14 rows of two vectors) 1.6-1.9 or 3.3-5.2 ms on 2 threads of an AMD EPYC Zen 4;
    with the taps outside, the channels' loop innermost, 1.05-1.09 in every process
    (onnxruntime 1.06). At 7x7 (7 rows: their broadcasts fit) the order as written stays,
    1.03-1.07 against 1.06-1.10 with the taps outside; so it does for rows one vector wide,
    which LLVM did not spill (AVX2's 7 rows of one vector: 1.27-1.59 ms as written, 1.54-2.42
    with the taps outside; DESIGN.md, "Code generation and cost")."""
    sizes = {it.name: it.size for it in stage.summation}
    broadcasts = [ix for indices, _ in stage.reads if not _varies(stage.inner, indices) for ix in indices]
    taps = {tap for ix in broadcasts for tap in sizes if _shares_rows(ix, row, tap, sizes[tap])}
    innermost = stage.summation[-1]
    registers = 32 if native >= 16 else 16  # AVX-512's, AVX2's (as ``_tile_rows`` tells them)
    if innermost.name not in taps or width < 2:  # (rows of one vector: LLVM loads their broadcasts again)
        return reduction
    if rows * width + rows + innermost.size - 1 + width <= registers:
        return reduction
    return [reduction[k] for k in sorted(range(len(sizes)), key=lambda k: stage.summation[k].name not in taps)]


def _shares_rows(ix, row: str, tap: str, taps: int) -> bool:
    """Whether reads at ``ix`` for consecutive ``row`` share elements across the ``taps``
    steps of ``tap`` (``w+s``, ``2*w+s`` with three taps; not ``4*w+s`` with four)."""
    form = affine_coefficients(ix)
    if form is None or row not in form[0] or tap not in form[0]:
        return False
    return abs(form[0][row]) < taps * abs(form[0][tap])


def _tile_plan(stage: _Stage, params: Schedule, native: int):
    """(lanes, vectors per row along the lanes' loop, ``_register_tile``'s (axis, rows) and
    columns, or None) of a stage with traversal lanes: the register tile only where it sums."""
    extents = list(stage.shape)
    lanes = 1 if stage.inner in stage.divided else _lanes(extents[-1], params.vector or native)
    extents[-1] //= lanes
    if not stage.summation:
        return lanes, 1, None, None
    return lanes, *_register_tile(extents, stage, params, native, lanes > 1)


def native_lanes(dtype: str = "float32", target="llvm") -> int:
    """Vector lanes of ``dtype`` on ``target`` (this CPU's widest vectors for "llvm")."""
    return _native_lanes(host_target(target), np.dtype(dtype).name)


def tile_vectors(scope: Scope, dtype: str = "float32", target="llvm", schedule: Schedule | None = None) -> int:
    """Vectors per row of the register tile that ``schedule`` (the default one) gives
    ``scope``'s summing stage with traversal lanes (1 where it has none): a caller laying a
    weight out in panels for ``scope`` (``codegen.panels``) makes a panel as wide as a tile's
    row, so that each tile uses every line of the weight it loads."""
    return _tile_shape(scope, dtype, target, schedule)[1]


def wide_tile(scope: Scope, dtype: str = "float32", target="llvm") -> Schedule | None:
    """The schedule whose register tile is rows of six vectors (``_SIX_WIDE``), where that makes
    more accumulators than the default schedule's tile (AVX-512, rows that two-vector tiles take
    no deeper than 8); None elsewhere."""
    if _native_lanes(host_target(target), np.dtype(dtype).name) < 16:  # AVX2: no registers for six
        return None
    wide = Schedule(width=_SIX_WIDE)
    rows, vectors = _tile_shape(scope, dtype, target, wide)
    if vectors != _SIX_WIDE:
        return None
    return wide if rows * vectors > math.prod(_tile_shape(scope, dtype, target, None)) else None


def _tile_shape(scope: Scope, dtype, target, schedule: Schedule | None) -> tuple[int, int]:
    """(rows, vectors per row) of the register tile of ``scope``'s summing stage with traversal
    lanes under ``schedule``; (1, 1) where it has none."""
    dtype, params, target = _normalised(dtype, schedule, target)
    native = _native_lanes(target, dtype)
    merged = merge_loops(scope)
    lowering = lower_to_te(merged, dtype, params.pad, native, _panels(scope, merged, params))
    for stage in lowering.stages:
        if stage.summation and stage.shape and _lane_summation(stage, params, native) is None:
            _, width, found, columns = _tile_plan(stage, params, native)
            return (found[1] if found else 1), width * (columns[1] if columns else 1)
    return 1, 1


# Bytes of the vector operand per summation block (``_summation_block``): a quarter of a 32 KiB
# L1. Measured on AMD EPYC (Zen 3), an NCHW 1x1 convolution computed transposed (``packed.
# transposed_call``), 1024 -> 256 channels at 14x14, weights cold: 1.03-1.05 ms unblocked;
# blocks of 64, 96, 128, 192, 256 steps (4 to 16 KiB of the weight) 0.84, 0.83, 0.79-0.82,
# 0.82, 0.94 (onnxruntime 0.78-0.82); 2048 -> 512 at 7x7 1.29 to 0.96, 256 -> 1024 at 14x14
# 0.90 to 0.80. The same blocks slowed a 197x768 @ 768x3072 product in panels (6.1 to 7.0), whose
# broadcast reads run along the summation: they are not blocked.
_BLOCK_BYTES = 8 << 10
_BLOCKED_ITERATIONS = 4  # the loops outside the blocks (run in parallel) iterate at least so often


def _summation_block(stage: _Stage, row: str | None, vector_elements: int, params: Schedule, width: int) -> int | None:
    """Steps per block of a stage's one summation loop, or None (not blocked): where the
    register tile's rows run along ``row`` and its broadcast reads along their rows too (an
    NCHW activation read k-major, ``X[k, n]``). Unblocked, each step then reads a new line of
    the broadcast operand for a few elements, and each row of tiles reads all of it again from
    L2; blocked, the tiles that share the vector operand's block (its ``vector_elements`` a
    step, ``_BLOCK_BYTES`` a block) sweep the broadcast operand's block while it is in L1. Rows
    ``_SIX_WIDE`` vectors wide (``width``) are blocked whatever their broadcast reads, by
    ``_WIDE_BLOCK_BYTES`` of the vector operand."""
    size = stage.summation[0].size
    if params.kblock is not None:
        return params.kblock if 1 < params.kblock < size and size % params.kblock == 0 else None
    if row is None or len(stage.summation) != 1 or vector_elements < 2:
        return None
    itemsize = np.dtype(str(stage.tensor.dtype)).itemsize
    if width == _SIX_WIDE:  # rows six vectors wide: their vector operand's block stays in L1
        steps = _lanes(size, max(1, _WIDE_BLOCK_BYTES // (itemsize * vector_elements)))
        return steps if 1 < steps and 2 * steps <= size else None
    broadcast = [(ix, shape) for ix, shape in stage.reads if not _varies(stage.inner, ix) and _varies(row, ix)]
    if not broadcast or not all(_runs_along(row, ix, shape) for ix, shape in broadcast):
        return None
    steps = _lanes(size, max(1, _BLOCK_BYTES // (itemsize * vector_elements)))
    return steps if 1 < steps and 2 * steps <= size else None


def _vector_summation(sch, block, stage: _Stage, params: Schedule, native: int, summed: int) -> None:
    """Lanes along a summation loop (rfactor): each output keeps a vector of partial results in
    registers, summed across lanes at the end; ``tile`` outputs share the loads of their reads."""
    rank = len(stage.shape)
    loops = list(sch.get_loops(block))
    spatial, reduction = loops[:rank], loops[rank:]
    lanes = _lanes(stage.summation[summed].size, params.vector or native)
    contiguous = reduction.pop(summed)
    outer, lane = sch.split(contiguous, [None, lanes])
    sch.reorder(*spatial, *reduction, outer, lane)
    partial = sch.rfactor(lane, factor_axis=rank)
    spatial = list(sch.get_loops(block))[:rank]
    found = _tile_axis(list(stage.shape), _tile_rows(params, native))
    tile_rows, inner = [], []
    if found:
        axis, rows = found
        spatial[axis], *inner = sch.split(spatial[axis], [None, rows])
        tile_rows = [rows]
    spatial = [spatial[k] for k in _outer_order(stage)]
    sch.reorder(*spatial, *inner)
    sch.compute_at(partial, spatial[-1])
    sch.set_scope(partial, 0, "local")
    # compute_at made one loop per partial-block variable it leaves free, in the block's order:
    # the lane, the tile rows, then the summation loops
    new = list(sch.get_loops(partial))[len(spatial) :]
    extents = [int(sch.get(loop).extent) for loop in new[: 1 + len(tile_rows)]]
    if extents != [lanes] + tile_rows:
        raise _Refused(f"unexpected loops {extents} after compute_at")
    lane, rows, sums = new[0], new[1 : 1 + len(tile_rows)], new[1 + len(tile_rows) :]
    sch.reorder(*sums, *rows, lane)
    _parallel(sch, spatial, params, stage)
    for loop in rows:
        sch.unroll(loop)
    sch.vectorize(lane)
    if sums:
        sch.decompose_reduction(partial, sums[0])


def _outer_order(stage: _Stage) -> list[int]:
    """Traversal positions, those indexing the most input elements first: loops over a large
    operand (a weight's output channels) go outermost, so that its slice stays in cache while
    the inner loops sweep the small operands. A stage reading a copy plane by plane has the
    loops choosing the plane outermost (a max pool's channels, not the rows that its padding's
    mask shares with them), so that the parallel loop runs over planes."""
    weight = [
        sum(math.prod(shape) for indices, shape in stage.reads if any(name in index_vars(ix) for ix in indices))
        for name in stage.traversal
    ]
    return sorted(range(len(weight)), key=lambda k: (stage.traversal[k] not in stage.planes, -weight[k]))


def _native_lanes(target: tvm.target.Target, dtype: str) -> int:
    return max(1, _vector_bits(target) // np.dtype(dtype).itemsize // 8)


def _vector_bits(target: tvm.target.Target) -> int:
    """The widest vector register of ``target``, from its CPU's features. TVM 0.27's
    ``llvm_get_vector_width`` answers 512 for AVX2-only CPUs too (znver3, haswell): tiles
    sized for AVX-512's 32 registers of 16 lanes then spilled on AMD EPYC (Zen 3), and a
    197x768 @ 768x3072 product ran at a third of onnxruntime's speed."""
    if target.kind.name != "llvm":
        return 128
    for feature, bits in (("avx512f", 512), ("avx", 256)):
        if tvm.target.codegen.llvm_cpu_has_features([feature], target):
            return bits
    return 128  # SSE, NEON


def _scheduled(lowering: _Lowering, params: Schedule | None, target) -> tvm.IRModule:
    """The kernel's module with ``params`` applied to every stage (None: the plain loops)."""
    func = tvm.te.create_prim_func([*lowering.inputs.values(), lowering.output])
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    if params is not None:
        # tiles sized for the lanes the kernel's vectors have (its schedule's, else the target's),
        # as the lowering sized the boxes it widened to whole tiles (``_widened``)
        native = lowering.lanes if lowering.lanes > 1 else _native_lanes(target, lowering.dtype)
        used = _used_ops(lowering.output)
        for stage in lowering.stages:
            if stage.tensor.op in used:
                _schedule_stage(sch, stage, params, native)
        readers = Counter(t.op for op in used for t in op.input_tensors)
        at_tile: dict[str, str] = {}  # an element-wise stage run at a product's tile -> that product
        for stage in lowering.stages:
            if stage.tensor.op in used:
                _epilogue_at_tile(sch, stage, readers, at_tile)
        placed: dict[str, bool] = {}  # copy -> made at its reader
        for stage in reversed(lowering.stages):  # a deinterleaving copy before the padded rows it reads
            if stage.tensor.op in used and not stage.traversal:
                sch = _padding_at_reader(sch, stage, placed)
        if params.panels and params.prefetch:
            names = ",".join(name for name, _, _ in params.panels)
            return tvm.IRModule({"main": sch.mod["main"].with_attr(_PREFETCH_ATTR, f"{names}:{params.prefetch}")})
    return sch.mod


def _epilogue_at_tile(sch: tvm.s_tir.Schedule, stage: _Stage, readers: Counter, at_tile: dict[str, str]) -> None:
    """An element-wise stage reading a summing stage that nothing else reads (a bias and an
    activation after a product) runs inside that stage's tile loop, on each tile as soon as its
    sums are done, and the sums live in a tile-sized local buffer: not a whole tensor written to
    memory and read back (measured: a 1x1 convolution with its bias and clip in one kernel, 0.13
    ms; the two kernels apart 0.14 + 0.05 ms; one kernel with a whole intermediate 0.6 ms). So
    does an element-wise stage reading such a stage (``at_tile``, which records them) that
    nothing else reads: a GELU, which reads the biased sums twice and so is not composed into
    their stage (``_Lowering._composes``). Measured here (AMD EPYC Zen 4, 2 cores, weights in
    panels, in turns in one process, the sums then from TVM's workspace pool, now on the stack:
    ``_tiles_on_stack``): ViT's 197x768 @ 768x3072 with its bias and GELU 1.025x the product
    alone, where the GELU as a pass of its own after the tiles took 1.04-1.07x; the model's
    subprogram 4.35 ms as a product and two passes, 4.27 as this one kernel. Sums
    widened past the stage's box (``_widened``) are read at their tile too, the stage guarded
    to its box; not by the output's copy of its box, whose guard would sit on every lane."""
    if stage.summation or not stage.traversal:  # (a padded copy is wider than what it reads)
        return
    block = sch.get_sblock(stage.tensor.op.name)
    inputs = stage.tensor.op.input_tensors
    sources = [t for t in inputs if getattr(t.op, "reduce_axis", None) or t.op.name in at_tile]
    if len(sources) != 1 or readers[sources[0].op] != 1:
        return
    source = sources[0]
    wider = tuple(int(d) for d in source.shape) != tuple(stage.shape)
    if any(int(d) < e for d, e in zip(source.shape, stage.shape)):
        return  # the tiles of the sums would cover only part of the stage (a wider stage is fine)
    if wider and getattr(getattr(stage.tensor.op.body[0], "op", None), "name", None) == "te.tensor_load":
        return  # the output's box copied out of a widened stage: at the tile, a guard on every lane
    if not _reads_elementwise(sch.get(block), source.op.name):
        return
    producer = at_tile.get(source.op.name, source.op.name)
    try:
        init, update = sch.get_sblock(f"{producer}_init"), sch.get_sblock(f"{producer}_update")
    except Exception:  # noqa: BLE001  not a decomposed summation (lanes along the sum): left as is
        return
    shared = [a for a, b in zip(sch.get_loops(init), sch.get_loops(update)) if sch.get(a).same_as(sch.get(b))]
    if not shared:
        return
    written = update if producer == source.op.name else sch.get_sblock(source.op.name)
    try:  # a primitive checks before it changes anything: a refusal leaves the stages apart
        sch.reverse_compute_at(block, shared[-1])
        sch.set_scope(written, 0, "local")  # compacted to the tile the loop leaves free
    except tvm.s_tir.ScheduleError:
        return
    at_tile[stage.tensor.op.name] = producer
    inner = sch.get_loops(block)[-1]
    if int(sch.get(inner).extent) > 1:
        try:
            sch.vectorize(inner)
        except tvm.s_tir.ScheduleError:
            pass  # scalar loops: still one tile at a time


# Measured here: a 64-channel 56x56 depthwise 3x3 convolution, 0.42-0.54 ms with its padded copy
# made apart (one thread), 0.09-0.10 ms with it made row by row inside the parallel loop (about
# 3x the copying); MobileNetV2 end to end, 10.3 ms before, 9.7 after (with the parallel-work
# bound below halved, 8.9).
_PADDING_AT_READER = 4
_PADDING_LANES = 256


def _padding_at_reader(sch: tvm.s_tir.Schedule, stage: _Stage, placed: dict[str, bool]) -> tvm.s_tir.Schedule:
    """A padded copy read by one stage is made inside that stage's parallel loop, slice by
    slice as each iteration needs it: in parallel, and still in cache when read. Kept where the
    slices together copy at most ``_PADDING_AT_READER`` times the padded tensor (a 3x3 window's
    rows are copied for each of the three output rows that read them; a full convolution
    parallel over its output channels would copy every channel for each). ``placed`` records
    which copies moved: a deinterleaving copy is finished with the padded rows it reads
    (``_deinterleaving``), which come after it here."""
    moved = _at_reader(sch, stage)
    sch = moved or sch
    name = stage.tensor.op.name
    placed[name] = moved is not None
    block = sch.get_sblock(name)
    if _is_deinterleaving(sch, block):
        return sch
    readers = sch.get_consumers(block)
    if len(readers) == 1 and _is_deinterleaving(sch, readers[0]):
        return _deinterleaving(sch, stage, readers[0], placed[name], placed[sch.get(readers[0]).name_hint])
    if placed[name]:
        _vectorized_row(sch, block)
    return sch


def _at_reader(sch: tvm.s_tir.Schedule, stage: _Stage) -> tvm.s_tir.Schedule | None:
    """``sch`` with ``stage`` computed at its one reader's parallel loop, or None where not."""
    trial = sch.copy()
    block = trial.get_sblock(stage.tensor.op.name)
    readers = trial.get_consumers(block)
    if len(readers) != 1:
        return None
    outer = trial.get_loops(readers[0])[0]
    if trial.get(outer).kind != tvm.tirx.ForKind.PARALLEL:
        return None
    try:
        trial.compute_at(block, outer)
    except tvm.s_tir.ScheduleError:
        return None
    extents = [trial.get(loop).extent for loop in trial.get_loops(block)]
    if not all(isinstance(e, tvm.tirx.IntImm) for e in extents):
        return None  # a slice whose size varies from iteration to iteration (a quasi-affine read)
    if math.prod(int(e) for e in extents) > _PADDING_AT_READER * math.prod(stage.shape):
        return None
    return trial


def _is_deinterleaving(sch: tvm.s_tir.Schedule, block) -> bool:
    """``block`` deinterleaves a padded copy (``_Lowering.padded_copy`` with a split)."""
    name = sch.get(block).name_hint
    return name.startswith("pad_") and any(r.source.name.startswith("pad_") for r in sch.get(block).reads)


def _deinterleaving(sch: tvm.s_tir.Schedule, rows: _Stage, phases, rows_moved: bool, phases_moved: bool):
    """The padded ``rows`` and the ``phases`` deinterleaved out of them. TVM scalarises a
    vectorised loop whose lanes disagree on a guard, and reads every other element one by one
    into a vector; so where the rows are made at the reader, whole, with zeros before them, they
    are zeros first and then copied unguarded, each one vector (``decompose_padding``), and the
    phases loop innermost, unrolled, where LLVM vectorises each row's reads as whole loads and
    shuffles. Measured here (called again and again / on inputs in turns, cold): ResNet-50's
    max pool 0.21 -> 0.12 / 0.41 -> 0.22 ms, a 96-channel stride-2 depthwise convolution
    padded on both sides 0.27 -> 0.14 / 0.64 -> 0.21. Elsewhere the rows are inlined back into
    the one guarded copy (``compute_inline``), which measured faster: copies made whole take
    two passes for one (a 144-channel depthwise convolution at 56x56, 0.13 -> 0.15 ms), and
    rows padded only after their end vectorise well enough (MobileNetV2's as exported from
    ``transformers``, 0.125 -> 0.15), as do rows in slices (a reader tiled along them:
    ResNet-50's stem)."""
    block = sch.get_sblock(rows.tensor.op.name)
    width = int(sch.get(block).writes[0].source.shape[-1])
    split, columns = (int(d) for d in sch.get(phases).writes[0].source.shape[-2:])
    row_loops, phase_loops = sch.get_loops(block), sch.get_loops(phases)
    parts = _row_parts(sch, phase_loops, columns)
    whole = (
        rows_moved
        and rows.before > 0
        and _row_parts(sch, row_loops, width) == 1
        and parts is not None
        and int(sch.get(phase_loops[-1 - parts]).extent) == split
    )
    if not whole or not sch.can_decompose_padding(block, row_loops[1]):
        sch.compute_inline(block)
        if phases_moved:
            _vectorized_row(sch, phases)
        return sch
    for copy in (sch.decompose_padding(block, row_loops[1]), block):
        _vectorized_row(sch, copy)
    column = sch.fuse(*phase_loops[-2:]) if parts == 2 else phase_loops[-1]  # a row split into vectors: whole again
    sch.reorder(column, phase_loops[-1 - parts])
    sch.unroll(sch.get_loops(phases)[-1])
    return sch


def _row_parts(sch: tvm.s_tir.Schedule, loops: list, width: int) -> int | None:
    """How many of the innermost ``loops`` make a row ``width`` long: one as made at a reader,
    two as ``_schedule_stage`` leaves a row split into vectors; None where neither."""
    extents = [int(sch.get(loop).extent) for loop in loops[-2:]]
    if len(loops) > 1 and extents[-1] == width:
        return 1
    kinds = [sch.get(loop).kind for loop in loops[-2:]]
    if (
        len(loops) > 2
        and math.prod(extents) == width
        and kinds == [tvm.tirx.ForKind.SERIAL, tvm.tirx.ForKind.VECTORIZED]
    ):
        return 2
    return None


def _vectorized_row(sch: tvm.s_tir.Schedule, block) -> None:
    """A copy's innermost loop as one (legalised) vector, where it is serial and not too long."""
    inner = sch.get_loops(block)[-1]
    if sch.get(inner).kind == tvm.tirx.ForKind.SERIAL and 1 < int(sch.get(inner).extent) <= _PADDING_LANES:
        try:
            sch.vectorize(inner)
        except tvm.s_tir.ScheduleError:
            pass


def _reads_elementwise(block, buffer: str) -> bool:
    """``block`` reads one element of ``buffer`` per iteration, at distinct block variables, or
    at a constant along a dimension of one element (no stencil, no broadcast along a summed
    axis, no one element read by every iteration): each tile needs only its own sums."""
    regions = [r for r in block.reads if r.source.name == buffer]
    if len(regions) != 1:
        return False
    names = []
    for dim, size in zip(regions[0].region, regions[0].source.shape):
        if not isinstance(dim.extent, tvm.tirx.IntImm) or int(dim.extent) != 1:
            return False
        if isinstance(dim.min, tvm.tirx.Var):
            names.append(dim.min.name)
        elif not (isinstance(dim.min, tvm.tirx.IntImm) and int(size) == 1):
            return False
    return len(names) == len(set(names))


def _used_ops(output: tvm.te.Tensor) -> set:
    """The stages the output depends on: TVM folds a product with a padding 0 away, and with it
    the reads of its other factor, whose stage then never becomes a block."""
    used, stack = set(), [output]
    while stack:
        op = stack.pop().op
        if op not in used:
            used.add(op)
            stack.extend(op.input_tensors)
    return used


def _module(scope: Scope, dtype: str, params: Schedule, target, wide: bool = False) -> tvm.IRModule:
    """The kernel's module under ``params``, or its plain loops (always sound) when a schedule
    primitive refuses ``params``; ``wide``: with int64 indices."""
    lanes = _native_lanes(target, dtype) if target.kind.name == "llvm" else 1
    merged = merge_loops(scope)
    lanes = lanes if params.vector is None else params.vector
    lowering = lower_to_te(merged, dtype, params.pad, lanes, _panels(scope, merged, params), wide)
    try:
        return _scheduled(lowering, params, target)
    except _fallback():
        return _scheduled(lowering, None, target)


def _compile(scope: Scope, dtype: str, params: Schedule, target):
    """The compiled module; with int64 indices where TVM's own arithmetic on the int32 ones
    overflows (it multiplies constants that ``_fits_int32`` never sees: a guard's bound by a
    coefficient of a million), which only a far read makes."""
    pipeline = _pipeline() if target.kind.name == "llvm" else "default"
    try:
        try:
            return tvm.compile(_module(scope, dtype, params, target), target=target, tir_pipeline=pipeline)
        except ValueError as err:
            if "exceeds range of int32" not in str(err):
                raise
            return tvm.compile(_module(scope, dtype, params, target, wide=True), target=target, tir_pipeline=pipeline)
    except (RuntimeError, ValueError, TypeError) as err:
        raise CodegenError(f"TVM could not compile {scope} (dtype {dtype}, {params}): {err}") from err


# TVM's LLVM pipeline with ``_tiles_on_stack`` and ``_prefetching`` after its own lowering
# (registered on first use: TVM is imported on first use).
_PIPELINE = "rewriter.tiles_on_stack"
_STACK_BYTES = 32 * 1024  # at most this much per tile on a thread's stack (8 MB by default)
_PREFETCH_ATTR = "rewriter_prefetch"  # a kernel's panels and its prefetch distance, for ``_prefetching``


@lru_cache(maxsize=None)
def _pipeline() -> str:
    compilation = importlib.import_module("tvm.tirx.compilation_pipeline")

    def factory(**kwargs):
        lowering, finalize_host, finalize_device = compilation.get_tir_pipeline("s_tir", **kwargs)
        on_stack = tvm.tirx.transform.prim_func_pass(
            lambda f, _mod, _ctx: f.with_body(_tiles_on_stack(f.body)), opt_level=0, name="tiles_on_stack"
        )
        prefetching = tvm.tirx.transform.prim_func_pass(
            lambda f, _mod, _ctx: _prefetching(f), opt_level=0, name="prefetching"
        )
        return tvm.transform.Sequential([lowering, on_stack, prefetching]), finalize_host, finalize_device

    compilation.register_tir_pipeline(_PIPELINE, factory)
    return _PIPELINE


def _rewritten(stmt, rewrite: Callable):
    """``stmt`` with ``rewrite`` applied outermost first: where it returns a statement, that
    statement takes the place of the one it was given; where it returns None, the walk goes into
    the statement's body (loops, attributes, sequences, branches). The same object where nothing
    changed. (This TVM has no statement mutator in Python.)"""
    tirx = tvm.tirx
    done = rewrite(stmt)
    if done is not None:
        return done
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_rewritten(s, rewrite) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(seq, stmt.seq)) else tirx.SeqStmt(seq)
    if isinstance(stmt, (tirx.For, tirx.AttrStmt)):
        body = _rewritten(stmt.body, rewrite)
        if body.same_as(stmt.body):
            return stmt
        if isinstance(stmt, tirx.AttrStmt):
            return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
        return _with_body(stmt, body)
    if isinstance(stmt, tirx.IfThenElse):
        then = _rewritten(stmt.then_case, rewrite)
        other = stmt.else_case and _rewritten(stmt.else_case, rewrite)
        if then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case)):
            return stmt
        return tirx.IfThenElse(stmt.condition, then, other)
    return stmt


def _with_body(loop, body):
    return tvm.tirx.For(
        loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations, loop.step
    )


def _tiles_on_stack(stmt):
    """``stmt`` with its tile buffers (scope "local": an epilogue's sums, a summation's partial
    vectors) allocated on the stack, up to ``_STACK_BYTES``; the same object where it has none.
    TVM puts on the stack only "global" buffers under 1 KB and asks its workspace pool for the
    others, once per tile, inside the parallel loop; on the stack LLVM keeps the tile in
    registers (TVM places the alloca at the entry of the parallel loop's closure: one tile per
    thread, not one per iteration). Measured here (AMD EPYC Zen 4, 2 cores, the kernels from the pool and on the
    stack in turns in one process, medians of the rounds' ratios): ViT's 197x768 @ 768x3072
    in panels with its bias 0.957x, with its bias and GELU 0.973x; a 1x1 convolution 144 ->
    24 channels over 56x56 with its bias 0.837x; a 3x3 one 64 -> 64 with bias and ReLU 0.954x."""
    return _rewritten(stmt, _on_stack)


def _on_stack(stmt):
    tirx = tvm.tirx
    if not isinstance(stmt, tirx.AllocBuffer):
        return None
    if not _on_the_stack(stmt.buffer):
        return stmt
    return tirx.AllocBuffer(stmt.buffer, {**stmt.annotations, "disable_lower_builtin": tirx.IntImm("bool", 1)})


def _on_the_stack(buffer) -> bool:
    """Whether ``_tiles_on_stack`` puts ``buffer`` on the stack: a tile (scope "local") of a
    known size up to ``_STACK_BYTES``."""
    if buffer.scope() != "local" or not all(isinstance(d, tvm.tirx.IntImm) for d in buffer.shape):
        return False
    return math.prod(int(d) for d in buffer.shape) * tvm.runtime.DataType(buffer.dtype).itemsize <= _STACK_BYTES


def _prefetching(func):
    """``func`` with a prefetch, ``Schedule.prefetch`` steps ahead, of every vector its innermost
    summation loops read from a weight in panels (the function's ``_PREFETCH_ATTR``: the panels'
    tensors and the distance); only in loops that store to tiles on the stack alone
    (``_on_the_stack``): LLVM keeps a tile in registers only where no call may touch the memory
    it stores to, and a product that sums into its output in place (no epilogue), or into a
    tile too large for the stack, stores to memory that a prefetch may touch, so there it would
    store its accumulators on every step (ViT's 197x3072 @ 3072x768 six vectors wide, its
    197 rows widened to 200 and summed in the workspace: 3.7 to 6.6 ms)."""
    attrs = func.attrs
    if attrs is None or _PREFETCH_ATTR not in attrs:
        return func
    names, steps = str(attrs[_PREFETCH_ATTR]).rsplit(":", 1)
    panels = frozenset(names.split(","))
    body = _rewritten(func.body, lambda stmt: _loop_prefetching(stmt, panels, int(steps)))
    return func if body.same_as(func.body) else func.with_body(body)


def _loop_prefetching(stmt, panels: frozenset[str], steps: int):
    tirx = tvm.tirx
    if not isinstance(stmt, tirx.For):
        return None
    flat = stmt.body.seq if isinstance(stmt.body, tirx.SeqStmt) else [stmt.body]
    if stmt.kind != tirx.ForKind.SERIAL or not all(isinstance(s, (tirx.Bind, tirx.BufferStore)) for s in flat):
        return None  # not an innermost loop of straight-line code: look inside
    if not all(_on_the_stack(s.buffer) for s in flat if isinstance(s, tirx.BufferStore)):
        return stmt
    analyzer = importlib.import_module("tvm.sym.analyzer").Analyzer()
    linear = importlib.import_module("tvm.sym.pattern").detect_linear_equation
    ahead: set[str] = set()  # the rest of each prefetched read's index: its place in a step
    body = []
    for s in flat:
        if isinstance(s, tirx.Bind):
            analyzer.bind(s.var, s.value)  # (the indices name the loop's let-bound offsets)
        for load in _panel_loads(s.value, panels) if isinstance(s, tirx.BufferStore) else ():
            base = load.indices[0].base
            form = linear(analyzer.simplify(base), [stmt.loop_var])  # [step, rest], or [] where not affine
            if len(form) == 2 and isinstance(form[0], tirx.IntImm) and int(form[0]) and str(form[1]) not in ahead:
                ahead.add(str(form[1]))
                address = tirx.address_of(tirx.BufferLoad(load.source, [base + steps * int(form[0])]))
                # read, locality 3 (keep in every level), data cache
                body.append(tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", address, 0, 3, 1)))
        body.append(s)
    return _with_body(stmt, tirx.SeqStmt(body)) if ahead else stmt


def _panel_loads(expr, panels: frozenset[str]) -> list:
    """The vector loads in ``expr`` from a buffer of ``panels`` (or its flattened view,
    ``NAME_1``), outermost first."""
    if isinstance(expr, tvm.ir.TensorLoad):
        name = expr.source.name
        ramp = isinstance(expr.indices[-1], tvm.tirx.Ramp)
        return [expr] if ramp and (name in panels or name.rsplit("_", 1)[0] in panels) else []
    parts = [getattr(expr, f, None) for f in ("a", "b", "value", "base")] + list(getattr(expr, "args", ()))
    return [load for part in parts if isinstance(part, tvm.ir.expr.Expr) for load in _panel_loads(part, panels)]


# --------------------------------------------------------------------------------------------
# Kernels and the on-disk cache


class TvmKernel:
    """A compiled scope. ``kernel(**arrays)`` returns a new array; ``kernel.run(arrays, out)``
    writes into ``out`` without allocating (for timing; ``prepare`` makes such buffers).

    TVM's machine code assumes 64-byte aligned buffers (AVX-512 aligned loads fault otherwise;
    numpy only promises 16), so every buffer handed to the kernel is aligned first or checked.
    """

    def __init__(
        self,
        scope: Scope,
        dtype: str,
        schedule: Schedule,
        target,
        module,
        path: Path | None,
        from_cache: bool,
        views: tuple[tuple[int, ...], ...] | None = None,
    ):
        self.scope = scope
        self.dtype = dtype
        self.schedule = schedule
        self.target = target
        self.inputs = tensor_shapes(scope)
        self.shape = scope.shape
        self.path = path  # the shared library in the cache (None when it could not be written)
        self.from_cache = from_cache
        self._module = module  # keeps the loaded library alive while its function is in use
        self.function = module["main"]  # called by position: the inputs in ``inputs``' order, then the output
        self.views = views or _views(scope, schedule.panels)  # the shapes the function takes: its buffers' views

    def renamed(self, scope: Scope) -> TvmKernel:
        """The same machine code for ``scope``, this kernel's scope with its tensors renamed
        (arguments are passed by position, in the order the scope first reads them; the
        schedule's tensors in panels renamed alike)."""
        names = dict(zip(self.inputs, tensor_shapes(scope)))
        if rename_tensors(self.scope, names) != scope:
            raise ValueError(f"TvmKernel.renamed: {scope} is not {self.scope} renamed")
        schedule = _renamed_schedule(self.schedule, names)
        return TvmKernel(scope, self.dtype, schedule, self.target, self._module, self.path, self.from_cache, self.views)

    def __call__(self, **arrays) -> np.ndarray:
        values = {name: aligned_copy(value, self.dtype) for name, value in self._checked(arrays).items()}
        out = aligned_empty(self.shape, self.dtype)
        self.run(values, out)
        return out

    def prepare(self, **arrays) -> tuple[dict[str, object], object]:
        """(inputs, output) as TVM tensors on the CPU, ready for ``run``."""
        device = tvm.cpu()
        checked = self._checked(arrays).items()
        views = dict(zip(self.inputs, self.views))
        values = {
            name: tvm.runtime.tensor(np.ascontiguousarray(v, self.dtype).reshape(views[name]), device)
            for name, v in checked
        }
        return values, tvm.runtime.empty(self.views[-1], self.dtype, device)

    def run(self, arrays: Mapping[str, object], out) -> None:
        """Run on prepared buffers: TVM tensors, or C-contiguous, 64-byte aligned numpy arrays of
        the kernel's dtype (a misaligned one is refused, not copied), in the scope's shapes or
        the kernel's ``views``."""
        args = [arrays[name] for name in self.inputs] + [out]
        for arg in args:
            if isinstance(arg, np.ndarray) and not is_aligned(arg):
                raise ValueError(
                    "TvmKernel.run: numpy buffers must be C-contiguous and 64-byte aligned (use prepare())"
                )
        self.function(*viewed(args, self.views))

    def _checked(self, arrays: Mapping[str, object]) -> dict[str, object]:
        missing = sorted(set(self.inputs) - set(arrays))
        if missing:
            raise ExpressionError(f"missing input tensor(s): {', '.join(missing)}")
        for name, shape in self.inputs.items():
            if np.shape(arrays[name]) != tuple(shape):
                raise ExpressionError(
                    f"input {name} has shape {np.shape(arrays[name])}, the kernel expects {tuple(shape)}"
                )
        return {name: arrays[name] for name in self.inputs}

    def listing(self) -> str:
        """The scheduled TIR of the kernel (lowered again: the cache keeps only machine code)."""
        return _module(self.scope, self.dtype, self.schedule, self.target).script()

    def __repr__(self) -> str:
        return f"TvmKernel({self.scope}, dtype={self.dtype}, schedule={self.schedule})"


def _views(scope: Scope, panels=()) -> tuple[tuple[int, ...], ...]:
    """The shapes a kernel compiled here for ``scope`` takes: its inputs', then its output's,
    with the dimensions of merged loops merged (``merge_loops``); a tensor in panels, its panels'."""
    merged = merge_loops(scope)
    shapes = tensor_shapes(merged)
    given = {name: (dim, width) for name, dim, width in panels}
    return (*(_given_shape(name, shapes[name], given) for name in tensor_shapes(scope)), merged.shape)


def _panels(scope: Scope, merged: Scope, params: Schedule) -> tuple[tuple[str, int, int], ...]:
    """The schedule's tensors in panels, each checked: one the merged loops reshape cannot be."""
    before, after = tensor_shapes(scope), tensor_shapes(merged)
    for name, dim, width in params.panels:
        if name not in before or not 0 <= dim < len(before[name]) or after[name] != before[name] or width < 1:
            raise CodegenError(f"{name} cannot be read from panels {width} wide along dimension {dim} in {scope}")
    return params.panels


def unmerged_views(scope: Scope) -> tuple[tuple[int, ...], ...]:
    """The scope's own shapes: what a kernel saved before loops merged takes."""
    return (*tensor_shapes(scope).values(), scope.shape)


def viewed(args, views) -> list:
    """Numpy ``args`` as the kernel's views (reshaped, never copied); TVM tensors as they are."""
    return [a.reshape(v) if isinstance(a, np.ndarray) and a.shape != v else a for a, v in zip(args, views)]


_ALIGNMENT = 64


def _buffer_address(array: np.ndarray) -> int | None:
    """The address of a writable, C-contiguous, non-empty ``array`` through the buffer protocol
    in C; None for any other."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):  # read-only, not C-contiguous, or empty
        return None


def address(array: np.ndarray) -> int:
    """The address of ``array``'s first element, in C where the buffer protocol gives it.
    numpy's ``array.ctypes.data`` runs Python code that a model's kernels have flushed from the
    caches by the time a run binds its arrays: 37 us a call there against 10 this way
    (MobileNetV2 on a Zen 3; 1.6 and 0.5 us warm)."""
    found = _buffer_address(array)
    return array.ctypes.data if found is None else found


def bindable(array: np.ndarray) -> bool:
    """Writable, C-contiguous and aligned: as a kernel takes it, with no copy."""
    found = _buffer_address(array)
    return found is not None and found % _ALIGNMENT == 0


def is_aligned(array: np.ndarray) -> bool:
    return array.flags.c_contiguous and address(array) % _ALIGNMENT == 0


def aligned_empty(shape, dtype) -> np.ndarray:
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    start = -address(raw) % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def aligned_copy(value, dtype) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == dtype and is_aligned(array):
        return array
    copy = aligned_empty(array.shape, dtype)
    copy[...] = array
    return copy


def cache_path(scope: Scope, *, dtype: str = "float32", schedule: Schedule | None = None, target="llvm") -> Path:
    """The cache file of a kernel: named by a sha256 of everything its machine code depends on
    (the scope with its tensors named by position, their shapes, dtype, schedule, target, TVM,
    this module's source, and the L1 cache its register tiles are sized for: ``_set_rows``)."""
    dtype, schedule, target = _normalised(dtype, schedule, target)
    scope, schedule = _positional(scope, schedule)
    shapes = sorted(tensor_shapes(scope).items())
    text = "\n".join(map(str, (scope, shapes, dtype, schedule, target, tvm.__version__, _SOURCE_HASH, _l1_cache())))
    return cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()}.so"


def _normalised(dtype, schedule: Schedule | None, target) -> tuple[str, Schedule, tvm.target.Target]:
    return np.dtype(dtype).name, schedule or DEFAULT_SCHEDULE, host_target(target)


def _positional(scope: Scope, schedule: Schedule) -> tuple[Scope, Schedule]:
    """``scope`` and ``schedule`` with the tensors named by the order the scope first reads them
    (``T0, T1, ..``): the machine code takes them by position, so kernels equal up to their
    tensors' names (a model's twelve layers, a kernel renamed into a program) share one."""
    names = {name: f"T{k}" for k, name in enumerate(tensor_shapes(scope))}
    return rename_tensors(scope, names), _renamed_schedule(schedule, names)


def _renamed_schedule(schedule: Schedule, names: Mapping[str, str]) -> Schedule:
    return replace(schedule, panels=tuple((names.get(n, n), d, w) for n, d, w in schedule.panels))


def compile_scope(
    scope: Scope, *, dtype: str = "float32", schedule: Schedule | None = None, target="llvm"
) -> TvmKernel:
    """Compile ``scope`` into a kernel for ``target`` (``"llvm"``: this CPU), or load it from the
    on-disk cache (where a kernel equal up to its tensors' names may have put it: the machine
    code takes them by position); raises CodegenError when TVM refuses it."""
    path = cache_path(scope, dtype=dtype, schedule=schedule, target=target)
    dtype, schedule, target = _normalised(dtype, schedule, target)
    if path.exists():
        try:
            return TvmKernel(scope, dtype, schedule, target, tvm.runtime.load_module(str(path)), path, True)
        except RuntimeError:
            pass  # a corrupt file: compile again and replace it
    executable = _compile(scope, dtype, schedule, target)
    module = executable.mod
    if _export(executable, path):
        module = tvm.runtime.load_module(str(path))
    return TvmKernel(scope, dtype, schedule, target, module, path if path.exists() else None, False)


def load_kernel(scope: Scope, library: Path, dtype: str, schedule: Schedule, views, target="llvm") -> TvmKernel:
    """A kernel saved as a shared library (``CompiledProgram.save``), for ``scope``, taking
    buffers of the shapes ``views`` (``TvmKernel.views``)."""
    module = tvm.runtime.load_module(str(library))
    return TvmKernel(scope, dtype, schedule, host_target(target), module, library, True, tuple(map(tuple, views)))


def _export(executable, path: Path) -> bool:
    """Write the shared library atomically (temp file, then rename); False if it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            executable.export_library(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except (OSError, RuntimeError) as err:
        warnings.warn(f"kernel cache: cannot write {path}: {err}", RuntimeWarning, stacklevel=3)
        return False


# --------------------------------------------------------------------------------------------
# Candidate schedules for a tuner


def candidate_schedules(scope: Scope, limit: int = 8) -> list[Schedule]:
    """A handful of schedules worth measuring for ``scope``, the default first, the likeliest
    alternatives next."""
    base = DEFAULT_SCHEDULE
    variants = [base]
    if scope.summation:
        variants += [replace(base, reduction_vector=flag) for flag in (False, True)]
        variants += [replace(base, tile=1), replace(base, tile=4), replace(base, tile=8), replace(base, unroll=4)]
    else:
        variants += [replace(base, block=8), replace(base, block=1)]
    variants += [
        replace(base, parallel=1),
        replace(base, parallel=0),
        replace(base, vector=4),
        replace(base, pad=False),
    ]
    return list(dict.fromkeys(variants))[:limit]


# --------------------------------------------------------------------------------------------
# float32 exp, tanh and erf as arithmetic: TVM lowers its own to one libm call per element
# (measured here: exp 3.4 ns, erf 10 ns per element, against 0.3 ns for a polynomial), which
# no loop vectorizes. These agree with libm to about 1e-7 relative; exp gives float32's largest
# value, not infinity, above ln(FLT_MAX), and about FLT_MIN below -87.3.


def _bound(x: tvm.tirx.PrimExpr, fn, name: str = "v") -> tvm.tirx.PrimExpr:
    """``fn(x)`` with x computed once (a Let named ``name``): the formulas read their values
    several times, and a tree would repeat them in the kernel text."""
    if isinstance(x, (tvm.tirx.Var, tvm.tirx.FloatImm)):
        return fn(x)
    value = tvm.tirx.Var(name, "float32")
    return tvm.tirx.Let(value, x, fn(value))


def _f(value: float) -> tvm.tirx.PrimExpr:
    return tvm.tirx.const(value, "float32")


def _horner(x: tvm.tirx.PrimExpr, coefficients) -> tvm.tirx.PrimExpr:
    """c0 + c1 x + c2 x**2 + ..., coefficients from the highest power down."""
    result = _f(coefficients[0])
    for coefficient in coefficients[1:]:
        result = result * x + _f(coefficient)
    return result


# ln of the least normal float32 (1.18e-38), rounded up to a float32 (by 4.5e-6): below it the
# fast exp gives 0, at or above it a normal float32, so no result of it is subnormal
_EXP_LEAST = -87.33654


def _fast_exp(x: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
    """exp(x) = 2**n exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 in two
    parts, so r is exact), exp(r) by its Taylor polynomial to r**7 (error below 2e-8), 2**n made
    in the exponent bits (n runs from -126 to 128, where it is 2 * 2**127); 0 below
    ``_EXP_LEAST``. Clamped there instead, a causal mask's -3.4e38 made exp 1.2e-38 where the
    reference's is 0, and softmax's division by the row's sum then a subnormal, which every
    later multiply-add takes as a microcode assist: GPT-2's attention-weighted values (12 x
    32x32 @ 32x64, half their weights subnormal) took 0.5 ms each in the model on an Intel
    Xeon, 6 ms of its 51, and 0.011 alone on random inputs."""

    def scaled(c, n):
        def power(r):
            top = tvm.tirx.min(n, _f(127.0))  # 2**128 is 2 * 2**127
            bits = (top.astype("int32") + tvm.tirx.const(127, "int32")) << tvm.tirx.const(23, "int32")
            poly = _horner(r, (1 / 5040, 1 / 720, 1 / 120, 1 / 24, 1 / 6, 0.5, 1.0, 1.0))
            twice = tvm.tirx.Select(n > _f(127.0), _f(2.0), _f(1.0))
            return poly * twice * tvm.tirx.reinterpret("float32", bits)

        return _bound(c - n * _f(0.693359375) + n * _f(2.12194440e-4), power, "r")

    def reduced(c):
        return _bound(tvm.tirx.floor(c * _f(1.4426950408889634) + _f(0.5)), lambda n: scaled(c, n), "n")

    def clamped(v):
        value = _bound(tvm.tirx.min(tvm.tirx.max(v, _f(_EXP_LEAST)), _f(88.72)), reduced, "c")
        return tvm.tirx.Select(v < _f(_EXP_LEAST), _f(0.0), value)

    return _bound(x, clamped, "x")


def _odd_rational(x: tvm.tirx.PrimExpr, p, q, bound: float) -> tvm.tirx.PrimExpr:
    """x P(x**2) / Q(x**2) with x clamped to +-bound: erf's and tanh's form (odd, flat past the
    bound in float32)."""

    def rational(v):
        return _bound(v * v, lambda s: v * _horner(s, p) / _horner(s, q), "s")

    return _bound(tvm.tirx.min(tvm.tirx.max(x, _f(-bound)), _f(bound)), rational, "c")


# tanh(x) = x P(x**2) / Q(x**2) for |x| <= 9, coefficients from the highest power down: P and Q
# of degree 4, each with its constant 1 (tanh's slope at 0, so the error stays relative near 0).
# Fitted here as ``_ERF_P`` was, against numpy's tanh on 8000 points of [0, 9] (weights
# 1 / (|Q| tanh)), Lawson's reweighting toward the minimax.
_TANH_P = (1.3460070547293562e-08, 2.069446601623864e-05, 0.003501159527765354, 0.13385838130814767, 1.0)
_TANH_Q = (7.822484146636837e-07, 0.0003294481577869504, 0.025898556179904147, 0.46719159865581583, 1.0)
_TANH_BOUND = 9.0  # tanh(9) = 1 - 3e-8: 1 in float32


def _fast_tanh(x: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
    """tanh(x) as a rational function of x clamped to +-9 (``_TANH_P``, ``_TANH_Q``): within
    3e-7 relative in float32 arithmetic, one division and 10 multiply-adds per element. The
    formula it replaced (``sign(x) (1 - t) / (1 + t)``, t = exp(-2|x|), a Taylor series below
    |x| = 0.3 and a select between the two) cost two to three times as much. Measured on AMD EPYC
    (Zen 3), old and new code in alternating processes (``bench/scalar_functions.py``): tanh over
    64x56x56 0.14-0.15 ms before, 0.045-0.051 after; GPT-2's GELU over 197x3072 0.55-0.58 and
    0.216-0.217; x * sigmoid(x) (sigmoid goes through tanh) over 256x28x28 0.16-0.18 and
    0.058-0.064."""
    return _odd_rational(x, _TANH_P, _TANH_Q, _TANH_BOUND)


# erf(x) = x P(x**2) / Q(x**2) for |x| <= 4, coefficients from the highest power down: P of
# degree 6 with its constant 2/sqrt(pi) (erf's slope at 0, so the error stays relative near 0),
# Q of degree 4 with its constant 1. Fitted here with numpy against math.erf on 8000 points of
# [0, 4] (Chebyshev-spaced and uniform): x P - erf(x) Q = 0 solved by least squares, linearised
# (weights 1 / (|Q| max(erf, 1e-3))), 200 steps of Lawson's reweighting toward the minimax.
_ERF_P = (
    1.9117895336262514e-08,
    -1.957693076161046e-06,
    0.00015025175634141583,
    0.00410422120322435,
    0.05187585800823293,
    0.20970760944670788,
    2 / math.sqrt(math.pi),
)
_ERF_Q = (0.001049470594648174, 0.015184997648559781, 0.11904658175944827, 0.5191794620197939, 1.0)
_ERF_BOUND = 4.0  # erf(4) = 1 - 1.5e-8: 1 in float32


def _fast_erf(x: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
    """erf(x) as a rational function of x clamped to +-4 (``_ERF_P``, ``_ERF_Q``): within 4.1e-7
    relative in float32 arithmetic (5.7e-7 as LLVM contracts it), one division and 12
    multiply-adds per element. The formula it replaced (Abramowitz and Stegun 7.1.26 with an
    exponential, a Taylor series near 0, and a select between the two) cost more than twice as
    much. Measured on AMD EPYC (Zen 3), old and new code in alternating processes: ConvNeXt's
    GELU over 14x14x1536 0.25-0.26 ms before, 0.094-0.107 after; with the 196x384 @ 384x1536
    product and bias it follows, in panels, 1.73-2.07 ms before, 1.40-1.55 after (the product
    and bias alone 1.34-1.83)."""
    return _odd_rational(x, _ERF_P, _ERF_Q, _ERF_BOUND)
