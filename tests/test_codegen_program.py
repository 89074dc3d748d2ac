"""Compiled programs (codegen.program): derive's cpu backend, measured extraction, save and load."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings

from codegen.measure import MeasurementDB
from codegen.program import compile_candidate, load
from rewriter import derive, evaluate, matmul
from rewriter.cases import CASES
from rewriter.instantiate import instantiate, postprocess
from rewriter.testing import random_inputs
from strategies import expressions


@pytest.fixture(autouse=True, scope="module")
def _cache(tmp_path_factory):
    """Kernels and measurements of this module in a fresh cache (shared by its tests)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("REWRITER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def _close(got, want, tolerance=1e-3):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * scale)


def test_conv3x3_derives_to_a_compiled_measured_verified_program():
    expr = CASES["conv3x3"].expression()
    derivation = derive(expr, max_depth=3)
    best = derivation.best
    assert derivation.rejected == []
    assert all(p.cost > 0 for p in derivation.candidates)
    assert [p.cost for p in derivation.candidates] == sorted(p.cost for p in derivation.candidates)
    kinds = [[k.kind for k in p.kernels] for p in derivation.candidates]
    assert ["matmul", "eop"] in kinds and ["eop"] in kinds  # Figure 3b and the identity both raced
    inputs = random_inputs(expr, 1)
    _close(best(**inputs), evaluate(expr, inputs))
    assert len(best.listing().splitlines()) == len(best.kernels)


@settings(max_examples=8, deadline=None)
@given(expressions(max_traversal=2, max_summation=1))
def test_extraction_never_returns_a_program_slower_than_the_identity(expr):
    derivation = derive(expr, max_depth=1, keep=3)
    identity = next(p for p in derivation.candidates if [k.kind for k in p.kernels] == ["eop"] and p.source is None)
    assert derivation.best.cost <= identity.cost
    assert derivation.rejected == []
    inputs = random_inputs(expr, 2)
    _close(derivation.best(**inputs), evaluate(expr, inputs))


def test_matmul_reads_strided_operands_in_place_through_blas():
    expr = matmul((6, 5), (5, 4))
    program = compile_candidate(instantiate(expr), {"A": (6, 5), "B": (5, 4)})
    assert [s.impl for s in program.steps] == ["blas"]
    inputs = random_inputs(expr, 3)
    _close(program(**inputs), inputs["A"] @ inputs["B"], 1e-5)


def test_weight_only_kernels_run_once_when_bound():
    expr = CASES["conv3x3"].expression()
    derivation = derive(expr, max_depth=3, backend="reference", weights=("K",))
    relaid = next(c for c in derivation.candidates if any(k.weight_only for k in c.kernels))
    inputs = random_inputs(expr, 4)
    program = compile_candidate(relaid, {n: v.shape for n, v in inputs.items()}).bind({"K": inputs["K"]})
    assert {k.output for k in program.kernels if k.weight_only} | {"K"} == set(program.constants)
    _close(program(A=inputs["A"]), evaluate(expr, inputs))


def test_saved_programs_run_in_a_new_process_without_searching(tmp_path):
    expr = CASES["convtranspose"].expression()
    candidate = postprocess(instantiate(expr))
    inputs = random_inputs(expr, 5)
    program = compile_candidate(candidate, {n: v.shape for n, v in inputs.items()})
    program.measure(MeasurementDB(tmp_path / "m.sqlite"), max_seconds=0.2)
    program.save(tmp_path / "prog")
    np.savez(tmp_path / "inputs.npz", **inputs)
    script = (
        "import numpy as np, sys; from codegen.program import load;"
        f"p = load({str(tmp_path / 'prog')!r}); x = dict(np.load({str(tmp_path / 'inputs.npz')!r}));"
        f"np.save({str(tmp_path / 'out.npy')!r}, p(**x)); print(p.listing())"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(tmp_path.parent), env=_env())
    assert done.returncode == 0, done.stderr
    _close(np.load(tmp_path / "out.npy"), evaluate(expr, inputs))
    assert load(tmp_path / "prog").kernels == program.kernels


def test_loading_something_that_is_not_a_program_is_a_clear_error(tmp_path):
    from rewriter import ExpressionError

    with pytest.raises(ExpressionError, match="not a saved program"):
        load(tmp_path)


def _env():
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_tuning_races_schedules_and_keeps_a_correct_one():
    from codegen import candidate_schedules

    expr = CASES["conv3x3"].expression()
    eop = postprocess(instantiate(expr))  # conv2d: TVM schedules and numpy's contraction race
    inputs = random_inputs(expr, 8)
    program = compile_candidate(eop, {n: v.shape for n, v in inputs.items()}, tune=3)
    step = program.steps[0]
    assert step.impl == "numpy" or step.compiled.schedule in candidate_schedules(expr, 3)
    _close(program(**inputs), evaluate(expr, inputs))


@pytest.mark.parametrize("fused_seconds, kernels", [(1e-9, 1), (1.0, 2)])
def test_eoperator_fusion_is_kept_only_where_it_measures_faster(tmp_path, fused_seconds, kernels):
    """The fused kernel's stored timing decides: far faster than the two apart, they fuse; far
    slower, the program keeps both kernels. Either way it computes the same values."""
    from codegen.measure import Timing
    from codegen.program import _step
    from rewriter import parse
    from rewriter.instantiate import Candidate, Kernel, fuse

    shapes = {"A": (64, 48)}
    scale = Kernel("eop", "T0", parse("L i:64, j:48 ; 2 * A[i, j]", shapes))
    shift = Kernel("eop", "out", parse("L j:48, i:64 ; T0[i, j] + 1", {"T0": (64, 48)}))
    candidate = postprocess(Candidate([scale, shift]))
    assert len(candidate.kernels) == 1 and len(candidate.unfused) == 2
    db = MeasurementDB(tmp_path / "m.sqlite")
    for kernel, seconds in ((scale, 1e-3), (shift, 1e-3), (fuse(scale, shift), fused_seconds)):
        db.put(_step(kernel, "tvm", "float32").signature("float32"), Timing(seconds, 0.0, 1, False))
    program = compile_candidate(candidate, shapes, db=db)
    assert len(program.kernels) == kernels
    a = np.random.default_rng(0).uniform(-1, 1, (64, 48))
    _close(program(A=a), (2 * a + 1).T)
