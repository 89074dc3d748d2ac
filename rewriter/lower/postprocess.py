"""Post-processing (OLLIE 5.4): identity eOperators dropped, an eOperator fused into the
eOperator that alone reads it (``fusion``: kept by codegen only where it measures faster),
kernels that read only weights marked for compile-time evaluation.
"""

from __future__ import annotations

from dataclasses import replace

from rewriter.ir import Access, Tensor, constants_among, rename_tensors, tensor_shapes

from .fusion import fuse, fusion_pairs, readers
from .kernels import Candidate, Kernel


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
    """``kernels`` with those that read only weights (and their products) marked weight-only,
    and each kernel's weight inputs named; the program's final kernel is never marked."""
    every_read = set().union(*(tensor_shapes(k.expr) for k in kernels))
    constant, marked = set(weights) | set(constants_among(every_read)), []  # a rule's constant tables too
    for kernel in kernels:
        reads = set(tensor_shapes(kernel.expr))
        only = kernel.output != kernels[-1].output and reads <= constant
        marked.append(Kernel(kernel.kind, kernel.output, kernel.expr, kernel.match, only, frozenset(reads & constant)))
        if only:
            constant.add(kernel.output)
    return marked


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
            kernels[kernels.index(producer)] = replace(producer, output=kernel.output)
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
    for k in readers(kernels, old):
        reader = kernels[k]
        kernels[k] = reader.with_expr(rename_tensors(reader.expr, {old: new}))


def _fuse_eops(kernels: list[Kernel]) -> bool:
    pairs = fusion_pairs(kernels)
    if not pairs:
        return False
    producer, consumer = pairs[0]
    kernels[consumer] = fuse(kernels[producer], kernels[consumer])
    del kernels[producer]
    return True
