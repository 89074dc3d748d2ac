"""The property harness: prove a rule sound on an expression by evaluating every application.

    from rewriter.testing import assert_sound
    assert_sound(my_rule, expr)          # raises AssertionError naming the bad application

Use it inside a hypothesis test over ``tests/strategies.py`` expressions (see README).
"""

from __future__ import annotations

import numpy as np

from rewriter.ir import Program, Scope, replace_at, scopes_at, tensor_shapes
from rewriter.search import Rule
from rewriter.semantics import evaluate


def applications(rule_: Rule, expr: Scope | Program) -> list:
    """The whole expression after each application of the rule, at every scope position."""
    if isinstance(expr, Program):
        return rule_.apply(expr)
    return [replace_at(expr, position, result) for position, scope in scopes_at(expr) for result in rule_.apply(scope)]


def random_inputs(expr: Scope | Program, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(-1, 1, shape) for name, shape in tensor_shapes(expr).items()}


def assert_sound(
    rule_: Rule, expr: Scope | Program, inputs: dict | None = None, *, rtol: float = 1e-9, atol: float = 1e-9
) -> int:
    """Every application of ``rule_`` to ``expr`` evaluates equal to ``expr``; returns how many."""
    inputs = random_inputs(expr) if inputs is None else inputs
    expected = _outputs(evaluate(expr, inputs))
    results = applications(rule_, expr)
    for result in results:
        got = _outputs(evaluate(result, inputs))
        if not all(
            g.shape == e.shape and np.allclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
            for g, e in zip(got, expected)
        ):
            worst = max(
                float(np.nanmax(np.abs(g - e))) if g.shape == e.shape else np.inf for g, e in zip(got, expected)
            )
            raise AssertionError(
                f"rule {rule_.name!r} is unsound here (max error {worst:.3g}):\n  {expr}\n=>\n  {result}"
            )
    return len(results)


def _outputs(value) -> tuple:
    """A program's outputs as a tuple (a scope, or a one-output program, gives one)."""
    return value if isinstance(value, tuple) else (value,)
