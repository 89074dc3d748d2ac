"""TVM eOperators (codegen/tvm_kernel.py): compiled kernels compute what ``evaluate`` computes.

Each compile takes a tenth of a second or so, hence the small example counts. Every test runs
against a cache directory of its own (REWRITER_CACHE), so nothing is loaded from a user's cache.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import tvm
from hypothesis import given, settings

from codegen import CodegenError, Schedule, TvmKernel, candidate_schedules, compile_scope, tvm_kernel
from codegen.tvm_kernel import (
    _native_lanes,
    _scheduled,
    aligned_copy,
    aligned_empty,
    cache_path,
    host_target,
    lower_to_te,
    native_lanes,
    panel_layout,
    panel_width,
    physical_cores,
    tile_vectors,
    wide_tile,
)
from rewriter import conv2d, conv_transpose2d, evaluate, g2bmm, matmul, parse
from rewriter.cases import CASES
from rewriter.testing.strategies import ALL_FUNCTIONS, expressions_with_inputs, random_inputs


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REWRITER_CACHE", str(tmp_path_factory.mktemp("kernels")))
        yield


def compiled(expr, inputs, dtype="float64", schedule=None) -> np.ndarray:
    return compile_scope(expr, dtype=dtype, schedule=schedule)(**inputs)


def assert_matches(expr, inputs, dtype="float64", schedule=None):
    expected = evaluate(expr, inputs)
    actual = compiled(expr, inputs, dtype, schedule)
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype)
    if dtype == "float64":
        np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-9, err_msg=str(expr))
    else:  # float32 sums: compare relative to the output's scale
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale, err_msg=str(expr))


# --------------------------------------------------------------------------------------------
# (a) generated expressions


@settings(max_examples=25, deadline=None)
@given(expressions_with_inputs(functions=ALL_FUNCTIONS, nesting_probability=0.3, max_size=9, max_dim=10))
def test_generated_expressions_match_evaluate(expr_inputs):
    assert_matches(*expr_inputs)


@settings(max_examples=10, deadline=None)
@given(expressions_with_inputs(div_probability=0.7, max_size=9, max_dim=10, max_summation=3))
def test_generated_division_heavy_expressions_match_evaluate(expr_inputs):
    assert_matches(*expr_inputs)


@settings(max_examples=40, deadline=None)
@given(expressions_with_inputs(functions=ALL_FUNCTIONS, nesting_probability=0.4, max_size=12, max_summation=3))
def test_schedules_apply_without_falling_back(expr_inputs):
    # a refused schedule falls back to plain loops silently (sound, slow): keep that rare
    expr, _ = expr_inputs
    for schedule in (Schedule(), Schedule(reduction_vector=True)):
        _scheduled(lower_to_te(expr, "float64", schedule.pad), schedule, host_target())


# --------------------------------------------------------------------------------------------
# (b) the public operators at small sizes


SMALL_OPERATORS = {
    "conv3x3_nhwc": conv2d((1, 5, 6, 8), (3, 3, 16, 8), padding=1, layout="NHWC"),
    "conv5x5_nchw": conv2d((2, 3, 9, 9), (1, 3, 5, 5), padding=2),
    "conv_stride_dilation": conv2d((1, 4, 11, 11), (6, 4, 3, 3), stride=2, padding=2, dilation=2),
    "convtranspose": conv_transpose2d((2, 2, 2, 8), (4, 4, 6, 8), stride=2, padding=1, layout="NHWC"),
    "g2bmm_dilated": g2bmm((2, 20, 16), (2, 20, 16), width=3, dilation=2),
    "matmul": matmul((7, 12), (12, 33)),
}


@pytest.mark.parametrize("name", sorted(SMALL_OPERATORS))
def test_public_operators_at_small_sizes(name):
    expr = SMALL_OPERATORS[name]
    assert_matches(expr, random_inputs(expr, 1), dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_compiled_select_passes_the_chosen_value_exactly_and_never_the_other(dtype):
    """``where`` compiles to selects: an infinity chosen stays infinite, a NaN not chosen is gone."""
    expr = parse("L i:6 ; select(C[i], A[i]) + select(1 - C[i], B[i])", {"A": (6,), "B": (6,), "C": (6,)})
    inputs = {
        "C": np.array([1, 0, 1, 0, 1, 0], dtype),
        "A": np.array([2.5, np.nan, np.inf, -np.inf, -1.0, 4.0], dtype),
        "B": np.array([np.nan, 3.0, 1.0, 7.0, np.inf, -np.inf], dtype),
    }
    expected = [2.5, 3.0, np.inf, 7.0, -1.0, -np.inf]
    np.testing.assert_array_equal(evaluate(expr, inputs), expected)
    np.testing.assert_array_equal(compiled(expr, inputs, dtype), np.array(expected, dtype))


def test_matmul_chain_case_at_full_size():
    expr = CASES["matmul_chain"].expression()
    assert_matches(expr, random_inputs(expr, 2), dtype="float32")


def test_default_schedule_vectorises():
    assert "T.vectorized" in compile_scope(SMALL_OPERATORS["conv3x3_nhwc"]).listing()


@pytest.mark.parametrize("size, parallel", [(16, False), (160, True)])
def test_only_stages_with_enough_work_run_in_parallel(size, parallel):
    """Waking the thread pool costs tens of microseconds: a small product runs on one thread."""
    expr = parse(f"L m:{size}, n:{size} ; S k:{size} ; A[m, k] * B[k, n]", {"A": (size, size), "B": (size, size)})
    assert ("T.parallel" in compile_scope(expr, dtype="float32").listing()) == parallel
    assert_matches(expr, random_inputs(expr, 1), dtype="float32")


@pytest.mark.parametrize("body, parallel", [("X[i, j] + B[j]", False), ("exp(X[i, j] + B[j])", True)])
def test_a_stage_of_exponentials_is_worth_two_threads_where_additions_are_not(body, parallel):
    """The same 64x512 points: an addition each runs on one thread, an exponential each
    (16 multiply-adds of its polynomial) on two."""
    expr = parse(f"L i:64, j:512 ; {body}", {"X": (64, 512), "B": (512,)})
    assert ("T.parallel" in compile_scope(expr, dtype="float32").listing()) == parallel
    assert_matches(expr, random_inputs(expr, 2), dtype="float32")


@pytest.mark.parametrize("body, parallel", [("X[i, j]", False), ("X[j, i]", True)])
def test_a_transposition_is_worth_two_threads_where_a_copy_of_as_many_points_is_not(body, parallel):
    """The same 192x256 points: copied as they lie (a stream), on one thread; transposed (each
    read on another cache line), on two."""
    expr = parse(f"L i:192, j:256 ; {body}", {"X": (192, 256) if body == "X[i, j]" else (256, 192)})
    assert ("T.parallel" in compile_scope(expr, dtype="float32").listing()) == parallel
    assert_matches(expr, random_inputs(expr, 3), dtype="float32")


def test_a_products_register_tile_runs_along_the_rows_that_share_the_weight():
    """C = A @ B: the unrolled rows of the register tile are rows of m (one load of B's vector
    serves them all), and the loops over n go outside those over m (B's slice stays in cache
    while m sweeps it)."""
    expr = parse("L m:32, n:256 ; S k:64 ; A[m, k] * B[k, n]", {"A": (32, 64), "B": (64, 256)})
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(tile=8)).listing()
    assert "for m_1 in T.unroll(8)" in listing and "for n_1 in T.vectorized" in listing
    assert listing.index("n_0") < listing.index("m_0")
    assert_matches(expr, random_inputs(expr, 2), dtype="float32", schedule=Schedule(tile=8))


@pytest.mark.parametrize("cpu, lanes", [("znver3", 8), ("haswell", 8), ("znver4", 16), ("skylake-avx512", 16)])
def test_the_native_vector_width_is_the_cpus_widest_registers(cpu, lanes):
    """Tiles are sized by the target's float32 lanes: 8 on AVX2-only CPUs (TVM's own vector
    width says 512 bits for them too, and tiles sized so spilled on AMD Zen 3)."""
    target = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    assert _native_lanes(target, "float32") == lanes


@pytest.mark.parametrize(
    "columns, tile", [(14, "w_1 in T.unroll(7)"), (7, "w_1 in T.unroll(7)"), (28, "l_0_1 in T.unroll(2)")]
)
def test_with_avx2s_lanes_a_convolution_tiles_its_columns_in_rows_one_vector_wide_where_two_would_not_divide_them(
    columns, tile
):
    """A 3x3 convolution in panels of 16 output channels, 8 lanes (AVX2, 16 registers): rows two
    vectors wide are at most 6, and 14 or 7 columns have no divisor up to that but 2 or 1; one
    vector wide, 7 rows. 28 columns keep rows of two vectors (4 rows: 8 accumulators)."""
    shapes = {"X": (8, columns + 2, columns + 2), "P": (4, 8, 3, 3, 16)}
    text = f"L j:4, h:{columns}, w:{columns}, l:16 ; S c:8, r:3, s:3 ; X[c, h+r, w+s] * P[j, c, r, s, l]"
    expr = parse(text, shapes)
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=8)).listing()
    assert tile in listing and "T.vectorized(8)" in listing
    assert_matches(expr, random_inputs(expr, 3), dtype="float32", schedule=Schedule(vector=8))


def test_a_products_tile_rows_share_its_vector_reads_however_large_the_broadcast_operand():
    """ConvNeXt's pointwise convolutions: the input (3136x96) is larger than the weight (96x384),
    but along the weight's columns rows would share only the input's broadcast element; the tile
    runs along the input's rows, each weight vector loaded once for 14 of them."""
    expr = parse("L i:280, j:64 ; S k:16 ; X[i, k] * W[k, j]", {"X": (280, 16), "W": (16, 64)})
    schedule = Schedule(vector=16)
    listing = compile_scope(expr, dtype="float32", schedule=schedule).listing()
    assert "for i_1 in T.unroll(14)" in listing and "for j_1 in T.vectorized(16)" in listing
    assert_matches(expr, random_inputs(expr, 2), dtype="float32", schedule=schedule)


