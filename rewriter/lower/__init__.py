"""Instantiation (OLLIE 4.3): scopes become operator calls or eOperators, then post-processing.

* ``tables``: iterator mapping tables (Table 2) and the matching step every operator shares;
* ``operators``: one record per matchable operator (table, constraints, implementations,
  flops) and ``match_operator``; adding an operator is adding a record there;
* ``layouts``: layout eOperators that let an operator match re-laid-out operands;
* ``kernels``: ``Kernel`` and ``Candidate`` (kernels in execution order);
* ``instantiate``: an expression to a ``Candidate``; ``postprocess``: OLLIE 5.4;
* ``fusion``: the fusion primitive and its policies (which pairs may fuse, who decides);
* ``orchestrate``: Korch's primitive graph, candidate kernels and binary linear program.

Depends on ``rewriter.ir``, ``rewriter.index`` and ``rewriter.semantics``.
"""

from .fusion import absorbs, fuse, fusion_pairs, inner_product, is_view
from .instantiate import instantiate, wants_operator
from .kernels import Candidate, Kernel, multiply_adds
from .operators import (
    BATCH_MATMUL,
    CONV2D,
    G2BMM,
    GBMM,
    MATMUL,
    OPERATORS,
    BandMatch,
    ConvMatch,
    GemmMatch,
    Operand,
    Operator,
    band_constraints,
    conv_constraints,
    gemm_constraints,
    match_operator,
    operand_view,
    point_flops,
    run_gemm,
)
from .postprocess import mark_weight_only, postprocess
from .tables import Filled, Group, IndexForm, IteratorTable, Read, Window, fill

__all__ = [
    "BATCH_MATMUL",
    "CONV2D",
    "G2BMM",
    "GBMM",
    "MATMUL",
    "OPERATORS",
    "BandMatch",
    "Candidate",
    "ConvMatch",
    "Filled",
    "GemmMatch",
    "Group",
    "IndexForm",
    "IteratorTable",
    "Kernel",
    "Operand",
    "Operator",
    "Read",
    "Window",
    "band_constraints",
    "conv_constraints",
    "fill",
    "absorbs",
    "fuse",
    "fusion_pairs",
    "gemm_constraints",
    "instantiate",
    "inner_product",
    "is_view",
    "mark_weight_only",
    "match_operator",
    "multiply_adds",
    "point_flops",
    "postprocess",
    "operand_view",
    "run_gemm",
    "wants_operator",
]
