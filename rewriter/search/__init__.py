"""The search: the rule DSL (``dsl``), exact fingerprints (``fingerprint``), the search's
e-classes and e-nodes (``classes``) and the explorative derivation over the e-graph
(``explore``). Depends on ``rewriter.ir``, ``rewriter.index`` and ``rewriter.egraph``; finds the
rules of the ``rules`` package at run time and never names one."""

from .dsl import KINDS, Rule, RuleError, fresh_name, pattern, registered, rule, substitute_traversal
from .explore import Exploration, RoundStats, SearchStats, State, Step, eager_closure, explore, explore_levels
from .fingerprint import canonical, fingerprint

__all__ = [
    "KINDS",
    "Exploration",
    "RoundStats",
    "Rule",
    "RuleError",
    "SearchStats",
    "State",
    "Step",
    "canonical",
    "eager_closure",
    "explore",
    "explore_levels",
    "fingerprint",
    "fresh_name",
    "pattern",
    "registered",
    "rule",
    "substitute_traversal",
]