@pytest.mark.parametrize(
    "text, shapes, blocked",
    [  # an NCHW 1x1 convolution computed transposed: its input read k-major, a new line each step
        ("L fo:4, n:56, fi:32 ; S k:512 ; X[k, n] * U[fo, k, fi]", {"X": (512, 56), "U": (4, 512, 32)}, True),
        # a product whose broadcast reads run along the summation: each line serves 16 steps
        ("L i:56, j:128 ; S k:512 ; A[i, k] * W[k, j]", {"A": (56, 512), "W": (512, 128)}, False),
    ],
)
def test_a_tile_whose_broadcast_reads_cross_lines_every_step_sums_in_blocks(text, shapes, blocked):
    """Blocked, the summation's outer loop goes outside the loop over the tiles that share the
    weight's block: 8 KiB of it, 128 steps of two AVX2 vectors, 64 of two AVX-512 ones."""
    expr = parse(text, shapes)
    listing = compile_scope(expr, dtype="float32").listing()
    split = re.search(r"T\.axis\.reduce\(512, k_0 \* (\d+) \+ k_1\)", listing)
    lanes = _native_lanes(host_target(), "float32")
    assert (int(split.group(1)) if split else None) == ((8 << 10) // (4 * 2 * lanes) if blocked else None)
    assert_matches(expr, random_inputs(expr, 4), dtype="float32")
    assert "k_0" not in compile_scope(expr, dtype="float32", schedule=Schedule(kblock=1)).listing()


@pytest.mark.parametrize("rows, guarded", [(29, True), (28, False)])
def test_a_products_tile_rows_go_past_a_loop_they_do_not_divide_guarded(rows, guarded):
    """ViT's attention-weighted values, 197 rows of a prime: rather than one row that shares
    nothing, a tile of six rows along them, the last tile's rows past the loop skipped (29 rows
    here); 28 rows split exactly, in tiles of 14."""
    shapes = {"P": (2, rows, 24), "V": (2, 24, 64)}
    expr = parse(f"L b:2, i:{rows}, j:64 ; S k:24 ; P[b, i, k] * V[b, k, j]", shapes)
    schedule = Schedule(vector=16, width=2)
    listing = compile_scope(expr, dtype="float32", schedule=schedule).listing()
    assert ("for i_1 in T.unroll(6)" in listing) == guarded
    assert ("for i_1 in T.unroll(14)" in listing) == (not guarded)
    assert_matches(expr, random_inputs(expr, 5), dtype="float32", schedule=schedule)


def test_an_epilogue_on_guarded_tiles_reads_only_the_sums_its_tile_made():
    """A bias and a relu after a product tiled in guarded rows run on each tile (the sums in a
    tile-sized local buffer), the last tile's missing rows skipped there too."""
    shapes = {"P": (2, 29, 24), "V": (2, 24, 64), "B": (64,)}
    product = "{ L b:2, i:29, j:64 ; S k:24 ; P[b, i, k] * V[b, k, j] }[b, i, j]"
    expr = parse(f"L b:2, i:29, j:64 ; relu({product} + B[j])", shapes)
    schedule = Schedule(vector=16, width=2)
    listing = compile_scope(expr, dtype="float32", schedule=schedule).listing()
    assert "for i_1 in T.unroll(6)" in listing and 'scope="local"' in listing
    assert_matches(expr, random_inputs(expr, 7), dtype="float32", schedule=schedule)


@pytest.mark.parametrize("n, wide", [(256, True), (48, False)])
def test_a_products_tile_rows_are_two_vectors_wide_where_an_even_number_of_vectors_is_left(n, wide):
    """One broadcast read of A feeds two vectors of each row (16 and 3 vectors of 16 lanes along
    n here); ``Schedule(width=1)`` keeps one. (The default is two where the CPU's vectors hold 16
    lanes, so the widths are pinned here.)"""
    expr = parse(f"L m:32, n:{n} ; S k:64 ; A[m, k] * B[k, n]", {"A": (32, 64), "B": (64, n)})
    two, wide_schedule = "for n_0_1 in T.unroll(2)", Schedule(vector=16, width=2)
    assert (two in compile_scope(expr, dtype="float32", schedule=wide_schedule).listing()) == wide
    assert two not in compile_scope(expr, dtype="float32", schedule=Schedule(vector=16, width=1)).listing()
    assert_matches(expr, random_inputs(expr, 4), dtype="float32", schedule=wide_schedule)


@pytest.mark.parametrize(
    "m, n, tile",
    [
        (32, 96, ["m_1 in T.unroll(4)", "n_0_1 in T.unroll(3)"]),  # 4 rows divide 32, 6 do not: 12 accumulators
        (36, 96, ["m_1 in T.unroll(6)", "n_0_1 in T.unroll(2)"]),  # 6 rows divide 36: as many, two stay
        (32, 64, ["m_1 in T.unroll(4)", "n_0_1 in T.unroll(2)"]),  # 8 vectors along n: three do not divide them
    ],
)
def test_with_avx2s_lanes_a_products_tile_rows_are_three_vectors_wide_where_four_rows_divide_and_six_do_not(m, n, tile):
    """A transformer's 32 tokens (ConvNeXt's 196 pixels) with 16 vector registers: rows of two
    vectors make 4 rows (8 accumulators), rows of three make 4 rows too (12), as many as 6 rows
    of two where 6 divides the rows."""
    expr = parse(f"L m:{m}, n:{n} ; S k:64 ; A[m, k] * B[k, n]", {"A": (m, 64), "B": (64, n)})
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=8)).listing()
    unrolled = [line.split("for ")[1].rstrip(":") for line in listing.splitlines() if "T.unroll" in line]
    assert [loop for loop in unrolled if "_init" not in loop] == tile
    assert_matches(expr, random_inputs(expr, 9), dtype="float32", schedule=Schedule(vector=8))


