"""Fusion (OLLIE 4.1 expression fusion, 5.4 post-processing): one primitive, three policies.

The primitive is the chain rule, ``rewriter.ir.inline``: the consumer reads its producer as a
nested scope (computed once, as a stage of the consumer's kernel). Every fusion the system makes
is that primitive; the policies say which pairs may fuse, and who decides whether they do:

===========================================  ================================  =========================
where                                        which pairs (here)                who decides
===========================================  ================================  =========================
a program's definitions, before derivation   ``absorbs(reader, producer)``:    the policy itself: the
(Algorithm 1; ``pipeline.program``, through  an element-wise producer into a   rule ``expression fusion``
the inter rule ``expression fusion``)        reader that sums nothing, or an   proposes, it admits
                                             unfolding view or a reshape of
                                             unit dimensions into any reader
a candidate's kernels (post-processing;      ``fusion_pairs(kernels)``: an     measurement: codegen keeps
``postprocess``, then ``codegen.program``)   eOperator read by exactly one     a fusion only where the
                                             later kernel, an eOperator        fused kernel is faster
a stitched program (``orchestrate``,         convex sets of eOperators with    a binary linear program
``codegen.orchestrate``; Korch)              one output (convex_candidates)    over measured, checked
                                                                               candidate kernels
===========================================  ================================  =========================

The last two make no kernel whose scopes, counted as a tree, pass ``MAX_TREE_SCOPES``.
"""

from __future__ import annotations

import math

from rewriter.ir import Access, Lit, Scope, Tensor, accesses, inline, nested_scopes, scopes_at, tensor_shapes

from .kernels import Kernel
from .operators import match_operator

# A fused kernel's scopes counted as a tree: a producer read k times is inlined k times, and the
# code that walks a kernel by position (``scopes_at``: matching its product, its layouts) walks
# every copy. MobileViT's reshapes and layer norms, fused pair by pair, grew so that the greedy
# pass spent minutes in one fusion and did not end; BERT's largest fused kernel holds 260.
MAX_TREE_SCOPES = 1024


def tree_scopes(expr: Scope) -> int:
    """The scopes of ``expr`` counted as a tree (a nested scope read twice counts twice)."""
    return _tree_counts(expr, "", {})[0]


def fusible_size(producer: Kernel, consumer: Kernel) -> bool:
    """Whether ``fuse(producer, consumer)`` holds at most ``MAX_TREE_SCOPES`` scopes as a tree
    (counted without building it: each read of the producer becomes a copy of it)."""
    if not isinstance(producer.expr, Scope) or not isinstance(consumer.expr, Scope):
        return True
    scopes, reads = _tree_counts(consumer.expr, producer.output, {})
    return scopes + reads * tree_scopes(producer.expr) <= MAX_TREE_SCOPES


def _tree_counts(expr: Scope, name: str, memo: dict) -> tuple[int, int]:
    """(scopes, reads of tensor ``name``) in ``expr`` counted as a tree, each distinct scope once."""
    if expr not in memo:
        scopes, reads = 1, 0
        for access in accesses(expr.body):
            if isinstance(access.source, Scope):
                inner = _tree_counts(access.source, name, memo)
                scopes, reads = scopes + inner[0], reads + inner[1]
            else:
                reads += access.source.name == name
        memo[expr] = (scopes, reads)
    return memo[expr]


def fuse(producer: Kernel, consumer: Kernel) -> Kernel:
    """The eOperator computing ``consumer`` with ``producer`` inside it."""
    fused = inline(consumer.expr, producer.output, producer.expr)
    weights = (producer.weights | consumer.weights) & set(tensor_shapes(fused))
    return Kernel("eop", consumer.output, fused, None, producer.weight_only and consumer.weight_only, weights)


