"""The property harness: prove a rule sound on an expression by evaluating every application.

    from rewriter.testing import assert_sound
    assert_sound(my_rule, expr)          # raises AssertionError naming the bad application

Use it inside a hypothesis test over the strategies of ``rewriter.testing.strategies``
(``applicable(my_rule)``, ``expressions()``, ``programs()``; see README, "Writing a rule").
This module needs numpy only; ``rewriter.testing.strategies`` needs hypothesis
(``pip install "rewriter[testing]"``).
"""

from __future__ import annotations

import numpy as np

from rewriter.ir import Program, Scope, replace_at, scopes_at, tensor_shapes
from rewriter.lower import OPERATORS
from rewriter.search import Rule
from rewriter.semantics import evaluate


def applications(rule_: Rule, expr: Scope | Program, targets=None) -> list:
    """The whole expression after each application of the rule, at every scope position.

    A guided rule declared with ``targets=True`` is applied toward each of ``targets`` (iterator
    mapping tables; default: every matchable operator's, as guided derivation does), and equal
    results count once."""
    if rule_.targets:
        targets = tuple(operator.table for operator in OPERATORS) if targets is None else tuple(targets)
    else:
        targets = (None,)

    def apply(scope):
        return list(dict.fromkeys(result for target in targets for result in rule_.apply(scope, target=target)))

    if isinstance(expr, Program):
        return apply(expr)
    return [replace_at(expr, position, result) for position, scope in scopes_at(expr) for result in apply(scope)]


def random_inputs(
    expr: Scope | Program, seed: int = 0, *, low: float = -1.0, high: float = 1.0, integer_valued: bool = False
) -> dict[str, np.ndarray]:
    """Random float64 arrays, uniform in [low, high], for every input tensor of a Scope or Program
    (numpy ``default_rng(seed)``, tensors in ``tensor_shapes`` order). ``integer_valued`` draws
    whole numbers in [low, high] instead (exact arithmetic)."""
    rng = np.random.default_rng(seed)
    if integer_valued:
        lo, hi = int(np.ceil(low)), int(np.floor(high))
        return {
            name: rng.integers(lo, hi + 1, size=shape).astype(np.float64) for name, shape in tensor_shapes(expr).items()
        }
    return {name: rng.uniform(low, high, shape) for name, shape in tensor_shapes(expr).items()}


def assert_sound(
    rule_: Rule,
    expr: Scope | Program,
    inputs: dict | None = None,
    *,
    rtol: float = 1e-9,
    atol: float = 1e-9,
    targets=None,
) -> int:
    """Every application of ``rule_`` to ``expr`` (see ``applications``) evaluates equal to
    ``expr`` on ``inputs`` (default: ``random_inputs(expr)``); returns how many there are."""
    inputs = random_inputs(expr) if inputs is None else inputs
    expected = _outputs(evaluate(expr, inputs))
    results = applications(rule_, expr, targets)
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
