"""Derivation rules and iterator mapping tables, each written in the rule DSL of ``rewriter``.

A researcher adds a rule by adding a module here; ``rewriter.search.dsl.registered()`` imports every
module of this package, and the engine never names a rule.
"""
