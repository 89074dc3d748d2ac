"""Instantiation (OLLIE 4.3): scopes become operator calls or eOperators, then post-processing.

``operators`` holds the matchable operators' iterator mapping tables; ``instantiate`` turns an
expression into a ``Candidate`` (kernels in execution order). Depends on ``rewriter.ir``,
``rewriter.index`` and ``rewriter.semantics``.
"""

from .instantiate import (
    BandMatch,
    Candidate,
    ConvMatch,
    GemmMatch,
    Kernel,
    Operand,
    fuse,
    fusion_pairs,
    instantiate,
    mark_weight_only,
    match_band,
    match_conv,
    match_gemm,
    match_operator,
    postprocess,
    rename_tensor,
    run_gemm,
    wants_operator,
)

__all__ = [
    "BandMatch",
    "Candidate",
    "ConvMatch",
    "GemmMatch",
    "Kernel",
    "Operand",
    "fuse",
    "fusion_pairs",
    "instantiate",
    "mark_weight_only",
    "match_band",
    "match_conv",
    "match_gemm",
    "match_operator",
    "postprocess",
    "rename_tensor",
    "run_gemm",
    "wants_operator",
]
