"""Hypothesis strategies for random, well-formed rewriter expressions, programs and their inputs.

Shipped with the package (as ``hypothesis.extra.numpy`` ships with hypothesis) so that a rule
written outside this repository is tested the way ``rules/`` is: draw an expression the rule
applies to, rewrite it, and compare ``evaluate`` before and after (``rewriter.testing.assert_sound``)::

    from hypothesis import given
    from rewriter.testing import assert_sound
    from rewriter.testing.strategies import applicable

    @given(applicable(my_rule))
    def test_my_rule_is_sound(expr):
        assert assert_sound(my_rule, expr) >= 1

Needs hypothesis (``pip install "rewriter[testing]"``); ``rewriter.testing`` itself does not.

Public API (every strategy takes keyword parameters; defaults give small, fast expressions):

``iterators(names=None, *, min_count=1, max_count=3, min_size=1, max_size=5, offset_probability=0.25, exclude=())``
    A tuple of Iterators with distinct names (``names`` fixes them; otherwise fresh names not in
    ``exclude``). Sizes are ``min_size..max_size``; with ``offset_probability`` a range starts at
    a nonzero value in -1..3 (``x:-1..3``).

``indices(vars, *, target=(0, 4), max_coefficient=2, div_probability=0.15, neg_probability=0.1, far_probability=0.01, outside=None, anchor=None)``
    One quasi-affine Index over ``vars`` (Iterators, or bare names then assumed to range over
    0..3). Coefficients in ``-max_coefficient..max_coefficient`` (zero included, written in many
    forms: ``2*h``, ``h*2``, ``-h``, ``-2*h``, ``(1+1)*h``), random association of ``+``/``-``,
    sometimes a floor division or a remainder by 1..4, sometimes ``IndexNeg`` around it. The
    constant offset is picked from the index's actual range over the iterators so that reads of an
    axis whose valid positions are ``target = (lo, hi)`` are mostly inside, often partly outside,
    and sometimes (6%) entirely outside; ``outside=True``/``False`` forces/forbids that.
    With ``anchor`` (iterator name -> value), an index that is not placed partly or entirely
    outside is inside at that point (scopes anchor all their reads at one random point).
    ``far_probability`` adds a huge coefficient or offset (exercises evaluate's gather fallback
    for reads that reach far outside).

``scopes(**params)`` / ``expressions(**params)``
    A random closed Scope: see ``ScopeParams`` for every parameter (traversal/summation counts,
    iterator sizes, access budget, tensor ranks/dims, reduce="max" probability, functions,
    constants, division, nesting probability and depth, name shadowing, ``require_nested``).
    The same tensor name always has the same shape within one expression.

``programs(*, min_definitions=2, max_definitions=3, twin_probability=0.1, **params)``
    A Program whose later definitions read earlier ones (as Tensors named T0, T1, ...), or (with
    ``twin_probability``) repeat an earlier one over a new input tensor of the same shape:
    parallel branches, as attention's Q, K and V projections are.

``rewritten(*, max_steps=2, rules=None, **params)``
    An expression of ``expressions(**params)`` after 0..``max_steps`` random rule applications,
    each of a random rule among ``rules`` (default: every registered rule that rewrites a scope)
    that applies, so that shapes rules produce (nested scopes to tighten or merge, substituted
    iterators) are drawn too.

``applicable(rule, *, max_steps=2, rules=None, tries=4, **params)``
    Expressions (Programs, for a rule that takes a program) that ``rule`` (a Rule, or the name
    of a registered one) applies to somewhere: each draw makes up to ``tries`` attempts, each an
    expression of ``expressions(**params)`` followed by up to ``max_steps`` random applications of
    the other ``rules``, checking the rule after every step; a draw whose attempts all miss is
    rejected (``hypothesis.assume``). Pass ``**params`` that make the rule's shape likely (e.g.
    ``require_nested=True`` for a rule on nested scopes) so that few draws are rejected. A guided
    rule that takes a target operator counts when it applies toward any matchable operator
    (``rewriter.testing.applications``).

``convolutions(*, max_filters=5, offset_outputs=True)``
    A 2-D convolution scope ``X[n, c, stride*h + dilation*r - pad, ..] * W[..]`` (NCHW input)
    with random batch, channels (1..4 in, 1..``max_filters`` out), kernel size, stride,
    dilation, padding, traversal and summation orders and weight layout; with
    ``offset_outputs``, sometimes an output range that does not start at 0.

``random_inputs(expr, seed=0, *, low=-1.0, high=1.0, integer_valued=False)``
    A dict name -> float64 array for every input tensor of a Scope or Program (numpy default_rng);
    the same function as ``rewriter.testing.random_inputs``.
``inputs_for(expr, **kw)``  strategy of ``random_inputs(expr, seed, **kw)`` over seeds.
``expressions_with_inputs(**params)`` / ``programs_with_inputs(**params)``  (expr, inputs) pairs.

Also: ``index_range(ix, iters)`` (min, max of an index over iterator ranges),
``ITERATOR_NAMES``, ``TENSOR_NAMES``, ``DEFINITION_NAMES``, ``SAFE_FUNCTIONS``.

Value safety: inputs are in [-1, 1]; ``exp`` only sees an input-tensor read or a ``tanh`` of
something, ``sqrt`` only a ``relu`` of something, and divisors are nonzero constants or
``2 + tanh(..)`` / ``2 + sigmoid(..)``, so evaluation never produces inf or nan.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np

try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "rewriter.testing.strategies needs hypothesis: pip install 'rewriter[testing]' (or hypothesis>=6.100)"
    ) from error

from rewriter.ir import (
    Access,
    Binary,
    Index,
    IndexNeg,
    IndexOp,
    Iterator,
    Lit,
    Num,
    Program,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
    eval_index,
    index_vars,
    nested_scopes,
    parse,
    replace_reads,
    tensor_shapes,
)
from rewriter.search import Rule, registered
from rewriter.testing import applications, random_inputs

# Iterator names: plain letters first, then names that look like keywords or functions but are not
# reserved (they exercise the tokenizer and the keyword checks of the parser).
ITERATOR_NAMES = (
    "i",
    "j",
    "k",
    "h",
    "w",
    "n",
    "c",
    "r",
    "s",
    "f",
    "x",
    "y",
    "z",
    "p",
    "q",
    "u",
    "v",
    "t",
    "k2",
    "i0",
    "x_1",
    "L1",
    "S2",
    "Mx",
    "returned",
    "exp2",
    "_a",
)
TENSOR_NAMES = ("A", "B", "C", "D", "Wt")
DEFINITION_NAMES = ("T0", "T1", "T2", "T3", "T4")
SAFE_FUNCTIONS = ("relu", "neg", "tanh", "sigmoid", "exp")
ALL_FUNCTIONS = SAFE_FUNCTIONS + ("sqrt",)

DEFAULT_NAME_RANGE = (0, 4)  # assumed range of a bare iterator name given to indices()

NICE_CONSTANTS = (0.5, 2.0, -1.0, 3.0, 1.0, 0.0, -0.25, 1.5, 0.1)


def default_constants() -> st.SearchStrategy[float]:
    """Constants of bodies: mostly simple values, sometimes any float in [-4, 4]."""
    return st.one_of(
        st.sampled_from(NICE_CONSTANTS),
        st.floats(-4.0, 4.0, allow_nan=False, allow_infinity=False),
    )


def wide_constants() -> st.SearchStrategy[float]:
    """Any finite float (tiny, huge, -0.0): for printing/parsing, not for evaluation."""
    return st.one_of(st.sampled_from(NICE_CONSTANTS), st.floats(allow_nan=False, allow_infinity=False))


@functools.lru_cache(maxsize=None)
def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers lo..hi, uniform, shrinking towards lo; each strategy is built once.

    (``st.integers`` skews bounded draws heavily towards small values, which would make the
    probabilities below mean much less than they say; ``sampled_from`` is uniform up to about 256
    choices, which is all this module asks of it. Building strategies, not drawing them,
    dominated the cost of generation, hence the cache.)
    """
    return st.sampled_from(range(lo, hi + 1))


