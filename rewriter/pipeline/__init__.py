"""The pipeline: ``derive`` (OLLIE Algorithm 2: search, guided steps, instantiation,
verification, selection by measured cost) and ``optimize_program`` (Algorithm 1: a whole program,
subprogram by subprogram, stitched and post-processed). Receives its code generator as a
``codegen.backend`` object."""

from .derive import Derivation, derive
from .program import (
    OptimizedProgram,
    Subprogram,
    blocked_layouts,
    fold_weights,
    fuse_elementwise,
    load_optimized,
    merge_parallel,
    optimize_program,
    orchestrate_program,
    orchestrations,
    runners_up_raced,
)

__all__ = [
    "Derivation",
    "OptimizedProgram",
    "Subprogram",
    "blocked_layouts",
    "derive",
    "fold_weights",
    "fuse_elementwise",
    "load_optimized",
    "merge_parallel",
    "optimize_program",
    "orchestrate_program",
    "orchestrations",
    "runners_up_raced",
]