@pytest.mark.parametrize(
    "text, shapes, tile",
    [  # an NCHW8c 1x1 convolution over 196 pixels: 4 rows, each two blocks of output channels
        (
            "L fo:4, p:196, fi:8 ; S co:8, ci:8 ; X[co, p, ci] * W[fo, co, ci, fi]",
            {"X": (8, 196, 8), "W": (4, 8, 8, 8)},
            ["p_1 in T.unroll(4)", "fo_1 in T.unroll(2)"],
        ),
        # over 49 pixels: no whole tile of rows two vectors wide (6 at most), so the pixels are
        # computed widened to 54 (``_widened``), 6 rows of two blocks, and copied out
        (
            "L fo:4, p:49, fi:8 ; S co:8, ci:8 ; X[co, p, ci] * W[fo, co, ci, fi]",
            {"X": (8, 49, 8), "W": (4, 8, 8, 8)},
            ["p_1 in T.unroll(6)", "fo_1 in T.unroll(2)"],
        ),
        # the same read at 2*(p/7), 2*(p%7) (a stride-2 1x1 convolution): widened, the whole
        # tiles would read past X's 14 rows through / and %; 7 rows of one block
        (
            "L fo:4, p:49, fi:8 ; S co:8, ci:8 ; X[co, 2*(p/7), 2*(p%7), ci] * W[fo, co, ci, fi]",
            {"X": (8, 14, 14, 8), "W": (4, 8, 8, 8)},
            ["p_1 in T.unroll(7)"],
        ),
        # a depthwise convolution: no broadcast read for two blocks of channels to share
        (
            "L c:4, h:20, w:20, ci:8 ; S r:3, s:3 ; X[c, h+r, w+s, ci] * W[c, r, s, ci]",
            {"X": (4, 22, 22, 8), "W": (4, 3, 3, 8)},
            ["w_1 in T.unroll(5)"],
        ),
    ],
)
def test_where_the_lanes_loop_is_one_vector_a_tiles_rows_span_two_steps_of_a_loop_its_broadcast_reads_share(
    text, shapes, tile
):
    """With 8 lanes (AVX2) along a blocked layout's channels, the lanes' loop is one vector: a
    row of the register tile takes two steps of the output's blocks (``_columns``), one
    broadcast of X feeding both, in whole tiles, the rows' loop widened to them where it has no
    divisor to tile by and the wider box reads nothing new past a bound through ``/`` or ``%``;
    else rows of one vector."""
    expr = parse(text, shapes)
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=8)).listing()
    unrolled = [line.split("for ")[1].rstrip(":") for line in listing.splitlines() if "T.unroll" in line]
    assert [loop for loop in unrolled if "_init" not in loop] == tile
    assert_matches(expr, random_inputs(expr, 8), dtype="float32", schedule=Schedule(vector=8))


def test_tvm_runs_one_thread_per_physical_core():
    compile_scope(parse("L i:4 ; X[i]", {"X": (4,)}))  # TVM is loaded on first use
    assert 1 <= physical_cores() <= os.cpu_count()
    assert int(os.environ["TVM_NUM_THREADS"]) >= 1


@pytest.mark.parametrize(
    "text, shape",
    [
        ("L h:7, w:20, n:3, c:16 ; X[n, c, h, w]", (3, 16, 7, 20)),
        ("L w:9, c:24 ; 2 * X[c, w] + X[c, 8-w]", (24, 9)),
        ("L t:48, c:16 ; X[0, c, t/8, t%8] * 2", (1, 16, 6, 8)),  # an NCHW image read as tokens
    ],
)
def test_transpositions_are_blocked_along_the_rows_they_read(text, shape):
    """A layout eOperator whose lanes gather is blocked: rows of the loop its reads run along
    sit inside, next to the lanes (seen as an unrolled loop), with the same values."""
    expr = parse(text, {"X": shape})
    listing = compile_scope(expr, dtype="float32").listing()
    assert (
        "T.unroll" in listing
        and "T.unroll" not in compile_scope(expr, dtype="float32", schedule=Schedule(block=1)).listing()
    )
    assert_matches(expr, random_inputs(expr, 3), dtype="float32")


# --------------------------------------------------------------------------------------------
# (c) padding, floor division, max reduction, nested scopes


@pytest.mark.parametrize("pad", [True, False])
def test_reads_outside_a_tensor_are_zero(pad):
    expr = parse("L i:-2..6 ; A[i] + 10 * A[2*i-3]", {"A": (4,)})
    out = compiled(expr, {"A": np.array([1.0, 2.0, 3.0, 4.0])}, schedule=Schedule(pad=pad))
    # i = -2..5: A[i] is 0 for i < 0 and i > 3; A[2i-3] is inside only at i = 2, 3
    np.testing.assert_array_equal(out, [0, 0, 1, 2, 3 + 20, 4 + 40, 0, 0])


def test_a_read_entirely_outside_is_zero():
    expr = parse("L i:3 ; A[i] + A[i+7]", {"A": (4,)})
    np.testing.assert_array_equal(compiled(expr, {"A": np.array([1.0, 2.0, 3.0, 4.0])}), [1, 2, 3])


def test_far_reads_use_wide_indices():
    expr = parse("L i:3000 ; A[1000000*i] + A[(1000000*i+3)/1000000]", {"A": (5,)})
    out = compiled(expr, {"A": np.arange(1.0, 6.0)})
    np.testing.assert_array_equal(out[:6], [2, 2, 3, 4, 5, 0])
    assert not out[6:].any()


# TVM 0.27 simplifies floordiv/floormod of negative coefficients wrongly in buffer indices and
# vectorised ramps; these indices broke it before the lowering worked around it.
FLOOR_INDICES = ["A[(-i-3)/2 + 5]", "A[(7-i)%4]", "A[(i-j)/3] * A[(7-j)%4]", "A[(2*j-i+1)%3 + (i+j)/4]"]


@pytest.mark.parametrize("body", FLOOR_INDICES)
def test_floor_division_and_modulo_of_negative_numerators(body):
    expr = parse(f"L i:8 ; S j:8 ; {body}" if "j" in body else f"L i:8 ; {body}", {"A": (8,)})
    inputs = {"A": np.arange(1.0, 9.0)}
    for schedule in [Schedule(), Schedule(vector=1), Schedule(pad=False), Schedule(reduction_vector=True)]:
        np.testing.assert_array_equal(
            compiled(expr, inputs, schedule=schedule), evaluate(expr, inputs), err_msg=str(schedule)
        )


