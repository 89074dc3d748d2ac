"""Opaque definitions (``rewriter.ir.Opaque``): a gather by indices known only at run time, as the
notation prints and parses it, as the reference semantics and compiled programs compute it, left
alone by the program-level rules, and run in an optimized program that is saved and loaded."""

import numpy as np
import pytest

from rewriter import evaluate, parse_program
from rewriter.ir import OPAQUE_OPS, ExpressionError, Opaque, Program, Tensor, rename_tensors
from rewriter.pipeline import load_optimized, optimize_program
from rewriter.search import registered
from rewriter.semantics import OPAQUE, sample_inputs

SHAPES = {"W": (10, 4), "ids": (2, 3), "B": (4, 5)}
TEXT = """E = gather(W, ids; axis=0)
F = L i:2, j:3, l:5 ; S k:4 ; E[i, j, k] * B[k, l]
G = L i:2, j:3, l:5 ; tanh(F[i, j, l])
return G"""


def program() -> Program:
    return parse_program(TEXT, SHAPES)


def test_prints_in_the_notation_and_parses_back():
    parsed = program()
    assert str(parsed) == TEXT
    assert parse_program(str(parsed), SHAPES) == parsed
    gather = dict(parsed.definitions)["E"]
    assert isinstance(gather, Opaque) and gather.shape == (2, 3, 4)


def test_a_negative_axis_counts_from_the_end_and_errors_name_the_problem():
    W, ids = Tensor("W", (10, 4)), Tensor("ids", (2, 3))
    assert str(Opaque("gather", (W, ids), (("axis", -1),))) == "gather(W, ids; axis=1)"
    with pytest.raises(ExpressionError, match="axis 2 is out of range for W of rank 2"):
        Opaque("gather", (W, ids), (("axis", 2),))
    with pytest.raises(ExpressionError, match="gather takes 2 tensors"):
        Opaque("gather", (W,), (("axis", 0),))
    with pytest.raises(ExpressionError, match="unknown opaque operation 'scatter'"):
        Opaque("scatter", (W, ids), ())
    with pytest.raises(ExpressionError, match="line 1, column 5: gather takes the attributes axis, got dim"):
        parse_program("E = gather(W, ids; dim=0)", SHAPES)


def test_renaming_renames_its_inputs():
    gather = dict(program().definitions)["E"]
    assert str(rename_tensors(gather, {"W": "V", "ids": "W"})) == "gather(V, W; axis=0)"


def test_evaluates_as_numpy_take_and_refuses_indices_out_of_range():
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((10, 4)), rng.standard_normal((4, 5))
    ids = np.array([[0, 9, -1], [3, 3, 5]])
    want = np.tanh(np.take(w, ids % 10, axis=0) @ b)
    np.testing.assert_allclose(evaluate(program(), {"W": w, "ids": ids, "B": b}), want, rtol=1e-12)
    with pytest.raises(ExpressionError, match="index 10 in ids is out of range for axis 0 of W"):
        evaluate(program(), {"W": w, "ids": ids + 1, "B": b})
    with pytest.raises(ExpressionError, match="indices ids hold a value that is not an integer"):
        evaluate(program(), {"W": w, "ids": ids + 0.5, "B": b})


def test_program_rules_neither_fuse_into_nor_out_of_it():
    """Expression fusion inlines the matmul into the tanh (its only reader), never the gather
    into the matmul."""
    variants = [v for r in registered("inter") for v in r.apply(program())]
    assert variants  # the tanh's producer fuses into it
    for variant in variants:
        assert isinstance(dict(variant.definitions)["E"], Opaque)


def test_sample_inputs_give_valid_indices_through_other_definitions():
    through_view = parse_program(
        "V = L a:6 ; ids[a / 3, a % 3]\nE = gather(W, V; axis=0)\nreturn E", {"W": (10, 4), "ids": (2, 3)}
    )
    values = sample_inputs(through_view.definitions, {"ids": (2, 3), "W": (10, 4)}, seed=1)
    assert values["ids"].dtype == np.float32 and set(np.unique(values["ids"])) <= set(range(10))
    assert not np.array_equal(values["W"], np.round(values["W"]))  # data stays continuous
    evaluate(through_view, values)  # in range: no error


def test_an_optimized_program_runs_it_as_a_library_step_and_reloads(tmp_path):
    rng = np.random.default_rng(1)
    weights = {
        "W": rng.standard_normal((10, 4)).astype(np.float32),
        "B": rng.standard_normal((4, 5)).astype(np.float32),
    }
    optimized = optimize_program(program(), weights, max_depth=1, subprogram_time_limit=10)
    assert [(s.name, s.state, s.kernels) for s in optimized.subprograms][0] == ("E", "opaque", ("opaque",))
    ids = np.array([[1, 2, 3], [9, 0, -1]])
    want = evaluate(program(), {**weights, "ids": ids})
    np.testing.assert_allclose(optimized(ids=ids), want, rtol=1e-5, atol=1e-6)
    optimized.save(tmp_path / "saved")
    np.testing.assert_allclose(load_optimized(tmp_path / "saved")(ids=ids), want, rtol=1e-5, atol=1e-6)


def test_gather_elements_reads_along_its_axis_at_the_indices_own_positions():
    gather = parse_program("Y = gather_elements(X, I; axis=1)\nreturn Y", {"X": (3, 5), "I": (2, 4)})
    x, i = np.arange(15.0).reshape(3, 5), np.array([[0, 4, -1, 2], [1, 1, 3, 0]])
    np.testing.assert_array_equal(evaluate(gather, {"X": x, "I": i}), np.take_along_axis(x[:2], i % 5, axis=1))
    with pytest.raises(ExpressionError, match="gather_elements: index 5 in I is out of range for axis 1 of X"):
        evaluate(gather, {"X": x, "I": i + 1})
    with pytest.raises(ExpressionError, match="indices I must have the rank of X"):
        parse_program("Y = gather_elements(X, I; axis=0)", {"X": (3, 5), "I": (4,)})
    assert np.all(sample_inputs(gather.definitions, {"I": (2, 4)})["I"] < 5)


def test_every_opaque_operation_has_a_numpy_function():
    assert set(OPAQUE) == set(OPAQUE_OPS)