@functools.lru_cache(maxsize=None)
def _sampled(choices: tuple) -> st.SearchStrategy:
    return st.sampled_from(choices)


_BOOLEANS = st.booleans()


def _pick(draw, choices: Sequence, count: int) -> list:
    """``count`` distinct elements of ``choices`` in random order."""
    remaining, result = list(choices), []
    for _ in range(min(count, len(remaining))):
        result.append(remaining.pop(draw(_ints(0, len(remaining) - 1))))
    return result


def _chance(draw, probability: float) -> bool:
    """True with about ``probability``; shrinks towards False."""
    if probability <= 0:
        return False
    if probability >= 1:
        return True
    return draw(_ints(0, 199)) >= 200 - max(1, round(probability * 200))


# --------------------------------------------------------------------------------------------
# Iterators


def _fresh_names(exclude) -> "itertools.chain[str]":
    extra = (f"v{n}" for n in itertools.count())
    return (name for name in itertools.chain(ITERATOR_NAMES, extra) if name not in exclude)


def _draw_range(draw, min_size: int, max_size: int, offset_probability: float) -> tuple[int, int]:
    size = draw(_ints(min_size, max_size))
    lo = draw(_sampled((-1, 1, 2, 3))) if _chance(draw, offset_probability) else 0
    return lo, lo + size