def test_a_max_pools_parallel_loop_runs_over_the_planes_of_its_padded_copy():
    """ResNet's stem max pool (3x3 of stride 2, padded with the most negative float through a
    mask of the image's box): the mask is read by every channel alike, yet the loops choosing
    the plane of the padded input go outermost, so the parallel loop runs over channels and
    each iteration copies rows of its own planes (0.27 to 0.21 ms here, 0.74 to 0.43 cold).
    n and c, read whole and adjacent, merge into one loop over the planes (``merge_loops``)."""
    lowest = "3.4028234663852886e+38"
    text = f"L n:1, c:64, h:56, w:56 ; M r:3, s:3 ; X[n, c, 2*h+r-1, s+2*w-1] + ({{ L i0:112, i1:112 ; 1 }}[2*h+r-1, s+2*w-1] - 1) * {lowest}"
    expr = parse(text, {"X": (1, 64, 112, 112)})
    listing = compile_scope(expr, dtype="float32").listing()
    assert re.search(r"for (\w+) in T.parallel", listing).group(1).startswith("n_")
    assert_matches(expr, random_inputs(expr, 6), dtype="float32")


def test_a_depthwise_convolution_pads_each_channel_inside_its_parallel_loop():
    """A padded copy read by one stage is made inside that stage's parallel loop, a slice at a
    time, and for a depthwise convolution the loop runs over channels alone (each iteration
    copies its channel's plane once, not three rows per output row); a full convolution's copy,
    which every output channel reads whole, stays apart."""
    depthwise = parse(
        "L f:64, h:56, w:56 ; S r:3, s:3 ; X[f, h+r-1, s+w-1] * W[f, r, s]", {"X": (64, 56, 56), "W": (64, 3, 3)}
    )
    full = parse(
        "L f:128, h:14, w:14 ; S c:8, r:3, s:3 ; X[c, h+r-1, s+w-1] * W[f, c, r, s]",
        {"X": (8, 14, 14), "W": (128, 8, 3, 3)},
    )
    for expr, inside in [(depthwise, True), (full, False)]:
        listing = compile_scope(expr, dtype="float32").listing()
        padding, parallel = listing.index('T.sblock("pad_'), listing.index("T.parallel")
        assert (parallel < padding) == inside
        assert ("T.parallel(64)" in listing) == inside  # the depthwise one's 64 channels, no more
        assert_matches(expr, random_inputs(expr, 5), dtype="float32")


STRIDED = [  # (expression, shapes, the deinterleaved copy's shape, or None: read as it is)
    ("L f:6, h:5, w:5 ; S r:3, s:3 ; X[f, 2*h+r, s+2*w] * W[f, r, s]", (6, 11, 11), (6, 3, 3), "(6, 11, 2, 6)"),
    (
        "L f:4, h:4, w:4 ; S c:3, r:3, s:3 ; X[c, 2*h+r-1, 2*w+s-1] * W[f, c, r, s]",
        (3, 8, 8),
        (4, 3, 3, 3),
        "(3, 9, 2, 5)",
    ),
    (
        "L f:2, h:3, w:5 ; S c:2, r:3, s:3 ; X[c, 3*h+r-1, 3*w+s-2] * W[f, c, r, s]",
        (2, 9, 14),
        (2, 2, 3, 3),
        "(2, 10, 3, 6)",
    ),
    ("L f:4, h:4, w:4 ; S r:3, s:3 ; X[f, 2*w+s, h+r] * W[f, r, s]", (4, 10, 6), (4, 3, 3), None),  # lanes step rows
    ("L f:4, h:3, w:4 ; S c:3 ; X[c, 2*h, 2*w] * W[f, c]", (3, 6, 8), (4, 3), "(3, 6, 2, 4)"),  # no padding
    ("L c:3, h:4, w:5 ; X[c, 2*h, 2*w]", (3, 8, 10), None, None),  # a strided slice reads each element once
]


@pytest.mark.parametrize("text, x, w, copy", STRIDED)
def test_a_strided_convolution_reads_its_input_through_a_deinterleaved_copy(text, x, w, copy):
    """Lanes of a stride-k convolution would read k apart; the input is copied once with its
    last dimension split into k phases, ``copy[.., p, j] = X[.., k*j + p]`` (zero past the end,
    with the padding the reads need), and every tap reads it contiguously."""
    expr = parse(text, {"X": x, **({"W": w} if w else {})})
    listing = compile_scope(expr, dtype="float32").listing()
    assert (f"T.sblock_alloc_buffer({copy}" in listing) if copy else ("T.sblock_alloc_buffer" not in listing)
    for schedule in [Schedule(), Schedule(pad=False), Schedule(reduction_vector=True), Schedule(vector=4)]:
        assert_matches(expr, random_inputs(expr, 7), dtype="float32", schedule=schedule)


def test_a_deinterleaving_copy_made_at_its_reader_reads_padded_rows_copied_without_a_bound_check():
    """TVM scalarises a vectorised loop whose lanes disagree on a guard, so a deinterleaved copy
    of an input padded on both sides, made at its reader's parallel loop, is made in two: the
    padded rows, zeros first and then the rows copied unguarded (a ``_pad_const`` block), and
    the phases out of them, their loop innermost and unrolled. Rows padded only after their end,
    and rows the reader takes in slices (a convolution tiled along them, like ResNet-50's stem),
    stay one guarded copy, which measured as fast there."""
    both = "L f:96, h:56, w:56 ; S r:3, s:3 ; X[f, 2*h+r-1, s+2*w-1] * W[f, r, s]"
    after = "L f:96, h:56, w:56 ; S r:3, s:3 ; X[f, 2*h+r, s+2*w] * W[f, r, s]"
    depthwise = {"X": (96, 112, 112), "W": (96, 3, 3)}
    sliced = "L f:64, h:64, w:64 ; S c:3, r:7, s:7 ; X[c, 2*h+r-3, s+2*w-3] * W[f, c, r, s]"
    cases = [
        (both, depthwise, True),
        (after, depthwise, False),
        (sliced, {"X": (3, 128, 128), "W": (64, 3, 7, 7)}, False),
    ]
    for text, shapes, unguarded in cases:
        expr = parse(text, shapes)
        listing = compile_scope(expr, dtype="float32").listing()
        assert ("_pad_const" in listing) == unguarded
        assert listing.count("T.sblock_alloc_buffer") == (2 if unguarded else 1)
        assert bool(re.search(r'in T.unroll\(2\):\n\s+with T.sblock\("pad_', listing)) == unguarded  # the phases
        assert_matches(expr, random_inputs(expr, 3), dtype="float32")


def test_a_summing_stage_whose_lanes_no_vector_divides_is_computed_over_whole_vectors_and_tiles():
    """ViT's attention scores over 197 tokens: one lane. The stage is widened to whole vectors
    along its lanes (61 to 64) and whole register tiles along the rows sharing the right operand
    (53 to 54: of the deep tiles, more than half of 14 rows, the least rounding, 6 tiles of 9),
    and the output copied out of it; with one lane, nothing widens."""
    expr = parse("L b:2, i:53, j:61 ; S k:8 ; Q[b, i, k] * K[b, k, j]", {"Q": (2, 53, 8), "K": (2, 8, 61)})
    wide, narrow = Schedule(vector=16), Schedule(vector=1)
    assert "T.sblock_alloc_buffer((2, 54, 64)" in compile_scope(expr, dtype="float32", schedule=wide).listing()
    assert "T.sblock_alloc_buffer" not in compile_scope(expr, dtype="float32", schedule=narrow).listing()
    for schedule in (wide, narrow):
        assert_matches(expr, random_inputs(expr, 8), dtype="float32", schedule=schedule)


