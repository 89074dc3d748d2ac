"""Dependence analyses on the IR's access relations (islpy): SOUFFLE section 5, SIRIUS section 3.

* ``relies(scope)``: SOUFFLE's intra-expression dependence. "one-on-one": no summation anywhere,
  each output element reads one element of each input through a quasi-affine map;
  "one-on-many": a reduction, each output element reads a region.
* ``intensity(scope)``: scalar operations per byte moved (SOUFFLE's compute/memory ratio).
* ``width(consumer, tensor)``: SIRIUS's dependence width of a consumer on a tensor it reads, with
  a consumer's output element as a thread and a slice of its outermost loop of more than one
  iteration (where codegen's parallel loops start; a batch of one is no block loop) as a block,
  and likewise for the tensor's slices of its outermost dimension longer than one:

  - "element-wise" (thread level): every output element of the consumer reads one element of the
    tensor, so the producer can be composed into the consumer's loop nest (fuse freely);
  - "tile-local" (block level): every slice of the consumer reads within one slice of the tensor
    (a row-wise reduction, a matmul's left operand), so both can share one tile loop;
  - "global": a slice of the consumer needs elements of several slices (a column sum, a
    matmul's right operand, a window across the outermost dimension): the producer must be
    complete first, a barrier between them.

  Reads inside a nested scope count as needed by every output element (a nested scope is a
  stage of its own, computed whole): a conservative, wider answer. Reads outside the tensor's
  bounds are padding, not dependencies.
* ``reused(kernels)``: the tensors several kernels read (SOUFFLE's reuse across expressions).
"""

from __future__ import annotations

from typing import Sequence

import islpy as isl

from rewriter.index import index_map
from rewriter.ir import Access, Opaque, Scope, Tensor, accesses, nested_scopes, tensor_shapes

from .kernels import Kernel, moved_bytes, work

WIDTHS = ("element-wise", "tile-local", "global")  # narrowest first


def relies(scope: Scope) -> str:
    """SOUFFLE's dependence class: "one-on-many" for a reduction, else "one-on-one"."""
    return "one-on-many" if any(s.summation for s in (scope, *nested_scopes(scope))) else "one-on-one"


def intensity(scope: Scope) -> float:
    """Scalar operations (reads counted) per byte the scope reads and writes (4-byte elements)."""
    return work(scope) / moved_bytes(scope)


def width(consumer: Scope | Opaque, tensor: str) -> str:
    """SIRIUS's dependence width of ``consumer`` on ``tensor`` (see the module docstring);
    "element-wise", which constrains nothing, where the consumer does not read it; "global" for
    an opaque operation (its reads are not affine)."""
    if isinstance(consumer, Opaque):
        return "global" if tensor in tensor_shapes(consumer) else "element-wise"
    shape = tensor_shapes(consumer).get(tensor)
    if shape is None:
        return "element-wise"
    sliced = _first_long(consumer.shape), _first_long(shape)  # the blocks: slices of these
    if any(_root_reads(scope, tensor) for scope in nested_scopes(consumer)):
        return "global" if None not in sliced else "tile-local"  # the nested stage's whole image
    reads = _root_reads(consumer, tensor)
    if not reads:
        return "element-wise"
    relation = _relation(consumer, reads, shape)
    if relation.is_single_valued():
        return "element-wise"
    if None in sliced or _between(relation, *sliced).is_single_valued():
        return "tile-local"
    return "global"


def _root_reads(scope: Scope, tensor: str) -> list[Access]:
    return [a for a in accesses(scope.body) if isinstance(a.source, Tensor) and a.source.name == tensor]


def _first_long(shape: tuple[int, ...]) -> int | None:
    """The outermost dimension with more than one slice (a batch of 1 is not a block loop)."""
    return next((k for k, n in enumerate(shape) if n > 1), None)


def _relation(consumer: Scope, reads: Sequence[Access], shape: tuple[int, ...]) -> isl.Map:
    """``{ consumer output element -> tensor element it needs }`` over the tensor's bounds: the
    reads' index maps over traversal and summation, the summation projected out."""
    iterators = (*consumer.traversal, *consumer.summation)
    inside = isl.Set("{ [%s] : %s }" % (", ".join(f"e{k}" for k in range(len(shape))), _bounds(shape)))
    relation = None
    for read in reads:
        m = index_map(read.indices, iterators).intersect_range(inside)
        m = m.project_out(isl.dim_type.in_, len(consumer.traversal), len(consumer.summation))
        relation = m if relation is None else relation.union(m)
    return relation


def _bounds(shape: tuple[int, ...]) -> str:
    return " and ".join(f"0 <= e{k} < {n}" for k, n in enumerate(shape)) or "true"


def _between(relation: isl.Map, loop: int, dim: int) -> isl.Map:
    """The relation between one loop of the consumer and one dimension of the tensor."""
    for kind, keep in ((isl.dim_type.in_, loop), (isl.dim_type.out, dim)):
        relation = relation.project_out(kind, keep + 1, relation.dim(kind) - keep - 1).project_out(kind, 0, keep)
    return relation


def reused(kernels: Sequence[Kernel]) -> dict[str, int]:
    """The tensors read by more than one of ``kernels``, with how many read each."""
    counts: dict[str, int] = {}
    for kernel in kernels:
        for name in tensor_shapes(kernel.expr):
            counts[name] = counts.get(name, 0) + 1
    return {name: n for name, n in counts.items() if n > 1}
