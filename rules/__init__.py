"""Derivation rules (OLLIE Table 1), one module each, written in the rule DSL (``rewriter.search.dsl``).

A researcher adds a rule by adding a module here; ``rewriter.search.dsl.registered()`` imports
every module of this package, and the engine never names a rule. Rules see the IR
(``rewriter.ir``), the index algebra (``rewriter.index``) and the DSL only (an import contract
in pyproject.toml checks it).
"""
