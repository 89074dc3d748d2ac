"""The reference semantics: ``evaluate(expr, inputs)`` in numpy, the ground truth every rule,
candidate and compiled program is checked against. Depends on ``rewriter.ir`` and
``rewriter.index``."""

from .reference import evaluate

__all__ = ["evaluate"]