@st.composite
def iterator_ranges(draw, *, min_size: int = 1, max_size: int = 5, offset_probability: float = 0.25):
    """A (lo, hi) pair: size in min_size..max_size, lo 0 or (with offset_probability) in -1..3."""
    return _draw_range(draw, min_size, max_size, offset_probability)


@st.composite
def iterators(
    draw,
    names: Sequence[str] | None = None,
    *,
    min_count: int = 1,
    max_count: int = 3,
    min_size: int = 1,
    max_size: int = 5,
    offset_probability: float = 0.25,
    exclude=(),
):
    """A tuple of Iterators with distinct names (see the module docstring)."""
    if names is None:
        count = draw(_ints(min_count, max_count))
        pool = list(itertools.islice(_fresh_names(set(exclude)), count + 8))
        names = _pick(draw, pool, count)
    result = []
    for name in names:
        lo, hi = _draw_range(draw, min_size, max_size, offset_probability)
        result.append(Iterator(name, lo, hi))
    return tuple(result)


# --------------------------------------------------------------------------------------------
# Indices


def _as_iterators(vars) -> list[Iterator]:
    result = []
    for v in vars:
        if isinstance(v, Iterator):
            result.append(v)
        elif isinstance(v, Var):
            result.append(Iterator(v.name, *DEFAULT_NAME_RANGE))
        else:
            result.append(Iterator(v, *DEFAULT_NAME_RANGE))
    return result


def index_range(ix: Index, iters) -> tuple[int, int]:
    """(min, max) of ``ix`` over the box of ``iters`` (Iterators or names, see indices())."""
    its = {it.name: it for it in _as_iterators(iters)}
    used = sorted(index_vars(ix))
    env = {}
    for axis, name in enumerate(used):
        it = its[name]
        shape = [1] * len(used)
        shape[axis] = it.size
        env[name] = np.arange(it.lo, it.hi, dtype=np.int64).reshape(shape)
    values = np.asarray(eval_index(ix, env), dtype=np.int64)
    return int(values.min()), int(values.max())


