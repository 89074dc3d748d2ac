"""Dependence analyses (rewriter.lower.dependence): SOUFFLE's one-relies-on-one / many classes
and SIRIUS's dependence widths, on hand-written producer/consumer pairs of each kind."""

import pytest

from rewriter import parse
from rewriter.ir import Opaque, Tensor
from rewriter.lower import Kernel
from rewriter.lower.dependence import intensity, relies, reused, width

P = {"P": (8, 6)}


@pytest.mark.parametrize(
    "consumer, shapes, expected",
    [
        # element-wise: one element of P per output element
        ("L i:8, j:6 ; 2 * P[i, j]", P, "element-wise"),
        ("L j:6, i:8 ; P[i, j]", P, "element-wise"),  # a transposition still reads one element
        ("L i:8, j:6, k:3 ; P[i, j]", P, "element-wise"),  # a broadcast too
        ("L i:8, j:6 ; P[i, j] + P[i, 5 - j]", P, "tile-local"),  # two elements of one row
        # tile-local: each output row reads within one row of P
        ("L i:8 ; S j:6 ; P[i, j]", P, "tile-local"),  # a row sum
        ("L i:8, n:5 ; S k:6 ; P[i, k] * W[k, n]", P | {"W": (6, 5)}, "tile-local"),  # left operand
        ("L b:1, i:8 ; S j:6 ; P[i, j]", P, "tile-local"),  # a batch of one is no block loop
        # global: an output row needs several rows of P
        ("L j:6 ; S i:8 ; P[i, j]", P, "global"),  # a column sum
        ("L m:5, j:6 ; S k:8 ; W[m, k] * P[k, j]", P | {"W": (5, 8)}, "global"),  # right operand
        ("L h:8, j:6 ; S r:3 ; P[h + r - 1, j]", P, "global"),  # a window across rows
        ("L i:4, j:6 ; P[2*i, j] + P[2*i + 1, j]", P, "global"),  # two rows per output row
        ("L i:8, j:6 ; { L a:8, b:6 ; exp(P[a, b]) }[i, j]", P, "global"),  # a nested stage: whole
    ],
)
def test_dependence_width(consumer, shapes, expected):
    assert width(parse(consumer, shapes), "P") == expected


def test_an_opaque_reader_depends_globally():
    gather = Opaque("gather", (Tensor("W", (10, 4)), Tensor("ids", (3,))), (("axis", 0),))
    assert width(gather, "ids") == "global" and width(gather, "X") == "element-wise"


def test_padding_is_not_a_dependence():
    """A window whose rows outside P are padding: the reads that remain are in one row each."""
    shifted = parse("L i:8, j:6 ; S r:2 ; P[i + 8*r, j]", P)  # r = 1 reads past P: zeros
    assert width(shifted, "P") == "element-wise"


def test_one_relies_on_one_or_many():
    assert relies(parse("L i:8, j:6 ; exp(P[i, j])", P)) == "one-on-one"
    assert relies(parse("L i:8 ; S j:6 ; P[i, j]", P)) == "one-on-many"
    assert relies(parse("L i:8, j:6 ; { L a:8 ; S b:6 ; P[a, b] }[i] * P[i, j]", P)) == "one-on-many"


def test_intensity_and_reuse():
    copy = parse("L i:8, j:6 ; P[i, j]", P)
    product = parse("L i:8, n:5 ; S k:6 ; P[i, k] * W[k, n]", P | {"W": (6, 5)})
    assert intensity(copy) == pytest.approx(48 / (4 * (48 + 48)))  # one read per element
    assert intensity(product) == pytest.approx(8 * 5 * 6 * 3 / (4 * (40 + 48 + 30)))  # two reads, a product
    kernels = [Kernel("eop", "A", copy), Kernel("eop", "B", product)]
    assert reused(kernels) == {"P": 2}
