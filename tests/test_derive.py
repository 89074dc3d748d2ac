"""derive(): candidates are derived from the naive expression, instantiated, and verified."""

import importlib
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings

from codegen.backend import ReferenceBackend
from rewriter import conv2d, conv_transpose2d, derive, evaluate, matmul, parse, tensor_shapes
from rewriter.cases import CASES
from rewriter.lower import BATCH_MATMUL, CONV2D, G2BMM, GBMM, MATMUL, Candidate, Kernel, instantiate, match_operator
from rewriter.pipeline.select import SMALL_TEMPORARY, key, oversized
from rewriter.pipeline.verify import Check
from rewriter.testing import random_inputs
from rewriter.testing.strategies import expressions


def match_gemm(scope):
    return match_operator(scope, (MATMUL, BATCH_MATMUL))[1]


def match_band(scope):
    return match_operator(scope, (G2BMM, GBMM))[1]


def test_conv3x3_becomes_one_matmul_and_an_offset_add():
    """OLLIE Figure 3b: derived from the naive expression, nothing about convolutions written down."""
    expr = CASES["conv3x3"].expression()
    derivation = derive(expr, max_depth=3, backend="reference")
    kinds = [[k.kind for k in c.kernels] for c in derivation.candidates]
    assert ["conv2d"] in kinds  # the expression as given is a library convolution
    best = derivation.candidates[kinds.index(["matmul", "eop"])]
    assert derivation.rejected == []
    assert "summation splitting" in derivation.explain(best) and "boundary tightening" in derivation.explain(best)
    inputs = random_inputs(expr, 1)
    np.testing.assert_allclose(best(**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)


def test_conv1x1_is_a_single_matmul_reading_the_input_in_place():
    expr = conv2d((2, 5, 6, 8), (1, 1, 4, 8), layout="NHWC")
    derivation = derive(expr, max_depth=1, backend="reference")
    assert [k.kind for k in derivation.best.kernels] == ["matmul"]
    match = derivation.best.kernels[0].match
    assert match.a.tensor == "A" and match.a.shape == (1, 60, 8)  # (n, h, w) fused into m, no copy


def test_strided_operands_match_without_copies():
    """OLLIE Expression (2): C[b, 0, m, 1+k] D[b-1, b, k, n] is a BatchMatmul read in place."""
    expr = parse(
        "L b:1..3, m:4, n:5 ; S k:3 ; C[b, 0, m, 1+k] * D[b-1, b, k, n]", {"C": (3, 2, 4, 4), "D": (2, 3, 3, 5)}
    )
    match = match_gemm(expr)
    assert match is not None and match.kind == "batch_matmul"
    inputs = random_inputs(expr, 0)
    np.testing.assert_allclose(instantiate(expr)(**inputs), evaluate(expr, inputs), rtol=1e-12)


def test_reads_of_padding_do_not_match_an_operator():
    assert match_gemm(CASES["conv3x3"].expression()) is None
    assert match_gemm(matmul((3, 4), (4, 5))) is not None


def test_any_expression_gets_at_least_the_identity_candidate():
    expr = parse("L i:4 ; M j:3 ; exp(A[i, j]) / max(A[j, i], 0.5)", {"A": (4, 4)})
    derivation = derive(expr, max_depth=2, backend="reference")
    assert derivation.candidates and all(k.kind == "eop" for k in derivation.best.kernels)


def test_every_candidate_is_verified_on_generated_expressions():
    """Every candidate derive returns computes the expression. Only the identity (which always
    does) comes back for most small expressions at depth 1; with a summation about 0.4 of them
    have others (measured), and the test needs some: at least 0.15 of the examples."""
    derived = []

    @settings(max_examples=40)
    @given(expressions(max_traversal=2, min_summation=1, max_summation=2))
    def check(expr):
        derivation = derive(expr, max_depth=1, backend="reference")
        assert derivation.rejected == []
        inputs = random_inputs(expr, 3)
        expected = evaluate(expr, inputs)
        for candidate in derivation.candidates:
            np.testing.assert_allclose(candidate(**inputs), expected, rtol=1e-8, atol=1e-8)
        derived.append(len(derivation.candidates) > 1)

    check()
    assert sum(derived) >= 0.15 * 40, f"{sum(derived)} of {len(derived)} examples had a derived candidate"


def test_convtranspose_becomes_one_matmul_and_one_eoperator():
    """OLLIE Figure 12: the stride-2 transposed convolution as one Matmul plus a gathering eOperator."""
    expr = CASES["convtranspose"].expression()
    derivation = derive(expr, max_depth=4, backend="reference")
    assert ["matmul", "eop"] in [[k.kind for k in c.kernels] for c in derivation.candidates]
    assert derivation.rejected == []


def test_the_offset_add_of_a_convtranspose_sums_only_the_taps_that_meet_each_point():
    """An NCHW ConvTranspose becomes a (Batch)Matmul plus an OffsetAdd at depth 3; the OffsetAdd
    as derived sums over every input position (64 here). Tightening it would take a fourth
    explorative step; derive makes the best candidates' summing eOperators lighter as a guided
    step, so the OffsetAdd sums over the 2x2 taps that meet each output point. (No guided
    operator steps: they are not needed here, and would take a minute.)"""
    from rewriter import conv_transpose2d

    expr = conv_transpose2d((2, 8, 8, 8), (8, 4, 4, 4), stride=2, padding=1)
    derivation = derive(expr, max_depth=3, backend="reference", time_limit=None, guided_depth=0)
    assert derivation.rejected == []

    def offset_add(candidate):
        gemm = [k.output for k in candidate.kernels if k.kind in ("matmul", "batch_matmul")]
        return [
            k
            for k in candidate.kernels
            if k.kind == "eop" and k.expr.summation and set(gemm) & set(tensor_shapes(k.expr))
        ]

    lighter = [
        c
        for c in derivation.candidates
        if any(math.prod(it.size for it in k.expr.summation) == 4 for k in offset_add(c))
    ]
    assert lighter and any(
        step.kind == "guided" and step.rule == "summation boundary tightening" for step in lighter[0].source.path
    )
    inputs = random_inputs(expr, 2)
    np.testing.assert_allclose(lighter[0](**inputs), evaluate(expr, inputs), rtol=1e-8, atol=1e-8)


def test_postprocessing_fuses_eoperators_and_drops_identities():
    from rewriter.lower import Candidate, Kernel, postprocess

    shapes = {"A": (4, 3)}
    copy = parse("L i:4, j:3 ; A[i, j]", shapes)
    scale = parse("L i:4, j:3 ; 2 * T0[i, j]", {"T0": (4, 3)})
    shift = parse("L j:3, i:4 ; T1[i, j] + 1", {"T1": (4, 3)})
    candidate = Candidate([Kernel("eop", "T0", copy), Kernel("eop", "T1", scale), Kernel("eop", "out", shift)])
    processed = postprocess(candidate)
    assert [k.kind for k in processed.kernels] == ["eop"]
    a = np.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(processed(A=a), candidate(A=a))
    np.testing.assert_allclose(processed(A=a), (2 * a + 1).T)
    assert "A[" in str(processed.kernels[0].expr) and "T0" not in str(processed.kernels[0].expr)


def test_weight_only_kernels_are_marked():
    from rewriter.lower import Candidate, Kernel, postprocess

    relayout = parse("L a:3, b:4 ; K[b, a]", {"K": (4, 3)})
    product = parse("L i:2, j:4 ; S a:3 ; A[i, a] * T0[a, j]", {"A": (2, 3), "T0": (3, 4)})
    candidate = postprocess(
        Candidate([Kernel("eop", "T0", relayout), Kernel("matmul", "out", product, match_gemm(product))]), ("K",)
    )
    assert [k.weight_only for k in candidate.kernels] == [True, False]
    a, k = np.ones((2, 3)), np.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(candidate(A=a, K=k), a @ k.T)


def test_convolutions_match_the_conv2d_table_with_stride_and_dilation():
    match = CONV2D.match(conv2d((1, 4, 9, 9), (6, 4, 3, 3), stride=2, dilation=2, padding=1))
    assert match is not None and match.spatial == (("h", "r", 2, 2), ("w", "s", 2, 2))
    assert match.structure == (((3, 2), (3, 2)),)
    assert CONV2D.match(CASES["conv5x5"].expression()) is not None
    assert CONV2D.match(CASES["convtranspose"].expression()) is None  # its kernel index runs backwards
    assert CONV2D.match(matmul((3, 4), (4, 5))) is None
    expr = conv2d((1, 3, 6, 6), (2, 3, 3, 3), padding=1)
    inputs = random_inputs(expr, 4)
    candidate = instantiate(expr)
    assert [k.kind for k in candidate.kernels] == ["conv2d"]
    np.testing.assert_allclose(candidate(**inputs), evaluate(expr, inputs), rtol=1e-12)


def test_band_matmuls_match_the_g2bmm_and_gbmm_tables():
    from rewriter import g2bmm, gbmm

    dilated = match_band(CASES["g2bmm"].expression())
    assert (dilated.kind, dilated.dilation) == ("g2bmm", 4)
    for expr, kind in (
        (g2bmm((2, 10, 4), (2, 10, 4), width=2), "g2bmm"),
        (gbmm((2, 10, 5), (2, 10, 3), width=2, dilation=2), "gbmm"),
    ):
        candidate = instantiate(expr)
        assert [k.kind for k in candidate.kernels] == [kind]
        inputs = random_inputs(expr, 5)
        np.testing.assert_allclose(candidate(**inputs), evaluate(expr, inputs), rtol=1e-12)
    assert match_band(CASES["conv3x3"].expression()) is None
    assert match_band(matmul((3, 4), (4, 5))) is None


def _convs(candidate):
    return [k for k in candidate.kernels if k.kind == "conv2d"]


def _kernel_extent(kernel) -> tuple:
    """(kernel height, kernel width, dilation) of a matched conv2d kernel."""
    sizes = {it.name: it.size for it in kernel.expr.iterators}
    (_, r, _, dr), (_, s, _, ds) = kernel.match.spatial
    return sizes[r], sizes[s], max(dr, ds)


def _conv5x5_becomes_conv3x3(expr, max_depth):
    derivation = derive(expr, max_depth=max_depth, backend="reference")
    smaller = [c for c in derivation.candidates if len(_convs(c)) == 1 and _kernel_extent(_convs(c)[0]) == (3, 3, 1)]
    assert smaller, [str(c) for c in derivation.candidates]
    assert derivation.rejected == []
    best = smaller[0]
    assert "summation iterator splitting" in derivation.explain(best)
    inputs = random_inputs(expr, 6)
    np.testing.assert_allclose(best(**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)
    return best


def test_conv5x5_becomes_a_conv3x3_plus_eoperators():
    """SRCNN in OLLIE: r = 3*ro + ri (the 6th offset reads padding), the ro, so sums move out,
    the inner scope skews h + 3*ro: four shifted 3x3 kernels as one Conv3x3 and an OffsetAdd."""
    best = _conv5x5_becomes_conv3x3(conv2d((2, 4, 12, 12), (3, 4, 5, 5), padding=2), max_depth=3)
    assert [k.kind for k in best.kernels] == ["eop", "conv2d", "eop"]  # weight layout, conv, OffsetAdd


@pytest.mark.slow
def test_conv5x5_public_case_becomes_a_conv3x3_plus_eoperators():
    _conv5x5_becomes_conv3x3(CASES["conv5x5"].expression(), max_depth=3)


def test_dilated_g2bmm_becomes_a_plain_g2bmm_plus_layout_eoperators():
    """Longformer in OLLIE: i = 4*p + q turns Kt[i + 4*j] into Kt'[q, p + j]: dilation 1, q batched."""
    expr = CASES["g2bmm"].expression()
    derivation = derive(expr, max_depth=1, backend="reference")
    plain = [c for c in derivation.candidates if any(k.kind == "g2bmm" and k.match.dilation == 1 for k in c.kernels)]
    assert plain and derivation.rejected == []
    kinds = [k.kind for k in plain[0].kernels]
    assert kinds.count("g2bmm") == 1 and set(kinds) == {"g2bmm", "eop"}
    assert "variable substitution" in derivation.explain(plain[0])


def test_dilated_conv_becomes_a_plain_conv_plus_eoperators():
    """CSRNet in OLLIE (as in PET): h = 2*p + q, w = 2*p1 + q1 make the dilation-2 reads plain."""
    expr = conv2d((1, 8, 14, 14), (8, 8, 3, 3), dilation=2, padding=2)
    derivation = derive(expr, max_depth=2, backend="reference")
    plain = [c for c in derivation.candidates if len(_convs(c)) == 1 and _kernel_extent(_convs(c)[0]) == (3, 3, 1)]
    assert plain and derivation.rejected == []
    inputs = random_inputs(expr, 7)
    np.testing.assert_allclose(plain[0](**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)


def test_nan_results_of_random_inputs_agree_position_by_position():
    """sqrt of a negative random input is NaN in the reference and in every candidate alike."""
    expr = parse("L i:6 ; sqrt(A[i] + 0.1) * B[i]", {"A": (6,), "B": (6,)})
    for backend in ("reference", "cpu"):
        derivation = derive(expr, max_depth=1, backend=backend)
        assert derivation.candidates and derivation.rejected == []


def test_sampled_verification_sees_an_error_at_the_far_corner():
    """Above FULL_CHECK_TERMS the reference is evaluated on boxes of the output only; the high
    corner is one of them, where padding errors show."""
    from rewriter.lower import Candidate, Kernel
    from rewriter.pipeline.verify import Check

    expr = conv2d((1, 3, 9, 9), (4, 3, 3, 3), padding=1)
    inputs = random_inputs(expr)
    check = Check(expr, inputs, 1e-9, sampled=True, rng=np.random.default_rng(0))
    assert 1 < len(check.expected) <= 4 and all(want.size < evaluate(expr, inputs).size for _, want in check.expected)
    identity = Candidate([Kernel("eop", "out", expr)])
    right = evaluate(expr, inputs)
    assert check.agrees(identity, right, 1e-9, "")
    wrong = right.copy()
    wrong[-1, -1, -1, -1] += 1e-3
    assert not check.agrees(identity, wrong, 1e-9, "") and len(check.rejected) == 1


def test_derive_verifies_by_samples_above_the_threshold(monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("rewriter.pipeline.derive"), "FULL_CHECK_TERMS", 0)
    expr = conv2d((1, 4, 6, 6), (4, 4, 3, 3), padding=1)
    derivation = derive(expr, max_depth=1, time_limit=60)
    inputs = random_inputs(expr, seed=3)
    assert derivation.rejected == []
    for program in derivation.candidates:
        np.testing.assert_allclose(program(**inputs), evaluate(expr, inputs), rtol=1e-3, atol=1e-3)


def test_an_operand_broadcast_along_a_batch_dimension_matches_batch_matmul():
    """NCHW ConvTranspose after summation splitting: n indexes the input and the output but not
    the weight, and does not merge with x, y into one row dimension: it is a batch dimension over
    which the weight is broadcast (stride 0)."""
    from rewriter.lower import Candidate, Kernel

    shapes = {"A": (3, 5, 2, 2), "K": (5, 4, 3, 3)}
    scope = parse("L n:3, x:2, y:2, f:4, p:3, q:3 ; S c:5 ; A[n, c, x, y] * K[c, f, p, q]", shapes)
    match = match_gemm(scope)
    assert match.kind == "batch_matmul" and match.a.shape == (3, 4, 5) and match.b.strides[0] == 0
    inputs = random_inputs(scope)
    np.testing.assert_allclose(
        Candidate([Kernel("batch_matmul", "out", scope, match)])(**inputs), evaluate(scope, inputs)
    )


def test_sampled_reference_values_are_the_full_ones_in_each_box():
    """The sampled boxes evaluate the expression with its nested scopes cut to what each box
    reads: the values are those of the full evaluation there."""
    from rewriter.pipeline.verify import Check

    shapes = {"A": (30, 40), "B": (3,)}
    expr = parse(
        "L i:40, j:30 ; relu({ L a:30, b:40 ; S k:3 ; A[a+k-1, b] * B[k] }[j, i] + { L c:40 ; B[c/20] }[i])", shapes
    )
    inputs = random_inputs(expr)
    check = Check(expr, inputs, 1e-9, sampled=True, rng=np.random.default_rng(1))
    full = evaluate(expr, inputs)
    assert len(check.expected) == 4 and all(want.shape == (16, 16) for _, want in check.expected)
    for box, want in check.expected:
        np.testing.assert_allclose(want, full[box])


def test_a_summation_read_as_two_dimensions_is_merged_by_a_layout_eoperator_for_a_matmul():
    """Attention's output projection reads the context as T[k/4, i, k%4] (heads x head size):
    a layout eOperator merges the two dimensions, T'[k, i], and the product is a Matmul."""
    expr = parse("L i:12, j:6 ; S k:8 ; T[k/4, i, k%4] * W[k, j]", {"T": (2, 12, 4), "W": (8, 6)})
    candidate = instantiate(expr)
    assert [k.kind for k in candidate.kernels] == ["eop", "matmul"]
    assert str(candidate.kernels[0].expr) == "L m0:8, d1:12 ; T[m0/4, d1, m0%4]"
    inputs = random_inputs(expr, 3)
    np.testing.assert_allclose(candidate(**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)


def test_equal_nested_scopes_share_one_kernel():
    """A softmax reads its row maximum in the numerator and in the denominator: one kernel."""
    shapes = {"A": (4, 5)}
    row_max = "{ L i:4 ; M r:5 ; A[i, r] }[i]"
    expr = parse(f"L i:4, j:5 ; exp(A[i, j] - {row_max}) / {{ L i:4 ; S r:5 ; exp(A[i, r] - {row_max}) }}[i]", shapes)
    candidate = instantiate(expr)
    assert len(candidate.kernels) == 3 and str(candidate.kernels[0].expr) == "L i:4 ; M r:5 ; A[i, r]"
    inputs = random_inputs(expr, 4)
    np.testing.assert_allclose(candidate(**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)


def test_a_batch_of_small_gemms_becomes_one_matmul_through_an_operand_layout():
    """A transposed convolution's product (DCGAN's, NCHW input): (x, y) batch GEMMs of n rows.
    Re-laid out as A'[x, y, n, c], (x, y, n) is one GEMM dimension and one Matmul computes it;
    ``derive`` keeps both forms for measurement to choose."""
    shapes = {"A": (3, 5, 2, 2), "K": (5, 4, 3, 3)}
    expr = parse("L x:2, y:2, n:3, f:4, t:-1..2, t1:-1..2 ; S c:5 ; A[n, c, x, y] * K[c, f, t+1, t1+1]", shapes)
    assert [k.kind for k in instantiate(expr).kernels] == ["batch_matmul"]
    relaid = instantiate(expr, relayout=True)
    assert [k.kind for k in relaid.kernels] == ["eop", "matmul"]
    assert str(relaid.kernels[0].expr) == "L x:2, y:2, n:3, c:5 ; A[n, c, x, y]"
    inputs = random_inputs(expr, 5)
    np.testing.assert_allclose(relaid(**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)
    kinds = [[k.kind for k in c.kernels] for c in derive(expr, max_depth=0, backend="reference").candidates]
    assert ["batch_matmul"] in kinds and ["eop", "matmul"] in kinds


@pytest.mark.parametrize("offset", [0, 1])
def test_a_strided_convolution_becomes_one_matmul_through_a_compacting_layout(offset):
    """A 1x1 convolution of stride 2 (ResNet's downsampling shortcut, NCHW) reads every other
    row and column: as it lies, one GEMM per output row. Its layout copy keeps every other
    element (``X'[n, c, q, h, q', w]``, q and q' the one offset read), after which (h, w) is one
    GEMM dimension and one Matmul computes it; ``derive`` keeps both forms for measurement."""
    shapes = {"X": (1, 6, 9, 9), "W": (4, 6, 1, 1)}
    expr = parse(f"L n:1, f:4, h:4, w:4 ; S c:6 ; X[n, c, 2*h+{offset}, 2*w+{offset}] * W[f, c, 0, 0]", shapes)
    assert [k.kind for k in instantiate(expr).kernels] == ["batch_matmul"]
    relaid = instantiate(expr, relayout=True)
    assert [k.kind for k in relaid.kernels] == ["eop", "matmul"] and relaid.kernels[1].match.batches == 1
    layout = relaid.kernels[0].expr
    q = "1" if offset == 0 else f"{offset}..{offset + 1}"  # the one offset read
    assert str(layout) == f"L d0:1, d1:6, q2:{q}, j2:4, q3:{q}, j3:4 ; X[d0, d1, 2*j2+q2, 2*j3+q3]"
    inputs = random_inputs(expr, 5)
    np.testing.assert_allclose(relaid(**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)
    kinds = [[k.kind for k in c.kernels] for c in derive(expr, max_depth=0, backend="reference").candidates]
    assert ["batch_matmul"] in kinds and ["eop", "matmul"] in kinds


def test_the_fastest_candidates_are_timed_again_before_the_choice(tmp_path):
    """A stored timing taken in another run (here an impossible nanosecond for the naive
    kernel) does not decide alone: the fastest candidates' kernels are timed again, in turns,
    and the database keeps the new timing."""
    from codegen.backend import CpuBackend
    from codegen.measure import MeasurementDB, Timing
    from codegen.program import _step
    from rewriter.lower import Kernel

    expr = matmul((128, 128), (128, 128))
    db = MeasurementDB(tmp_path / "m.sqlite")
    naive = _step(Kernel("eop", "out", expr), "tvm", "float32").signature("float32")
    db.put(naive, Timing(1e-9, 0.0, 1, False))
    result = derive(expr, max_depth=1, backend=CpuBackend(db=db))
    assert db.get(naive).median > 1e-6
    assert all(program.cost > 1e-6 for program in result.candidates)


# ---------------------------------------------------------------------------------------------
# Anytime derivation: a deeper budget never costs a result


MONOTONE = {
    "conv3x3 NCHW": conv2d((1, 8, 6, 6), (8, 8, 3, 3), padding=1),
    "convtranspose NCHW": conv_transpose2d((1, 4, 3, 3), (4, 6, 4, 4), stride=2, padding=1),
    "matmul chain": CASES["matmul_chain"].expression(),
    "band": parse("L i:40, j:9 ; S k:8 ; Q[i, k] * Kt[i+j-4, k]", {"Q": (40, 8), "Kt": (40, 8)}),
}


def test_checking_waits_for_the_levels_and_starts_with_the_cheapest_candidate(monkeypatch):
    """Nothing is checked until every level is searched, and the analytically cheapest
    candidate of all is checked first: at full size a shallow eOperator runs for seconds, and
    checked between the levels it spent the budget of the product a deeper level finds (a
    DCGAN's transposed convolutions)."""
    derive_module = importlib.import_module("rewriter.pipeline.derive")  # (the package names the function so)
    events = []
    levels = derive_module.explore_levels

    def watched(*args, **kwargs):
        yield from levels(*args, **kwargs)
        events.append("levels done")

    add = derive_module._Measuring.add

    def recorded(self, candidate):
        events.append(candidate)
        return add(self, candidate)

    monkeypatch.setattr(derive_module, "explore_levels", watched)
    monkeypatch.setattr(derive_module._Measuring, "add", recorded)
    derivation = derive(MONOTONE["convtranspose NCHW"], max_depth=2, backend="reference")
    assert events[0] == "levels done" and len(events) > 2
    assert events[1].cost == min(c.cost for c in derivation.candidates)
    assert any(c.source is None and [k.kind for k in c.kernels] == ["eop"] for c in derivation.candidates)


def test_a_candidate_whose_runs_would_end_past_the_deadline_is_not_checked():
    """A measuring backend skips a candidate whose analytic cost, times the runs a check and a
    measurement take, ends past the deadline; the identity (the fallback) is checked anyway.
    The slow form here sums over a zero-padded range of 2e12 (equal values, 48000 s by the
    analytic cost): checked, it would never finish."""
    derive_module = importlib.import_module("rewriter.pipeline.derive")
    shapes = {"A": (4, 8), "B": (8, 4)}
    expr = parse("L i:4, j:4 ; S k:8 ; A[i, k] * B[k, j]", shapes)
    slow = Candidate(
        [Kernel("eop", "out", parse("L i:4, j:4 ; S k:-1000000000000..1000000000000 ; A[i, k] * B[k, j]", shapes))]
    )
    identity = Candidate([Kernel("eop", "out", expr)])
    timed = ReferenceBackend()
    timed.measures = True  # a stand-in that measures: deadlines apply to it
    check = Check(expr, random_inputs(expr, 0), 1e-9)
    measuring = derive_module._Measuring(timed, check, identity, deadline=time.perf_counter() + 3600)
    measuring.verify([identity, slow, instantiate(expr)], keep=8)
    assert [[k.kind for k in p.kernels] for p in measuring.compiled] == [["eop"], ["matmul"]]
    assert key(slow) not in measuring.checked


def _forms(derivation) -> set:
    return {tuple(k.kind for k in c.kernels) for c in derivation.candidates}


@pytest.mark.parametrize("name", MONOTONE)
def test_a_deeper_search_returns_every_form_a_shallower_one_does(name):
    """Levels are searched, instantiated, verified and measured one at a time, so a derivation
    at depth d starts with exactly the one at depth d-1 (same state budget, no time limit)."""
    expr = MONOTONE[name]
    forms = [_forms(derive(expr, depth, max_states=400, time_limit=None, backend="reference")) for depth in (1, 2, 3)]
    assert forms[0] <= forms[1] <= forms[2], forms
    assert len(forms[2]) > 1  # more than the identity


# ---------------------------------------------------------------------------------------------
# Convolutions as PyTorch and ONNX lay them out (input NCHW, weight OIHW) become GEMMs


NCHW = {
    "3x3 padding 1": conv2d((1, 16, 6, 6), (16, 16, 3, 3), padding=1),
    "5x5 padding 2": conv2d((1, 8, 8, 8), (4, 8, 5, 5), padding=2),
    "transposed 4x4 stride 2": conv_transpose2d((1, 8, 4, 4), (8, 8, 4, 4), stride=2, padding=1),
    "3x3 dilation 2": conv2d((1, 8, 9, 9), (8, 8, 3, 3), padding=2, dilation=2),
    # the GEMM runs over every input position, the OffsetAdd reads every second one
    "3x3 stride 2": conv2d((1, 8, 8, 8), (8, 8, 3, 3), stride=2, padding=1),
}


@pytest.mark.parametrize("expr", NCHW.values(), ids=NCHW.keys())
def test_nchw_convolutions_become_gemms_plus_eoperators(expr):
    """The paper's Figure 3b form (a Matmul or BatchMatmul plus eOperators: the weight re-laid
    out, the OffsetAdd) is derived for the layouts models use, not only for NHWC/RSFC."""
    derivation = derive(expr, max_depth=3, time_limit=None, backend="reference")
    gemms = [c for c in derivation.candidates if {"matmul", "batch_matmul"} & {k.kind for k in c.kernels}]
    assert gemms, _forms(derivation)
    inputs = random_inputs(expr, 2)
    np.testing.assert_allclose(gemms[0](**inputs), evaluate(expr, inputs), rtol=1e-9, atol=1e-9)


def test_a_temporary_is_bounded_by_the_expression_unless_it_is_small():
    """Temporaries over 8x the expression's largest tensor are refused only when large in
    themselves: a 3x3 convolution's Figure 3b form keeps 9 partial images of its output."""
    expr = parse("L i:4 ; A[i]", {"A": (4,)})
    small = parse("L i:64 ; A[i % 4]", {"A": (4,)})
    large = parse(f"L i:{SMALL_TEMPORARY + 1} ; A[i % 4]", {"A": (4,)})
    assert not oversized([Kernel("eop", "T", small)], expr)
    assert oversized([Kernel("eop", "T", large)], expr)


# ---------------------------------------------------------------------------------------------
# The call users make: derive(expr) with its defaults (max_depth 7, 300 s, this CPU) reaches the
# paper's target forms, on the public cases and on convolutions as models lay them out


def _gemm_form(candidate) -> bool:
    kinds = {k.kind for k in candidate.kernels}
    return bool({"matmul", "batch_matmul"} & kinds) and kinds <= {"matmul", "batch_matmul", "eop"}


def _conv3x3_form(candidate) -> bool:
    return len(_convs(candidate)) == 1 and _kernel_extent(_convs(candidate)[0]) == (3, 3, 1)


def _plain_g2bmm_form(candidate) -> bool:
    return any(k.kind == "g2bmm" and k.match.dilation == 1 for k in candidate.kernels)


TARGETS = {
    "conv3x3": (CASES["conv3x3"].expression(), _gemm_form),
    "convtranspose": (CASES["convtranspose"].expression(), _gemm_form),
    "conv5x5": (CASES["conv5x5"].expression(), _conv3x3_form),
    "g2bmm": (CASES["g2bmm"].expression(), _plain_g2bmm_form),
    **{f"NCHW {name}": (expr, _gemm_form) for name, expr in NCHW.items()},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TARGETS)
def test_derive_with_its_defaults_reaches_the_target_form(name):
    """Minutes each: most searches run until the time limit (depth 7 does not finish here), and
    every level's states are verified and measured as they come (anytime)."""
    expr, target = TARGETS[name]
    derivation = derive(expr)
    assert derivation.stats.stop_reason in ("time", "depth", "saturated")
    assert any(target(program) for program in derivation.candidates), _forms(derivation)
    inputs = random_inputs(expr, 3)
    np.testing.assert_allclose(derivation.best(**inputs), evaluate(expr, inputs), rtol=1e-4, atol=1e-4)
