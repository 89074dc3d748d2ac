"""Index algebra: normal forms, range inference and islpy queries agree with brute force."""

import itertools

import numpy as np
from hypothesis import given, strategies as st

from rewriter import evaluate, parse
from rewriter.indexing import affine_coefficients, index_bounds, normalize, padding_support, simplify
from rewriter.ir import Iterator, eval_index
from strategies import indices, iterators, random_inputs, scopes


def _points(iters):
    names = [it.name for it in iters]
    for values in itertools.product(*(range(it.lo, it.hi) for it in iters)):
        yield dict(zip(names, values))


@st.composite
def index_on_box(draw):
    iters = draw(iterators(min_count=1, max_count=3))
    ix = draw(indices(iters, div_probability=0.3))
    return iters, ix


@given(index_on_box())
def test_normal_form_and_simplification_keep_the_value(case):
    iters, ix = case
    ranges = {it.name: (it.lo, it.hi) for it in iters}
    plain, boxed = simplify(ix), simplify(ix, ranges)
    assert normalize(plain) == normalize(ix)  # the normal form is a fixpoint
    for env in _points(iters):
        value = eval_index(ix, env)
        assert eval_index(plain, env) == value
        assert eval_index(boxed, env) == value


@given(index_on_box())
def test_bounds_enclose_every_value_and_are_exact_when_affine(case):
    iters, ix = case
    ranges = {it.name: (it.lo, it.hi) for it in iters}
    lo, hi = index_bounds(ix, ranges)
    values = [eval_index(ix, env) for env in _points(iters)]
    assert lo <= min(values) and max(values) <= hi
    if affine_coefficients(ix) is not None:
        assert (lo, hi) == (min(values), max(values))


def test_equal_by_algebra_means_equal_forms():
    shapes = {"A": (99,)}
    forms = [normalize(parse(f"L h:5, r:3 ; A[{text}]", shapes).body.indices[0]) for text in ("h+r-1", "r-1+h", "2*(h+r)-h-r-1", "-(1-h-r)")]
    assert len(set(forms)) == 1


def test_range_aware_simplification_undoes_an_iterator_split():
    e = parse("L p:4, q:2 ; A[(2*p+q)/2, (2*p+q)%2, (q+2)/4]", {"A": (9, 9, 9)})
    ranges = {"p": (0, 4), "q": (0, 2)}
    assert [str(simplify(ix, ranges)) for ix in e.body.indices] == ["p", "q", "0"]
    assert [str(simplify(ix)) for ix in e.body.indices] == ["p+q/2", "q%2", "(q+2)/4"]


def test_padding_support_of_a_convolution_row():
    e = parse("L h:-1..9 ; S r:3 ; A[h+r-1] * B[r]", {"A": (7,), "B": (3,)})
    assert padding_support(e) == {"h": (-1, 8)}
    only_padding = parse("L h:20..30 ; A[h]", {"A": (7,)})
    assert padding_support(only_padding) == {"h": (20, 20)}
    non_zero_anywhere = parse("L h:20..30 ; exp(A[h])", {"A": (7,)})
    assert padding_support(non_zero_anywhere) == {"h": (20, 30)}


@given(scopes(max_traversal=2, max_summation=2, functions=("relu", "neg", "tanh")), st.integers(0, 2**32 - 1))
def test_padding_support_is_sound(expr, seed):
    """Outside the support box the scope is exactly zero for random inputs."""
    support = padding_support(expr)
    out = evaluate(expr, random_inputs(expr, seed))
    inside = np.ones(out.shape, dtype=bool)
    for axis, it in enumerate(expr.traversal):
        lo, hi = support[it.name]
        assert it.lo <= lo <= hi <= it.hi
        coords = np.arange(it.lo, it.hi)
        shape = [1] * out.ndim
        shape[axis] = it.size
        inside &= ((coords >= lo) & (coords < hi)).reshape(shape)
    assert np.all(out[~inside] == 0)


def test_iterators_of_the_box_are_all_needed():
    assert index_bounds(parse("L i:3, j:4 ; A[2*i-j]", {"A": (9,)}).body.indices[0], {"i": (0, 3), "j": (0, 4)}) == (-3, 4)
    assert Iterator("x", -1, 2).size == 3