@pytest.mark.parametrize("pixels, widened", [(7, 64), (5, 32), (3, 0)])
def test_a_pointwise_convolutions_merged_pixels_widen_to_whole_vectors_where_a_quarter_of_their_lanes_is_spare(
    pixels, widened
):
    """A 1x1 convolution over 7x7 pixels, merged (``merge_loops``): 49 pixels in lanes of 7, or
    in 4 whole vectors of 16 (15 of their 64 lanes spare) and the box copied out; 5x5 pixels
    widen to 32; 3x3 to 16 would leave 7 of 16 spare and stays in lanes of 9."""
    text = f"L n:1, f:16, h:{pixels}, w:{pixels} ; S c:8 ; X[n, c, h, w] * K[f, c]"
    expr = parse(text, {"X": (1, 8, pixels, pixels), "K": (16, 8)})
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=16)).listing()
    assert (f"T.sblock_alloc_buffer((1, 16, {widened or 16})" in listing) == bool(widened)
    assert_matches(expr, random_inputs(expr, 9), dtype="float32", schedule=Schedule(vector=16))


def test_an_epilogue_reads_a_widened_stage_where_it_lies_without_a_copy_of_the_box():
    """The 7x7 convolution's sums widened to 64 pixels, read by a bias and clip: the epilogue
    reads the wider buffer within the box, no stage copies the 49 out first."""
    text = (
        "L i0:1, i1:16, i2:7, i3:7 ; min(max({ L n:1, f:16, h:7, w:7 ; S c:8 ; X[n, c, h, w] * K[f, c] }[0, i1, i2, i3]"
        " + B[i1], 0), 6)"
    )
    expr = parse(text, {"X": (1, 8, 7, 7), "K": (16, 8), "B": (16,)})
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=16)).listing()
    assert "T.sblock_alloc_buffer((1, 16, 64)" in listing and "T.sblock_alloc_buffer((1, 16, 49)" not in listing
    assert_matches(expr, random_inputs(expr, 10), dtype="float32", schedule=Schedule(vector=16))


def test_a_products_rows_with_no_tile_dividing_them_widen_to_whole_tiles_under_its_epilogue():
    """113 rows (a prime) of a product with its bias: the sums are widened to 117 rows, whole
    register tiles of 13 rows of two vectors (of the deep tiles, more than half of 14 rows, the
    one that rounds least; 126 in tiles of 14), and the bias runs inside the tile loop on a local
    buffer (guarded tiles there kept every accumulator in memory: ViT's 197x768 @ 3072 with its
    bias, 4.5 ms against 1.9 for the product alone)."""
    expr = parse(
        "L i0:113, i1:64 ; { L i:113, j:64 ; S k:16 ; A[i, k] * B[k, j] }[i0, i1] + C[i1]",
        {"A": (113, 16), "B": (16, 64), "C": (64,)},
    )
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=16)).listing()
    assert 'T.sblock_alloc_buffer((117, 64), scope="local")' in listing and "T.unroll(13)" in listing
    assert "T.where" in listing.split("for k in")[1]  # the epilogue skips the rows past 113
    assert_matches(expr, random_inputs(expr, 11), dtype="float32", schedule=Schedule(vector=16))


def test_a_widened_stage_reads_rows_past_a_tensor_clamped_not_guarded():
    """The 113 rows widened to 117 read A's rows 113-116, which it does not have: clamped to its
    last row, no guard on each load of the summation (what those rows compute is never read;
    guarded, ViT's 197x768 @ 768x3072 product with its bias and GELU took 7.5 ms, clamped 5.3,
    in one slow spell of the machine). Outside the widened rows A is read as before."""
    expr = parse(
        "L i0:113, i1:64 ; { L i:113, j:64 ; S k:16 ; A[i, k] * B[k, j] }[i0, i1] + C[i1]",
        {"A": (113, 16), "B": (16, 64), "C": (64,)},
    )
    summation = compile_scope(expr, dtype="float32", schedule=Schedule(vector=16)).listing().split("for k in")[1]
    update = summation.split("for ax0")[0]
    assert "T.min(" in update and "if_then_else" not in update


@pytest.mark.parametrize("k, rows", [(1024, 7), (1000, 14)])
def test_a_register_tile_has_no_more_rows_than_one_set_of_the_l1_cache_holds(monkeypatch, k, rows):
    """196 rows of a product, each row's broadcast read a line of its own: 1024 floats apart
    (4 KiB, the span of an 8-way 32 KiB L1's sets) every row falls into one set, and a tile of
    14 rows would evict its own lines at every step of the sum (196x3072 @ 3072x768 on a Zen 4:
    7.5 ms in tiles of 14, 4.3 in tiles of 7), so it takes 7; 1000 floats apart the rows spread
    over the sets and the tile is 14 deep."""
    monkeypatch.setattr(tvm_kernel, "_l1_cache", lambda: (8, 64, 64))
    expr = parse(f"L i:196, j:64 ; S k:{k} ; A[i, k] * B[k, j]", {"A": (196, k), "B": (k, 64)})
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=16)).listing()
    unrolled = {int(n) for n in re.findall(r"i_1 in T.unroll\((\d+)\)", listing)}
    assert unrolled == {rows}


AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512"}  # 16 float32 lanes, 32 vector registers
AVX2 = {"kind": "llvm", "mcpu": "znver3"}  # 8 lanes, 16 registers


@pytest.mark.parametrize("rows, wide", [(32, True), (196, False)])
def test_avx512_offers_a_short_product_rows_of_six_vectors(rows, wide):
    """On AVX-512 a product whose rows tile no deeper than 8 in rows of two vectors (32 tokens:
    16 accumulators) is offered 4 rows of six (24), its summation in blocks (``wide_tile``, a
    schedule raced against the default's two); one whose rows tile 14 deep (196: 28
    accumulators) is not. AVX2 has no room for six. Both compute the product, and so does the
    six-wide tile forced on this CPU, whichever it is."""
    shapes = {"A": (rows, 256), "W": (256, 192)}
    expr = parse(f"L i:{rows}, j:192 ; S k:256 ; A[i, k] * W[k, j]", shapes)
    assert tile_vectors(expr, "float32", AVX512) == 2
    schedule = wide_tile(expr, "float32", AVX512)
    assert (schedule is not None) == wide
    if wide:
        assert tile_vectors(expr, "float32", AVX512, schedule) == 6
    assert wide_tile(expr, "float32", AVX2) is None and tile_vectors(expr, "float32", AVX2) < 6
    inputs = random_inputs(expr, 5)
    assert_matches(expr, inputs, dtype="float32")
    assert_matches(expr, inputs, dtype="float32", schedule=Schedule(tile=4, width=6, kblock=128))


