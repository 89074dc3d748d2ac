"""The rule DSL: how a researcher declares a derivation rule.

A parametric rule is a Python generator from a scope to equivalent scopes::

    from rewriter.search.dsl import rule

    @rule("summation splitting", section="4.2", kind="explorative")
    def split_summation(scope):
        '''Split the summation into an outer and an inner one (OLLIE 4.2).'''
        ...
        yield new_scope

The engine applies every registered rule to every scope it reaches (roots and nested scopes),
so a rule only ever looks at one scope; one declared ``shallow=True`` reads the scopes nested in
it only as tensors of their box, and is applied once per e-node (nested scopes as e-classes).
Kinds: ``explorative`` rules cost one unit of
``max_depth``; ``eager`` rules (traversal merging, simplification) are applied to a fixpoint after
every step and cost nothing; ``guided`` rules are applied by guided derivation (OLLIE 5.2) to
scopes that have an operator's shape but match no operator; one declared with ``targets=True``
takes the target operator's iterator mapping table as a second argument (OLLIE's
GUIDEDDERIVE(E, T)) and proposes nothing without one; ``inter`` rules are OLLIE's
inter-expression rules (fusion, merging into a batch): generators from a Program to equivalent
Programs, which the program-level optimizer applies before derivation (Algorithm 1); ``layout``
rules are such generators too, each variant storing some of the program's tensors in another
layout (channels in blocks), which the optimizer takes where the whole program runs faster.

A pattern rule is an egglog rewrite over the term classes of ``rewriter.egraph`` and runs natively
inside the e-graph: ``pattern("x * 1", section=..., rewrite=rewrite(x * one).to(x))``.

Adding a rule means adding a module to ``rules/``; the engine finds it through ``registered()``
and never names a rule.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Iterable

from egglog import EGraph

from rewriter.index import check_substitution
from rewriter.ir import ExpressionError, Program, Scope, substitute

KINDS = ("explorative", "eager", "guided", "inter", "layout")


class RuleError(ExpressionError):
    """A rule was declared wrongly, or produced something that is not an equivalent scope."""


@dataclass(frozen=True)
class Rule:
    name: str
    section: str
    kind: str
    doc: str
    generate: Callable[[Scope], Iterable[Scope]] | None = field(default=None, compare=False)
    rewrites: tuple = field(default=(), compare=False)
    targets: bool = False  # a guided rule that takes the target operator's iterator mapping table
    shallow: bool = False  # reads nested scopes only as tensors of their box: applied once per e-node

    @property
    def on_programs(self) -> bool:
        """Inter-expression and layout rules rewrite whole programs; every other kind one scope."""
        return self.kind in ("inter", "layout")

    def apply(self, scope: Scope | Program, target=None) -> list:
        """Every right-hand side of the rule on ``scope``, each checked to have the same outputs.
        ``target``: for a rule declared with ``targets=True``, the iterator mapping table of the
        operator the scope is guided toward (passed as the generator's second argument; without
        one such a rule proposes nothing); other rules ignore it."""
        if self.generate is None or isinstance(scope, Program) != self.on_programs:
            return []
        if self.targets and target is None:
            return []
        results = []
        try:
            for result in self.generate(scope, target) if self.targets else self.generate(scope):
                if not isinstance(result, type(scope)):
                    raise RuleError(f"rule {self.name!r} yielded {type(result).__name__}, not a {type(scope).__name__}")
                if isinstance(scope, Program):
                    if _outputs(result) != _outputs(scope):
                        raise RuleError(
                            f"rule {self.name!r} changed the outputs of a program: {_outputs(scope)} became {_outputs(result)}"
                        )
                elif result.shape != scope.shape or [it.lo for it in result.traversal] != [
                    it.lo for it in scope.traversal
                ]:
                    raise RuleError(
                        f"rule {self.name!r} changed the output box of a scope: "
                        f"{_box(scope)} became {_box(result)} (in: {scope})"
                    )
                if result != scope:
                    results.append(result)
        except RuleError:
            raise
        except ExpressionError as err:
            raise RuleError(f"rule {self.name!r} built a malformed expression from {scope}: {err}") from None
        return results

    def __str__(self) -> str:
        return self.name


def _outputs(program: Program) -> list:
    shapes = dict(program.definitions)
    return [(name, shapes[name].shape) for name in program.outputs]


def _box(scope: Scope) -> str:
    return "[" + ", ".join(f"{it.lo}..{it.hi}" for it in scope.traversal) + "]"


_REGISTRY: dict[str, Rule] = {}


def _origin(rule_: Rule) -> str:
    fn = rule_.generate
    return f"{fn.__module__}.{fn.__qualname__}" if fn is not None else f"pattern {rule_.doc[:40]!r}"


def _register(rule_: Rule, register: bool = True) -> Rule:
    if rule_.kind not in KINDS:
        raise RuleError(f"rule {rule_.name!r}: kind must be one of {', '.join(KINDS)}, got {rule_.kind!r}")
    if not rule_.doc.strip():
        raise RuleError(f"rule {rule_.name!r} needs a docstring that cites its paper section")
    if not register:
        return rule_
    previous = _REGISTRY.get(rule_.name)
    if previous is not None and _origin(previous) != _origin(rule_):  # a re-import is fine
        raise RuleError(f"two rules are named {rule_.name!r}: {_origin(previous)} and {_origin(rule_)}")
    _REGISTRY[rule_.name] = rule_
    return rule_


def rule(
    name: str,
    *,
    section: str,
    kind: str = "explorative",
    targets: bool = False,
    shallow: bool = False,
    register: bool = True,
):
    """Declare a parametric rule: decorate a generator ``scope -> equivalent scopes``
    (``kind="inter"`` or ``"layout"``: ``program -> equivalent programs``).

    ``targets=True`` (guided rules only) declares a generator ``(scope, target) -> scopes`` that
    derives toward the operator whose iterator mapping table is ``target`` (OLLIE 5.2).
    ``shallow=True`` declares that the generator reads a nested scope only as a tensor of its box
    (its indices and shape: never its body or where it is zero), so its results on two scopes
    that read different members of one nested e-class are the same up to that member: the
    engine applies it once per e-node and congruence shares the results. Without it the rule
    is applied to every distinct scope, nested members included (always sound; slower).
    ``register=False`` checks the declaration but keeps the rule out of the engine's registry
    (for experiments and tests; pass it to ``explore(rules=...)`` explicitly).
    """
    if targets and kind != "guided":
        raise RuleError(f"rule {name!r}: only guided rules take a target operator, this one is {kind!r}")

    def decorate(fn: Callable[[Scope], Iterable[Scope]]) -> Rule:
        declared = Rule(name, section, kind, fn.__doc__ or "", generate=fn, targets=targets, shallow=shallow)
        return _register(declared, register)

    return decorate


def pattern(name: str, *, section: str, doc: str, rewrites, kind: str = "eager", register: bool = True) -> Rule:
    """Declare a pattern rule: egglog rewrites (``rewrite(lhs).to(rhs, *when)``) run in the e-graph.

    egglog refuses a right-hand side that uses a variable the left-hand side does not bind; that
    refusal surfaces here, at registration, as a RuleError.
    """
    rewrites = tuple(rewrites) if isinstance(rewrites, (list, tuple)) else (rewrites,)
    try:
        EGraph().register(*rewrites)  # egglog type-checks the rewrites and their variables
    except Exception as err:  # egglog raises several types; all mean a malformed rule
        raise RuleError(f"pattern rule {name!r} is malformed: {err}") from None
    return _register(Rule(name, section, kind, doc, rewrites=rewrites), register)


def registered(kind: str | None = None) -> list[Rule]:
    """Every rule of the ``rules`` package (imported on first use), optionally of one kind."""
    load_rules()
    return [r for r in _REGISTRY.values() if kind is None or r.kind == kind]


def load_rules(package: str = "rules") -> None:
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__):
        importlib.import_module(f"{package}.{info.name}")


# --------------------------------------------------------------------------------------------
# Helpers rules share


def fresh_name(base: str, taken) -> str:
    """``base``, or ``base`` with the smallest numeric suffix, not in ``taken``."""
    if base not in taken:
        return base
    k = 1
    while f"{base}{k}" in taken:
        k += 1
    return f"{base}{k}"


def substitute_traversal(scope: Scope, new_traversal, forward: dict, inverse: dict) -> Scope:
    """Variable substitution (OLLIE 4.2) with a checked bijection phi:

        L x ; S s ; f(x)   =>   L x ; { L y ; S s ; f(phi^-1(y)) }[phi(x)]

    ``new_traversal`` are the iterators y (their box must contain phi of the old box),
    ``forward`` maps each y to its index in the old iterators (phi), ``inverse`` maps each old
    traversal iterator to its index in the new ones (phi^-1). Refused with a RuleError unless
    phi is injective on the old box, lands inside the new box, and phi^-1(phi(x)) = x there.
    """
    new_traversal = tuple(new_traversal)
    try:
        check_substitution(scope, new_traversal, forward, inverse)
    except ExpressionError as err:
        raise RuleError(str(err)) from None
    inner = Scope(new_traversal, scope.summation, substitute(scope.body, inverse), scope.reduce)
    return Scope(scope.traversal, (), inner[tuple(forward[it.name] for it in new_traversal)])
