"""The reference semantics: ``evaluate(expr, inputs)`` in numpy, the ground truth every rule,
candidate and compiled program is checked against; opaque operations as numpy functions
(``run_opaque``) and inputs valid for them (``sample_inputs``). Depends on ``rewriter.ir`` and
``rewriter.index``."""

from .opaque import OPAQUE, bound_constants, index_bounds, run_opaque, sample_inputs
from .reference import evaluate

__all__ = ["OPAQUE", "bound_constants", "evaluate", "index_bounds", "run_opaque", "sample_inputs"]