def test_a_weight_given_in_panels_along_the_lanes_is_read_from_them():
    """B read as ``B[j, k]``, its first dimension along the lanes: the kernel takes B in panels
    of as many rows as the schedule says (``panel_layout``: 40 rows in panels of two vectors or
    one, the last zero past its end) and computes what the scope says; a read that may fall
    before B's start cannot be read from panels."""
    shapes = {"A": (5, 8), "B": (40, 8)}
    expr = parse("L i:5, j:40 ; S k:8 ; A[i, k] * B[j, k]", shapes)
    inputs = random_inputs(expr, 3)
    for width in (panel_width(), native_lanes()):
        kernel = compile_scope(expr, dtype="float32", schedule=Schedule(panels=(("B", 0, width),)))
        assert kernel.views[:2] == ((5, 8), (-(-40 // width), 8, width))
        out = aligned_empty((5, 40), "float32")
        kernel.run(
            {"A": aligned_copy(inputs["A"], "float32"), "B": panel_layout(inputs["B"], 0, "float32", width)}, out
        )
        np.testing.assert_allclose(out, evaluate(expr, inputs), rtol=1e-5, atol=1e-5)
    shifted = parse("L i:5, j:40 ; S k:8 ; A[i, k] * B[j-1, k]", shapes)  # (past the end: zeros in panels)
    with pytest.raises(CodegenError, match="panels"):
        compile_scope(shifted, dtype="float32", schedule=Schedule(panels=(("B", 0, 8),)))


def test_a_tile_prefetches_its_panels_ahead_only_where_it_stays_in_registers():
    """A product in panels with its bias and ReLU sums into a tile on the stack: its summation
    loop prefetches the vectors it reads from the panels ``Schedule.prefetch`` steps ahead, and
    computes what it did without them. The product alone sums into its output in place: there
    a prefetch would keep LLVM from holding the sums in registers, and none is made.
    (``prefetch=0``: none either way.)"""
    shapes = {"A": (16, 32), "W": (32, 64), "B": (64,)}
    fused = parse("L i:16, j:64 ; relu({L i:16, j:64 ; S k:32 ; A[i, k] * W[k, j]}[i, j] + B[j])", shapes)
    alone = parse("L i:16, j:64 ; S k:32 ; A[i, k] * W[k, j]", shapes)
    width = panel_width()
    inputs = random_inputs(fused, 4)
    given = {n: aligned_copy(v, "float32") for n, v in inputs.items()}
    given["W"] = panel_layout(inputs["W"], 1, "float32", width)
    target = host_target()
    for expr, prefetches in ((fused, True), (alone, False)):
        for steps in (16, 0):
            schedule = Schedule(panels=(("W", 1, width),), prefetch=steps)
            source = tvm_kernel._compile(expr, "float32", schedule, target).mod.inspect_source("ll")
            assert ("call void @llvm.prefetch" in source) == (prefetches and steps > 0)
            out = aligned_empty(expr.shape, "float32")
            compile_scope(expr, dtype="float32", schedule=schedule).run(given, out)
            np.testing.assert_allclose(out, evaluate(expr, inputs), rtol=1e-5, atol=1e-5)


def test_a_read_whose_bounds_tvm_multiplies_past_int32_compiles_with_int64_indices():
    """Found by the property test: B's last index steps by a million, its bounds a few elements
    wide; TVM's own arithmetic on the int32 guards overflowed while compiling."""
    expr = parse(
        "L i:-1..1, j:2, k:1 ; { L h:1, w:1, n:1 ; S c:1, r:1 ; A[h] }[1+i, 1+i, 1+i]"
        " * { L s:-1..1, f:1, x:1 ; B[1+s+f, s+1, 1000003+s*1000003+f] }[1+2*i-j, k-i-1, -1-i]",
        {"A": (1,), "B": (1, 1, 2)},
    )
    assert_matches(expr, random_inputs(expr, 0))


def test_a_reader_of_one_element_of_a_sum_stays_outside_its_tile_loop():
    """Found by the property test: every iteration reads the sums' first element, which no tile
    of the reader's own can be computed at (TVM refused with an internal error)."""
    expr = parse("L i:3 ; { L j:3 ; S k:2, h:2 ; A[j+k] }[0]", {"A": (1,)})
    for schedule in (Schedule(), Schedule(reduction_vector=True)):
        _scheduled(lower_to_te(expr, "float64", schedule.pad), schedule, host_target())
    assert_matches(expr, random_inputs(expr, 1))


def test_56_columns_widen_to_whole_vectors_and_their_epilogue_runs_at_the_tile():
    """A depthwise 3x3 over 56 columns (14-lane vectors before) with its bias: the sums are
    computed over 64 columns, four whole vectors, and the bias runs inside the sums' loop on a
    tile-sized local buffer, its guard skipping the 8 columns past the box."""
    text = (
        "L i0:1, i1:4, i2:6, i3:56 ; { L n:1, f:4, h:6, w:56 ; S r:3, s:3 ; X[n, f, h+r-1, w+s-1] * K[f, r, s] }"
        "[0, i1, i2, i3] + B[i1]"
    )
    expr = parse(text, {"X": (1, 4, 6, 56), "K": (4, 3, 3), "B": (4,)})
    listing = compile_scope(expr, dtype="float32", schedule=Schedule(vector=16)).listing()
    assert re.search(r"T\.sblock_alloc_buffer\(\([^)]*, 64\), scope=\"local\"\)", listing)
    assert_matches(expr, random_inputs(expr, 12), dtype="float32", schedule=Schedule(vector=16))


def test_a_padded_copy_read_through_a_division_compiles():
    """Segformer's depthwise convolution over merged channel-rows: inside the parallel loop the
    padded slice would vary in size, so the copy stays apart."""
    expr = parse(
        "L r:3, n:1, z:8960, w:14 ; S c:1, s:3 ; X[n, c+z/14, r+z%14-1, s+w-1] * W[z/14, c, r, s]",
        {"X": (1, 640, 14, 14), "W": (640, 1, 3, 3)},
    )
    assert_matches(expr, random_inputs(expr, 6), dtype="float32")


def test_max_reduction_sees_padding_zeros():
    expr = parse("L i:5 ; M k:3 ; A[i+k-1]", {"A": (5,)})
    out = compiled(expr, {"A": np.array([-5.0, -4.0, -3.0, -2.0, -1.0])})
    np.testing.assert_array_equal(out, [0, -3, -2, -1, 0])  # the ends see a padding 0


def test_max_reduction_over_a_product():
    expr = parse("L i:6, j:16 ; M k:16 ; A[i, k] * B[k, j]", {"A": (6, 16), "B": (16, 16)})
    assert_matches(expr, random_inputs(expr, 3))


def test_nested_scope_with_offset_box_and_outside_reads():
    expr = parse(
        "L c:6, r:5 ; S k0:7 ; { L c2:1..6, k2:-1..5 ; S k1:4 ; A[c2, k1] * B[k1, k2] }[c, k0-1] * C[k0, r]",
        {"A": (6, 4), "B": (4, 6), "C": (7, 5)},
    )
    assert_matches(expr, random_inputs(expr, 4))


def test_reindexing_scope_is_inlined_with_its_box():
    expr = parse("L i:9, j:4 ; { L a:2..7, b:4 ; A[b, a-2] }[j+3, i-1] + 1", {"A": (4, 5)})
    kernel = compile_scope(expr, dtype="float64")
    assert 'T.sblock("s' not in kernel.listing()  # no stage for the re-indexing scope
    inputs = random_inputs(expr, 5)
    np.testing.assert_allclose(kernel(**inputs), evaluate(expr, inputs), rtol=1e-12)


def test_equal_nested_scopes_share_a_stage():
    inner = "{ L x:4 ; S y:3 ; A[x+y] }"
    expr = parse(f"L i:4 ; {inner}[i] * {inner}[3-i]", {"A": (6,)})
    kernel = compile_scope(expr, dtype="float64")
    assert set(re.findall(r'T\.sblock\("(s\d+)', kernel.listing())) == {"s0"}
    inputs = random_inputs(expr, 6)
    np.testing.assert_allclose(kernel(**inputs), evaluate(expr, inputs), rtol=1e-12)


@pytest.mark.parametrize("order", ["division first", "sum first"])
def test_a_scope_that_several_scopes_read_is_one_stage_they_all_read(order):
    """Softmax: the exponentials are read by the division and by the sum (once per element
    each): one stage that both read, the exponential in the code once (the sum does not compose
    its own copy), whichever reader the lowering meets first."""
    ex = "{ L a:5, b:7 ; exp(X[a, b] - { L c:5 ; M d:7 ; X[c, d] }[a]) }"
    total = f"{{ L a:5 ; S r:7 ; {ex}[a, r] }}[i]"
    body = f"{ex}[i, j] / {total}" if order == "division first" else f"1 / {total} * {ex}[i, j]"
    expr = parse(f"L i:5, j:7 ; {body}", {"X": (5, 7)})
    kernel = compile_scope(expr, dtype="float32")
    assert kernel.listing().count("T.reinterpret") == 1  # the exponential's 2**n, once
    inputs = random_inputs(expr, 3)
    np.testing.assert_allclose(kernel(**inputs), evaluate(expr, inputs), rtol=1e-5)


def test_a_masked_softmax_is_exactly_zero_where_it_is_masked():
    """A causal mask adds float32's least value (-3.4e38) above the diagonal: exp there is 0, as
    the reference's, and no probability is subnormal (a later product's multiply-adds take
    subnormals as microcode assists); elsewhere the float32 exp is the reference's to 6e-7."""
    m = np.triu(np.full((8, 8), np.finfo(np.float32).min, np.float32), 1)
    ex = "{ L a:8, b:8 ; exp(X[a, b] + Z[a, b] - { L c:8 ; M d:8 ; X[c, d] + Z[c, d] }[a]) }"
    expr = parse(f"L i:8, j:8 ; {ex}[i, j] / {{ L a:8 ; S r:8 ; {ex}[a, r] }}[i]", {"X": (8, 8), "Z": (8, 8)})
    inputs = {"X": np.random.default_rng(0).uniform(-3, 3, (8, 8)).astype(np.float32), "Z": m}
    got = compile_scope(expr, dtype="float32")(**inputs)
    want = evaluate(expr, inputs)
    assert np.array_equal(got == 0, np.triu(np.ones((8, 8), bool), 1))
    assert not np.any((got != 0) & (np.abs(got) < np.finfo(np.float32).tiny))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    exps = np.linspace(-120, 88, 4096, dtype=np.float32)
    line = parse("L i:4096 ; exp(A[i])", {"A": (4096,)})
    got = compile_scope(line, dtype="float32")(A=exps)
    normal = np.exp(exps.astype(np.float64)) >= np.finfo(np.float32).tiny
    np.testing.assert_allclose(got[normal], np.exp(exps[normal].astype(np.float64)), rtol=6e-7)
    assert np.all(got[~normal] == 0)


def test_scalar_output_and_functions():
    expr = parse("L ; S i:5 ; sigmoid(A[i]) + exp(A[i]) / 2 - tanh(max(A[i], 0.5)) + sqrt(relu(A[i]))", {"A": (5,)})
    assert expr.shape == ()
    assert_matches(expr, random_inputs(expr, 7))


# --------------------------------------------------------------------------------------------
# (d) the on-disk cache


def test_second_compile_loads_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path))
    expr = SMALL_OPERATORS["conv3x3_nhwc"]
    inputs = random_inputs(expr, 8)
    first = compile_scope(expr)
    assert not first.from_cache and first.path.parent == tmp_path and first.path.suffix == ".so"

    def no_compiling(*args, **kwargs):
        raise AssertionError("a cached kernel was compiled again")

    monkeypatch.setattr(tvm, "compile", no_compiling)
    second = compile_scope(expr)
    assert second.from_cache and second.path == first.path
    np.testing.assert_array_equal(second(**inputs), first(**inputs))
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temporary files left
    with pytest.raises(AssertionError):
        compile_scope(expr, dtype="float64")  # another key: compiles


def test_a_kernel_equal_up_to_its_tensors_names_loads_the_same_machine_code(tmp_path, monkeypatch):
    """A model's layers differ in their weights' names only: one compile serves them all, each
    kernel taking its own tensors by position (here swapped: A's name read second)."""
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path))
    shapes = {"A": (8, 16), "B": (16, 32)}
    first = compile_scope(
        parse("L i:8, j:32 ; S k:16 ; A[i, k] * B[k, j]", shapes), schedule=Schedule(panels=(("B", 1, 8),))
    )

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(tvm, "compile", no_compiling)
    swapped = parse("L i:8, j:32 ; S k:16 ; B[i, k] * A[k, j]", {"B": (8, 16), "A": (16, 32)})
    second = compile_scope(swapped, schedule=Schedule(panels=(("A", 1, 8),)))
    assert second.path == first.path and second.from_cache and second.schedule.panels == (("A", 1, 8),)
    rng = np.random.default_rng(0)
    b, a = rng.uniform(-1, 1, (8, 16)), rng.uniform(-1, 1, (16, 32))
    out = aligned_empty((8, 32), "float32")
    second.run({"B": aligned_copy(b, "float32"), "A": panel_layout(a, 1, "float32", 8)}, out)
    np.testing.assert_allclose(out, b @ a, rtol=1e-5)
    assert first.renamed(swapped).schedule == second.schedule
    with pytest.raises(AssertionError):  # another shape: another kernel
        compile_scope(parse("L i:8, j:32 ; S k:16 ; A[i, k] * A[k + 8, j]", {"A": (24, 32)}))