def inner_product(kernel: Kernel) -> tuple[tuple[int, ...], Kernel] | None:
    """Where a kernel's product lies (a position, ``scopes_at``'s) and that product as a kernel
    of its own: the kernel itself, at (), where an operator matched it; in an eOperator, its one
    nested scope that sums, where an operator matches that scope and nothing else in the
    eOperator sums (a product with its epilogue around it: a bias, an activation, a residual
    sum; the fusion ``fuse`` made, seen from the product's side). Else None. An implementation
    that computes the product in a layout of its own computes the epilogue where it lays the
    product out (``codegen.packed``, ``codegen.panels``)."""
    if kernel.match is not None:
        return (), kernel
    if kernel.kind != "eop":
        return None
    summing = [(position, scope) for position, scope in scopes_at(kernel.expr) if scope.summation]
    if len(summing) != 1 or not summing[0][0]:
        return None
    position, scope = summing[0]
    kind, match = match_operator(scope)
    if match is None:
        return None
    weights = kernel.weights & set(tensor_shapes(scope))
    return position, Kernel(kind, f"{kernel.output}.product", scope, match, weights=frozenset(weights))


def readers(kernels: list[Kernel], name: str) -> list[int]:
    """Positions of the kernels that read tensor ``name``."""
    return [k for k, kernel in enumerate(kernels) if name in tensor_shapes(kernel.expr)]


def fusion_pairs(kernels: list[Kernel]) -> list[tuple[int, int]]:
    """(producer, consumer) positions where an eOperator is read by exactly one later kernel,
    itself an eOperator, and the two fused stay within ``MAX_TREE_SCOPES``: the pairs eOperator
    fusion may merge."""
    pairs = []
    for index, producer in enumerate(kernels[:-1]):
        read_by = readers(kernels, producer.output)
        if producer.kind == "eop" and len(read_by) == 1 and kernels[read_by[0]].kind == "eop":
            if fusible_size(producer, kernels[read_by[0]]):
                pairs.append((index, read_by[0]))
    return pairs


def absorbs(reader: Scope, producer: Scope) -> bool:
    """Whether a program-level fusion of definition ``producer`` into its only ``reader`` is
    worth making before derivation: when the reader computes no sum of its own (an activation
    joins the operator before it, so its work fuses into that operator's eOperator), or the
    producer is an unfolding view (its body one read, writing more elements than its source
    holds: a band unfold, a broadcast), whose copy would cost more than the reader reading the
    source directly. Fusing arithmetic into a reader that sums would repeat it per term, and
    would grow one subprogram to the whole model; a reshape or a transpose stays a copy that
    leaves the reader's operand in a layout operators match, unless it only drops or adds
    dimensions of one element (``_unit_reshape``): the reader then reads the same memory in the
    same order, its index still affine, and the copy is pure cost (ViT's query, key and value
    products each read a copy of their 197x768 input made from the 1x197x768 one)."""
    return not _sums(reader) or _unfolds(producer) or _unit_reshape(producer)


def is_view(expr: Scope) -> bool:
    """A scope that only moves elements: no sum, its body one read."""
    return not expr.summation and isinstance(expr.body, Access)


def _unfolds(expr: Scope) -> bool:
    """A view that writes more elements than its source holds (each read several times)."""
    return is_view(expr) and math.prod(expr.shape) > math.prod(expr.body.source.shape)


def _unit_reshape(expr: Scope) -> bool:
    """A view that reads its source whole, in order, dropping or adding dimensions of extent 1:
    ``L i:197, j:768 ; X[0, i, j]`` over X of shape 1x197x768."""
    if not is_view(expr) or any(it.lo for it in expr.traversal) or not isinstance(expr.body.source, Tensor):
        return False
    if math.prod(expr.shape) != math.prod(expr.body.source.shape):
        return False
    read = [ix for ix, d in zip(expr.body.indices, expr.body.source.shape) if d != 1]
    units = [ix for ix, d in zip(expr.body.indices, expr.body.source.shape) if d == 1]
    iterators = [it for it in expr.traversal if it.size != 1]
    return read == [it.var for it in iterators] and all(ix == Lit(0) for ix in units)


def _sums(expr: Scope) -> bool:
    return any(scope.summation for scope in (expr, *nested_scopes(expr)))