def _constant(draw, value: int) -> Index:
    """The constant ``value`` as an index, sometimes as a small constant expression."""
    form = draw(_ints(0, 9))
    if form == 7:
        return IndexOp("+", Lit(value - 1), Lit(1))  # prints (c-1+1) where it needs parentheses
    if form == 8 and value <= 0:
        return IndexNeg(Lit(-value))  # prints -(c)
    if form == 9 and value % 2 == 0 and value:
        return IndexOp("*", Lit(2), Lit(value // 2))
    return Lit(value)


def _term(draw, name: str, coefficient: int) -> Index:
    """``coefficient * name`` in one of its many spellings."""
    v = Var(name)
    if coefficient == 1 and draw(_ints(0, 5)):
        return v
    if coefficient == -1:
        form = draw(_ints(0, 2))
        if form == 0:
            return IndexNeg(v)
        if form == 1:
            return IndexOp("*", Lit(-1), v)
    c = _constant(draw, coefficient)
    if coefficient < 0 and draw(_ints(0, 3)) == 0:
        inner = IndexOp("*", _constant(draw, -coefficient), v)
        return IndexNeg(inner)
    return IndexOp("*", c, v) if draw(_BOOLEANS) else IndexOp("*", v, c)


def _associate(draw, terms: list[Index]) -> Index:
    """A random binary tree of ``+``/``-`` over the terms (gives nested parentheses)."""
    if len(terms) == 1:
        return terms[0]
    split = draw(_ints(1, len(terms) - 1))
    lhs = _associate(draw, terms[:split])
    rhs = _associate(draw, terms[split:])
    return IndexOp(draw(_sampled(tuple("+-"))), lhs, rhs)


def _core(draw, iters: list[Iterator], max_coefficient, div_probability, neg_probability, far_probability):
    """The iterator-dependent part of an index (None for a constant index)."""
    names = [it.name for it in iters]
    # mostly one or two iterators, sometimes none (a constant index) or three
    chosen = _pick(draw, names, draw(_sampled((1, 2, 1, 2, 0, 1, 2, 3, 1, 2))))
    terms = []
    for name in chosen:
        if _chance(draw, far_probability):
            coefficient = draw(_sampled((100, -1000, 1_000_003)))
        else:
            # 1 is the most common coefficient; zero and negative ones are included
            choices = (1, 1, 1) + tuple(c for c in range(-max_coefficient, max_coefficient + 1) if c != 1)
            coefficient = draw(_sampled(tuple(choices)))
        terms.append(_term(draw, name, coefficient))
    if not terms:
        return None
    core = _associate(draw, terms)
    if _chance(draw, div_probability):
        if draw(_BOOLEANS):
            shift = draw(_ints(-3, 3))
            if shift:
                core = IndexOp("+", core, Lit(shift)) if shift > 0 else IndexOp("-", core, Lit(-shift))
        core = IndexOp(draw(_sampled(tuple("/%"))), core, _constant(draw, draw(_ints(1, 4))))
        tail = draw(_ints(0, 3))
        if tail == 1:
            core = IndexOp("*", core, Lit(draw(_ints(-2, 3))))
        elif tail == 2 and names:
            core = IndexOp(draw(_sampled(tuple("+-"))), core, Var(draw(_sampled(tuple(names)))))
    if _chance(draw, neg_probability):
        core = IndexNeg(core)
    return core


@st.composite
def indices(
    draw,
    vars,
    *,
    target: tuple[int, int] = (0, 4),
    max_coefficient: int = 2,
    div_probability: float = 0.15,
    neg_probability: float = 0.1,
    far_probability: float = 0.01,
    outside: bool | None = None,
    anchor: dict[str, int] | None = None,
):
    """One quasi-affine index over ``vars`` aimed at positions ``target`` (see module docstring)."""
    return _draw_index(
        draw,
        _as_iterators(vars),
        target,
        max_coefficient,
        div_probability,
        neg_probability,
        far_probability,
        outside,
        anchor,
    )


def _draw_index(
    draw, iters, target, max_coefficient, div_probability, neg_probability, far_probability, outside=None, anchor=None
) -> Index:
    lo, hi = target
    core = _core(draw, iters, max_coefficient, div_probability, neg_probability, far_probability)
    low, high = index_range(core, iters) if core is not None else (0, 0)
    # where the smallest value of the index lands; the largest lands (high - low) above it
    spread = high - low
    if outside is None:
        mode = draw(_ints(0, 199))
    else:
        mode = draw(_ints(188, 199)) if outside else draw(_ints(0, 187))
    if mode < 170 or (mode < 188 and spread == 0):
        # inside at the anchor point, or at the smallest value (then it may run past hi)
        at = int(eval_index(core, anchor)) if anchor is not None and core is not None else low
        start = draw(_ints(lo, hi - 1)) - (at - low)
    elif mode < 188:
        start = lo - draw(_ints(1, min(spread, 3)))  # straddles lo: some reads below, some inside
    elif mode < 194:
        start = lo - 1 - spread  # every read below the valid range
    else:
        start = hi  # every read above it
    offset = start - low
    if _chance(draw, far_probability):
        offset += draw(_sampled((-1_000_000, 1_000_000)))
    if core is None:
        return _constant(draw, offset)
    if offset == 0 and draw(_ints(0, 3)):
        return core
    form = draw(_ints(0, 5))
    if form == 0:
        return IndexOp("+", _constant(draw, offset), core)
    if form == 1:
        return IndexOp("+", core, Lit(offset))  # "h+-2" when negative
    if offset < 0:
        return IndexOp("-", core, _constant(draw, -offset))
    return IndexOp("+", core, _constant(draw, offset))


# --------------------------------------------------------------------------------------------
# Scopes


@dataclass(frozen=True)
class ScopeParams:
    """Parameters of ``scopes``/``expressions``/``programs`` (all keyword arguments)."""

    min_traversal: int = 1
    max_traversal: int = 3
    min_summation: int = 0
    max_summation: int = 2
    max_size: int = 5  # iterator sizes are 1..max_size
    offset_probability: float = 0.25  # an iterator range starts at -1..3 instead of 0
    min_accesses: int = 1  # tensor/scope reads per body: min_accesses..max_accesses (at least 1)
    max_accesses: int = 3
    max_rank: int = 3  # input tensors have rank 1..max_rank
    max_dim: int = 6  # and dimensions 1..max_dim
    max_probability: float = 0.2  # reduce="max" when there are summation iterators
    functions: tuple[str, ...] = SAFE_FUNCTIONS  # unary functions to use (sqrt is safe-wrapped)
    function_probability: float = 0.15
    constant_probability: float = 0.15
    division_probability: float = 0.1  # 0 disables scalar division
    binary_max_probability: float = 0.05  # max(a, b) in a body
    nesting_probability: float = 0.2  # a read is of a nested scope (halved per level)
    max_depth: int = 2  # nesting levels below the outermost scope
    max_scopes: int = 4  # nested scopes in one expression, at most
    shadowing_probability: float = 0.0  # a nested scope reuses an outer iterator name
    require_nested: bool = False  # the outermost body reads at least one nested scope
    tensor_names: tuple[str, ...] = TENSOR_NAMES
    constants: st.SearchStrategy | None = None  # strategy of floats; default_constants() if None
    div_probability: float = 0.15  # index floor division / remainder
    neg_probability: float = 0.1  # IndexNeg around an index
    far_probability: float = 0.01  # huge index coefficient/offset, per index
    outside_probability: float = 0.05  # a read has one index entirely outside its axis
    max_coefficient: int = 2


_PARAM_NAMES = {f.name for f in fields(ScopeParams)}


def _params(kwargs) -> ScopeParams:
    unknown = set(kwargs) - _PARAM_NAMES
    if unknown:
        raise TypeError(f"unknown expression parameter(s): {', '.join(sorted(unknown))}")
    return replace(ScopeParams(), **kwargs)


class _Builder:
    """State of one expression being drawn: tensor shapes, iterator names, nested scope count."""

    def __init__(self, draw, params: ScopeParams, shapes: dict | None = None, fixed: dict | None = None):
        self.draw = draw
        self.p = params
        self.shapes: dict[str, tuple[int, ...]] = shapes if shapes is not None else {}
        self.fixed: dict[str, tuple[int, ...]] = dict(fixed or {})  # program definitions readable
        self.used: set[str] = set()
        self.nested = 0
        self.anchors: dict[tuple, dict[str, int]] = {}  # iterators of a scope -> its anchor point
        self.constants = params.constants if params.constants is not None else default_constants()

    def chance(self, probability: float) -> bool:
        return _chance(self.draw, probability)

    # -- scopes
    def scope(self, depth: int, outer: Sequence[Iterator] = ()) -> Scope:
        draw, p = self.draw, self.p
        n_trav = draw(_ints(p.min_traversal, p.max_traversal))
        n_sum = draw(_ints(p.min_summation, p.max_summation))
        names: list[str] = []
        for _ in range(n_trav + n_sum):
            if outer and self.chance(p.shadowing_probability):
                candidates = [it.name for it in outer if it.name not in names]
                if candidates:
                    names.append(draw(_sampled(tuple(candidates))))
                    continue
            pool = list(itertools.islice(_fresh_names(self.used | set(names)), 6))
            names.append(draw(_sampled(tuple(pool))))
        self.used.update(names)
        its = tuple(Iterator(name, *_draw_range(draw, 1, p.max_size, p.offset_probability)) for name in names)
        # reads that start inside are inside at this point, so products are nonzero somewhere
        self.anchors[its] = {it.name: draw(_ints(it.lo, it.hi - 1)) for it in its}
        traversal, summation = its[:n_trav], its[n_trav:]
        reduce = "max" if summation and self.chance(p.max_probability) else "sum"
        body = self.body(its, depth)
        if (
            depth == 0
            and p.require_nested
            and not any(True for _ in nested_scopes(Scope(traversal, summation, body, reduce)))
        ):
            body = Binary(draw(_sampled(tuple("+*"))), body, self.nested_access(its, depth))
        return Scope(traversal, summation, body, reduce)

    # -- bodies
    def body(self, its, depth: int) -> Scalar:
        draw, p = self.draw, self.p
        budget = draw(_ints(max(1, p.min_accesses), max(1, p.min_accesses, p.max_accesses)))
        n_products = draw(_ints(1, min(2, budget)))
        sizes = [1] * n_products
        for _ in range(budget - n_products):
            sizes[draw(_ints(0, n_products - 1))] += 1
        products = [self.product(its, depth, size) for size in sizes]
        body = products[0]
        for product in products[1:]:
            op = draw(_sampled(tuple("+-")))
            body = Binary(op, body, product) if draw(_BOOLEANS) else Binary(op, product, body)
        if self.chance(p.constant_probability / 2):
            constant = Num(draw(self.constants))
            if draw(_BOOLEANS):
                constant = Unary("neg", constant)
            op = draw(_sampled(tuple("+-")))
            body = Binary(op, body, constant) if draw(_BOOLEANS) else Binary(op, constant, body)
        if self.chance(p.function_probability / 2):
            body = self.function(body)
        if self.chance(p.binary_max_probability):
            other = self.factor(its, depth) if draw(_BOOLEANS) else Num(draw(self.constants))
            body = Binary("max", body, other) if draw(_BOOLEANS) else Binary("max", other, body)
        if self.chance(p.division_probability):
            body = Binary("/", body, self.denominator(its, depth))
        return body

    def product(self, its, depth: int, size: int) -> Scalar:
        draw = self.draw
        factors = [self.factor(its, depth) for _ in range(size)]
        if self.chance(self.p.constant_probability):
            factors.insert(draw(_ints(0, len(factors))), Num(draw(self.constants)))
        return self._multiply(factors)

    def _multiply(self, factors: list[Scalar]) -> Scalar:
        if len(factors) == 1:
            return factors[0]
        split = self.draw(_ints(1, len(factors) - 1))
        return Binary("*", self._multiply(factors[:split]), self._multiply(factors[split:]))

    def factor(self, its, depth: int) -> Scalar:
        p = self.p
        nest = depth < p.max_depth and self.nested < p.max_scopes and self.chance(p.nesting_probability / (2**depth))
        read = self.nested_access(its, depth) if nest else self.tensor_access(its)
        if self.chance(p.function_probability):
            read = self.function(read)
        return read

    def function(self, arg: Scalar) -> Scalar:
        if not self.p.functions:
            return arg
        fn = self.draw(_sampled(tuple(self.p.functions)))
        if fn == "exp" and not (
            isinstance(arg, Access) and isinstance(arg.source, Tensor) and arg.source.name not in self.fixed
        ):
            arg = Unary("tanh", arg)  # exp of a bounded value only
        if fn == "sqrt":
            arg = Unary("relu", arg)
        return Unary(fn, arg)

    def denominator(self, its, depth: int) -> Scalar:
        draw = self.draw
        if draw(_BOOLEANS):
            return Num(draw(_sampled((2.0, -4.0, 0.5, 3.0, 1.5, -1.0))))
        fn = draw(_sampled(("tanh", "sigmoid")))
        return Binary("+", Num(2.0), Unary(fn, self.factor(its, depth)))

    # -- reads
    def index(self, its, target, outside: bool | None = None) -> Index:
        p = self.p
        return _draw_index(
            self.draw,
            its,
            target,
            p.max_coefficient,
            p.div_probability,
            p.neg_probability,
            p.far_probability,
            outside,
            self.anchors.get(tuple(its)),
        )

    def outside_axis(self, rank: int) -> int | None:
        """The axis of a read that is entirely outside the valid range (rarely), else None."""
        return self.draw(_ints(0, rank - 1)) if self.chance(self.p.outside_probability) else None

    def tensor_access(self, its) -> Access:
        draw, p = self.draw, self.p
        name = draw(_sampled(tuple(p.tensor_names) + tuple(self.fixed)))
        if name in self.fixed:
            shape = self.fixed[name]
        elif name in self.shapes:
            shape = self.shapes[name]
        else:
            rank = draw(_ints(1, p.max_rank))
            dims = []
            for _ in range(rank):
                if draw(_BOOLEANS):
                    dims.append(draw(_sampled(tuple([it.size for it in its]))))
                else:
                    dims.append(draw(_ints(1, p.max_dim)))
            shape = self.shapes[name] = tuple(dims)
        tensor = Tensor(name, shape)
        out = self.outside_axis(len(shape))
        return Access(tensor, tuple(self.index(its, (0, dim), k == out) for k, dim in enumerate(shape)))

    def nested_access(self, its, depth: int) -> Access:
        self.nested += 1
        inner = self.scope(depth + 1, outer=its)
        out = self.outside_axis(len(inner.traversal))
        return Access(inner, tuple(self.index(its, (it.lo, it.hi), k == out) for k, it in enumerate(inner.traversal)))


@st.composite
def scopes(draw, **params):
    """A random well-formed Scope; keyword parameters are the fields of ScopeParams."""
    return _Builder(draw, _params(params)).scope(0)


def expressions(**params) -> st.SearchStrategy[Scope]:
    """Same as ``scopes(**params)``."""
    return scopes(**params)


@st.composite
def programs(draw, *, min_definitions: int = 2, max_definitions: int = 3, twin_probability: float = 0.1, **params):
    """A Program of 2..3 definitions T0, T1, ...; each later one reads at least one earlier one,
    or (with ``twin_probability``) is a twin: an earlier definition reading a new input tensor of
    the same shape in place of one of its inputs (parallel branches, like attention's Q, K and V
    projections, which expression merging (batch) batches)."""
    p = _params(params)
    count = draw(_ints(min_definitions, max_definitions))
    shapes: dict[str, tuple[int, ...]] = {}
    definitions: list[tuple[str, Scope]] = []
    for n in range(count):
        name = DEFINITION_NAMES[n]
        earlier = {d: e.shape for d, e in definitions}
        twin = _twin(draw, definitions, shapes) if earlier and _chance(draw, twin_probability) else None
        if twin is not None:
            definitions.append((name, twin))
            continue
        builder = _Builder(draw, p, shapes=shapes, fixed=earlier)
        scope = builder.scope(0)
        if earlier and not set(tensor_shapes(scope)) & set(earlier):
            read = Access(
                Tensor(definitions[-1][0], definitions[-1][1].shape),
                tuple(builder.index(scope.traversal + scope.summation, (0, d)) for d in definitions[-1][1].shape),
            )
            scope = Scope(
                scope.traversal, scope.summation, Binary(draw(_sampled(tuple("+*"))), scope.body, read), scope.reduce
            )
        definitions.append((name, scope))
    outputs = [definitions[-1][0]]
    if count > 1 and draw(_BOOLEANS):
        outputs.insert(0, draw(_sampled(tuple([d for d, _ in definitions[:-1]]))))
    return Program(tuple(definitions), tuple(outputs))


def _twin(draw, definitions: list[tuple[str, Scope]], shapes: dict) -> Scope | None:
    """An earlier definition reading a new input tensor in place of one of its inputs (None when
    none reads an input tensor); the new tensor's shape goes into ``shapes``."""
    defined = {d for d, _ in definitions}
    candidates = [(d, e) for d, e in definitions if set(tensor_shapes(e)) - defined]
    if not candidates:
        return None
    _, original = candidates[draw(_ints(0, len(candidates) - 1))]
    inputs = sorted(set(tensor_shapes(original)) - defined)
    old = draw(_sampled(tuple(inputs)))
    new = next(f"{old}{k}" for k in itertools.count(2) if f"{old}{k}" not in shapes and f"{old}{k}" not in defined)
    shape = shapes[new] = tensor_shapes(original)[old]
    body = replace_reads(original.body, old, lambda ix: Tensor(new, shape)[ix])
    return Scope(original.traversal, original.summation, body, original.reduce)


# --------------------------------------------------------------------------------------------
# Expressions after rule applications, and expressions a rule applies to


def _rule(rule: Rule | str) -> Rule:
    if isinstance(rule, Rule):
        return rule
    by_name = {r.name: r for r in registered()}
    if rule not in by_name:
        raise ValueError(f"no registered rule named {rule!r}; registered: {', '.join(sorted(by_name))}")
    return by_name[rule]


def _walk_rules(rules, on_programs: bool, exclude: Rule | None = None) -> tuple[Rule, ...]:
    """The rules random steps choose from: ``rules`` (default every registered one) that rewrite
    programs (``on_programs``) or scopes, without ``exclude``, by name (a stable order to draw from)."""
    pool = registered() if rules is None else [_rule(r) for r in rules]
    return tuple(sorted((r for r in pool if r.on_programs == on_programs and r != exclude), key=lambda r: r.name))


def _step(draw, expr, pool: tuple[Rule, ...]):
    """One random application to ``expr`` of a random rule of ``pool`` that applies (rules are
    drawn until one does, up to twice the pool's size); ``expr`` itself when none is found."""
    tried: dict[int, list] = {}
    for _ in range(2 * len(pool)):
        k = draw(_ints(0, len(pool) - 1))
        if k not in tried:
            tried[k] = applications(pool[k], expr)
        if tried[k]:
            return tried[k][draw(_ints(0, len(tried[k]) - 1))]
        if len(tried) == len(pool):
            break
    return expr


@st.composite
def rewritten(draw, *, max_steps: int = 2, rules=None, **params):
    """An expression of ``expressions(**params)`` after 0..max_steps random rule applications."""
    expr = draw(expressions(**params))
    pool = _walk_rules(rules, on_programs=False)
    for _ in range(draw(_ints(0, max_steps))):
        expr = _step(draw, expr, pool)
    return expr


@st.composite
def applicable(draw, rule: Rule | str, *, max_steps: int = 2, rules=None, tries: int = 4, **params):
    """An expression (a Program, for a rule that takes one) that ``rule`` has at least one
    application to (see the module docstring); ``**params`` go to ``expressions``/``programs``."""
    rule = _rule(rule)
    pool = _walk_rules(rules, rule.on_programs, exclude=rule)
    base = programs(**params) if rule.on_programs else expressions(**params)
    for _ in range(tries):
        expr = draw(base)
        if applications(rule, expr):
            return expr
        for _ in range(max_steps):
            expr = _step(draw, expr, pool)
            if applications(rule, expr):
                return expr
    assume(False)  # every attempt missed: hypothesis draws again


@st.composite
def convolutions(draw, *, max_filters: int = 5, offset_outputs: bool = True):
    """A Conv2d scope: see the module docstring."""
    n, c, f = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, max_filters))
    r, s = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride, dilation, pad = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(0, 2))
    height, width = draw(st.integers(r * dilation, 9)), draw(st.integers(s * dilation, 9))
    out_h = (height + 2 * pad - dilation * (r - 1) - 1) // stride + 1
    out_w = (width + 2 * pad - dilation * (s - 1) - 1) // stride + 1
    start = draw(st.integers(0, 1)) if offset_outputs and out_h > 1 else 0
    ranges = {"n": f"n:{n}", "f": f"f:{f}", "h": f"h:{start}..{out_h}" if start else f"h:{out_h}", "w": f"w:{out_w}"}
    traversal = draw(st.permutations(["n", "f", "h", "w"]))
    summed = draw(st.permutations(["c", "r", "s"]))
    weight_dims = draw(st.permutations(["f", "c", "r", "s"]))
    sizes = {"f": f, "c": c, "r": r, "s": s}
    text = (
        f"L {', '.join(ranges[i] for i in traversal)} ; S {', '.join(f'{i}:{sizes[i]}' for i in summed)} ; "
        f"X[n, c, {stride}*h+{dilation}*r-{pad}, {stride}*w+{dilation}*s-{pad}] * W[{', '.join(weight_dims)}]"
    )
    return parse(text, {"X": (n, c, height, width), "W": tuple(sizes[d] for d in weight_dims)})


# --------------------------------------------------------------------------------------------
# Inputs


def inputs_for(expr, **kwargs) -> st.SearchStrategy[dict]:
    """Strategy of ``random_inputs(expr, seed, **kwargs)`` over 32-bit seeds."""
    return st.integers(0, 2**32 - 1).map(lambda seed: random_inputs(expr, seed, **kwargs))


@st.composite
def expressions_with_inputs(draw, **params):
    """(expr, inputs): an expression of ``expressions(**params)`` and inputs for it."""
    expr = draw(expressions(**params))
    return expr, draw(inputs_for(expr))


@st.composite
def programs_with_inputs(draw, **params):
    """(program, inputs): a program of ``programs(**params)`` and inputs for it."""
    program = draw(programs(**params))
    return program, draw(inputs_for(program))