def test_a_corrupt_cache_entry_is_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path))
    expr = SMALL_OPERATORS["matmul"]
    path = cache_path(expr, dtype="float64")
    path.write_bytes(b"not a shared library")
    kernel = compile_scope(expr, dtype="float64")
    assert not kernel.from_cache and kernel.path == path and path.stat().st_size > 1000
    inputs = random_inputs(expr, 9)
    np.testing.assert_allclose(kernel(**inputs), inputs["A"] @ inputs["B"], rtol=1e-12)


# --------------------------------------------------------------------------------------------
# (e) candidate schedules


@pytest.mark.parametrize("name", ["conv3x3_nhwc", "g2bmm_dilated", "convtranspose"])
def test_every_candidate_schedule_gives_the_same_result(name):
    expr = SMALL_OPERATORS[name]
    inputs = random_inputs(expr, 10)
    schedules = candidate_schedules(expr, limit=8)
    assert len(schedules) > 3 and schedules[0] == Schedule() and len(set(schedules)) == len(schedules)
    for schedule in schedules:
        assert_matches(expr, inputs, schedule=schedule)


# --------------------------------------------------------------------------------------------
# The kernel object


def test_run_writes_into_prepared_buffers_and_refuses_misaligned_ones():
    expr = SMALL_OPERATORS["matmul"]
    kernel = compile_scope(expr)
    assert isinstance(kernel, TvmKernel)
    assert kernel.inputs == {"A": (7, 12), "B": (12, 33)} and kernel.shape == (7, 33)
    inputs = random_inputs(expr, 11)
    args, out = kernel.prepare(**inputs)
    kernel.run(args, out)
    np.testing.assert_allclose(out.numpy(), inputs["A"] @ inputs["B"], rtol=1e-5, atol=1e-5)
    raw = np.zeros(7 * 33 + 1, dtype=np.float32)
    misaligned = raw[1:] if raw.ctypes.data % 64 == 0 else raw[:-1]
    if misaligned.ctypes.data % 64:
        with pytest.raises(ValueError, match="aligned"):
            kernel.run(args, misaligned.reshape(7, 33))


