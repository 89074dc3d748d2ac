"""The e-graph: the expression language as egglog terms (``graph``), the graph scopes are
inserted into, and extraction of the cheapest program of an e-class (``extract``). Depends on
``rewriter.ir`` and egglog."""

from .extract import extract
from .graph import (
    CONSTRUCTORS,
    DEFAULT_BATCH_SIZE,
    ExpressionGraph,
    GraphStats,
    IndexListTerm,
    IndexTerm,
    IterListTerm,
    IterTerm,
    ScalarTerm,
    ScopeTerm,
    TensorTerm,
    eager_rules,
    from_egglog,
    from_termdag,
    to_egglog,
    to_term,
)

__all__ = [
    "CONSTRUCTORS",
    "DEFAULT_BATCH_SIZE",
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
    "from_egglog",
    "from_termdag",
    "to_egglog",
    "to_term",
]
