"""The e-graph. Depends on ``rewriter.ir`` and egglog.

``language``  the e-graph language declared once: a table of constructors, and from it the
              egglog-python classes rules are written over, the writer and the readers
``graph``     ``ExpressionGraph``, the e-graph scopes are inserted into, and ``eager_rules``
``adapter``   every use of egglog-python beyond its documented API
``extract``   the cheapest program of an e-class, by the caller's kernel costs
"""

from .extract import extract
from .graph import ExpressionGraph, GraphStats, eager_rules
from .language import (
    CONSTRUCTORS,
    IndexListTerm,
    IndexTerm,
    IterListTerm,
    IterTerm,
    ScalarTerm,
    ScopeTerm,
    TensorTerm,
)

__all__ = [
    "CONSTRUCTORS",
    "ExpressionGraph",
    "GraphStats",
    "IndexListTerm",
    "IndexTerm",
    "IterListTerm",
    "IterTerm",
    "ScalarTerm",
    "ScopeTerm",
    "TensorTerm",
    "eager_rules",
    "extract",
]