def test_compile_errors_name_the_scope(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(tvm, "compile", refuse)
    expr = parse("L i:3 ; A[i] * 2", {"A": (3,)})
    with pytest.raises(CodegenError, match=r"L i:3 ; A\[i\] \* 2"):
        compile_scope(expr, dtype="float64")


X16 = {"X": (16, 16)}


@pytest.mark.parametrize(
    "text, stages",
    [
        ("L i:16, j:16 ; 2 * { L a:16, b:16 ; exp(X[a, b]) }[i, j]", 1),  # composed: one loop nest
        ("L j:16, i:16 ; { L a:16, b:16 ; exp(X[a, b]) + 1 }[i, j]", 1),  # a transposed read too
        ("L i:16, j:16 ; { L a:16, b:16 ; exp(X[a, b]) }[i + 1, j]", 1),  # 0 past its last row
        ("L i:16, j:16 ; 2 * { L a:16, b:16 ; exp(X[a, b]) }[i, j] * { L a:16, b:16 ; exp(X[a, b]) }[i, j]", 2),
        ("L i:16 ; S j:16 ; { L a:16, b:16 ; exp(X[a, b]) }[i, j]", 1),  # summed, each element once
        ("L i:16, k:16 ; S j:16 ; { L a:16, b:16 ; exp(X[a, b]) }[i, j] * X[j, k]", 2),  # once per k: a stage
        ("L i:16, j:16 ; { L a:16 ; exp(X[a, a]) }[i]", 2),  # a broadcast would repeat the exp
        ("L i:16, j:16 ; { L a:16 ; S b:16 ; X[a, b] }[i] * X[i, j]", 2),  # a reduction stays a stage
    ],
)
def test_an_elementwise_scope_read_once_is_composed_into_its_reader(text, stages):
    """SOUFFLE's vertical transformation in the lowering: a nested scope that sums nothing and is
    read once, injectively over its reader's box, becomes part of its reader's loop nest;
    anything else stays a stage of its own (computed once). The values are the reference's
    either way."""
    expr = parse(text, X16)
    assert len([s for s in lower_to_te(expr, "float64", pad=False).stages if s.traversal]) == stages
    assert_matches(expr, random_inputs(expr, seed=0))


def test_a_comparison_of_a_composed_difference():
    """A 0/1 mask compared after composition (RoBERTa's position ids: ``1 - (ids == 1) >= 0``)
    compares an arithmetic expression, not a load."""
    expr = parse("L i:16 ; greater_equal({ L a:16 ; 1 - equal(X[a, a], 1) }[i], 0)", X16)
    assert_matches(expr, {"X": np.where(np.eye(16) > 0, 1.0, 0.5)})


PRODUCT = "{ L a:24, b:40 ; S k:16 ; A[a, k] * B[k, b] }"
EPILOGUES = [  # (scope, whether its element-wise stage runs inside the summing stage's tile loop)
    (f"L i:24, j:40 ; max({PRODUCT}[i, j] + C[j], 0)", True),  # a product's bias and activation
    ("L i:24, j:40 ; A[i, j] / { L a:24 ; S k:40 ; A2[a, k] }[i]", True),  # each row by its own sum
    (f"L i:23, j:40 ; {PRODUCT}[i+1, j] - {PRODUCT}[i, j]", False),  # neighbouring tiles' sums
    (f"L i:24, j:40 ; S k:2 ; {PRODUCT}[i, j] * C[k]", False),  # the reader sums itself
    (f"L i:26, j:40 ; S k:1 ; {PRODUCT}[i, j]", False),  # sums padded to more rows than they have
]


@pytest.mark.parametrize("text, at_tile", EPILOGUES)
def test_an_epilogue_runs_on_each_tile_of_the_sums_it_reads(text, at_tile):
    """The element-wise stage after a summing stage runs inside its tile loop, the sums in a
    tile-sized local buffer, where it reads each sum once at its own position; elsewhere the
    stages stay apart. Either way the kernel computes the scope."""
    shapes = {"A": (24, 16), "B": (16, 40), "C": (40,), "A2": (24, 40)}
    expr = parse(text, {n: s for n, s in shapes.items() if re.search(rf"\b{n}\[", text)})
    kernel = compile_scope(expr)
    assert ('scope="local"' in kernel.listing()) == at_tile
    values = random_inputs(expr, seed=3)
    np.testing.assert_allclose(kernel(**values), evaluate(expr, values), rtol=1e-4, atol=1e-4)


def test_a_tile_buffer_lives_on_the_stack_up_to_its_limit(monkeypatch):
    """The sums of a product's tile, read by its bias at the tile, are a stack buffer, not one
    asked of TVM's workspace pool per tile (TVM's own rule keeps only "global" buffers under 1
    KB on the stack); over ``_STACK_BYTES`` they come from the pool. The values are the
    reference's."""
    product = "{ L a:24, b:48 ; S k:16 ; A[a, k] * B[k, b] }"  # whole vectors: no padded copy
    expr = parse(f"L i:24, j:48 ; max({product}[i, j] + C[j], 0)", {"A": (24, 16), "B": (16, 48), "C": (48,)})
    values = random_inputs(expr, seed=4)
    inputs = [tvm.runtime.tensor(values[name].astype("float32")) for name in ("A", "B", "C")]

    def run(module):
        out = tvm.runtime.empty((24, 48), "float32")
        module["main"](*inputs, out)
        np.testing.assert_allclose(out.numpy(), evaluate(expr, values), rtol=1e-4, atol=1e-4)
        return "load ptr, ptr @__TVMBackendAllocWorkspace" in module.mod.inspect_source("ll")  # a call to it

    target = tvm_kernel.host_target()
    assert not run(tvm_kernel._compile(expr, "float32", Schedule(), target))
    monkeypatch.setattr(tvm_kernel, "_STACK_BYTES", 16)
    assert run(tvm_kernel._compile(expr, "float32", Schedule(), target))


def test_an_activation_reading_the_biased_sums_twice_runs_at_the_tile_too():
    """A GELU reads its biased sums twice (``x * erf(x)``), so the bias stays a stage of its
    own rather than composed into the activation's; both run inside the product's tile loop,
    each on a tile-sized local buffer, and no intermediate as large as the output is written."""
    biased = f"{{ L a:24, b:40 ; {PRODUCT}[a, b] + C[b] }}"
    expr = parse(
        f"L i:24, j:40 ; {biased}[i, j] * (erf({biased}[i, j] / 1.41) + 1)", {"A": (24, 16), "B": (16, 40), "C": (40,)}
    )
    kernel = compile_scope(expr)
    intermediates = [line for line in kernel.listing().splitlines() if "alloc_buffer((24" in line]
    assert len(intermediates) == 2 and all('scope="local"' in line for line in intermediates)
    values = random_inputs(expr, seed=3)
    np.testing.assert_allclose(kernel(**values), evaluate(expr, values), rtol=1e-4, atol=1e-4)


def test_a_windows_taps_along_the_tile_rows_go_outside_the_summation_where_they_would_spill():
    """A 3x3 convolution in panels, rows of its register tile along ``w``: with 14 rows of two
    vectors the tap ``s`` (read at ``w+s``) would be unrolled innermost beside 28 accumulators
    and 16 broadcasts, more than the registers, so the summation runs ``s, c, r``; with 4 rows
    they fit and the scope's order ``c, r, s`` stays. Both compute the reference's values."""
    lanes = 2 * native_lanes()
    expr = parse(
        f"L j:2, h:28, w:28, l:{lanes} ; S c:8, r:3, s:3 ; X[c, h+r-1, w+s-1] * P[j, c, r, s, l]",
        {"X": (8, 28, 28), "P": (2, 8, 3, 3, lanes)},
    )
    values = random_inputs(expr, seed=5)
    for rows, order in ((14, "s, c, r"), (4, "c, r, s")):
        kernel = compile_scope(expr, schedule=Schedule(tile=rows, width=2))
        loops = [loop for line in kernel.listing().splitlines() for loop in re.findall(r"for ([\w, ]+) in", line)]
        assert order in loops and not {"c, r, s", "s, c, r"} - {order} & set(loops)
        np.testing.assert_allclose(kernel(**values), evaluate(expr, values), rtol=1e-4, atol=1e-4)
