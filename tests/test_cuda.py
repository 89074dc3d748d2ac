"""The cuda backend: cuBLAS call specifications, CUDA generation, bundles, the two-machine
workflow. The specification, generation and bundle tests run everywhere (cuBLAS's arithmetic is
emulated with numpy); those marked ``gpu`` run the bundles on an NVIDIA GPU with CuPy."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bundle.format import BundleError, GemmCall, check_inputs, read
from bundle.gemm import emulate, gemm_call
from bundle.nvrtc import self_contained
from codegen.cuda import CudaBackend, to_bundle
from codegen.cuda_kernel import cuda_kernel
from codegen.tvm_kernel import PAD_EVERY, lower_to_te, tvm
from rewriter import derive, evaluate, parse
from rewriter.lower.operators import Operand

MATMUL_T = ("L i:12, j:10 ; S k:8 ; A[k, i] * B[j, k]", {"A": (8, 12), "B": (10, 8)})
CHAIN = (
    "L c:6, r:5 ; S k0:7 ; { L c2:6, k2:7 ; S k1:4 ; A[c2, k1] * B[k1, k2] }[c, k0] * C[k0, r]",
    {"A": (6, 4), "B": (4, 7), "C": (7, 5)},
)


@st.composite
def strided_operands(draw, shape, name, broadcast=True):
    """A [batch, rows, cols] view of a buffer: the dimensions laid out in any order, from an
    offset, the batch maybe broadcast (stride 0)."""
    order = draw(st.permutations(range(3)))
    strides, step = [0, 0, 0], 1
    for axis in reversed(order):
        strides[axis], step = step, step * shape[axis]
    if broadcast and shape[0] > 1 and draw(st.booleans()):
        strides[0] = 0
    return Operand(name, draw(st.integers(0, 3)), shape, tuple(strides))


def view(flat, operand):
    return np.lib.stride_tricks.as_strided(
        flat[operand.offset :], operand.shape, tuple(s * flat.itemsize for s in operand.strides)
    )


@given(st.tuples(*[st.integers(1, 4)] * 4), st.data())
def test_a_cublas_call_computes_the_strided_product_or_declines(dims, data):
    batch, m, k, n = dims
    a = data.draw(strided_operands((batch, m, k), "A"))
    b = data.draw(strided_operands((batch, k, n), "B"))
    out = data.draw(strided_operands((batch, m, n), "C", broadcast=False))
    out = Operand("C", 0, out.shape, out.strides)
    call = gemm_call("C", a, b, out.strides)
    fits = [
        min(abs(s) for s, d in zip(op.strides[1:], op.shape[1:]) if d > 1) == 1
        for op in (a, b, out)
        if max(op.shape[1:]) > 1
    ]
    if call is None:  # declined only where an operand has no unit stride across its matrix
        assert not all(fits)
        return
    rng = np.random.default_rng(0)
    buffers = {
        "A": rng.standard_normal(a.offset + batch * m * k + 3),
        "B": rng.standard_normal(b.offset + batch * k * n + 3),
        "C": np.zeros(batch * m * n),
    }
    emulate(call, buffers)
    np.testing.assert_allclose(view(buffers["C"], out), view(buffers["A"], a) @ view(buffers["B"], b), rtol=1e-12)


def test_cublas_reads_row_major_operands_in_place_transposing_as_needed():
    # C = A @ B, all row-major: C^T = B^T A^T column-major, no transposes, leading dimensions = row lengths
    call = gemm_call("C", Operand("A", 0, (1, 12, 8), (0, 8, 1)), Operand("B", 0, (1, 8, 10), (0, 10, 1)), (0, 10, 1))
    assert (call.m, call.n, call.k, call.a, call.b, call.transa, call.transb) == (10, 12, 8, "B", "A", False, False)
    assert (call.lda, call.ldb, call.ldc) == (10, 8, 10)
    # A read transposed (A[k, i]): its column-major storage is op(A) = T
    call = gemm_call("C", Operand("A", 0, (1, 12, 8), (0, 1, 12)), Operand("B", 0, (1, 8, 10), (0, 10, 1)), (0, 10, 1))
    assert (call.b, call.transb, call.ldb) == ("A", True, 12)
    # no unit stride across A's matrix: cuBLAS cannot read it in place
    assert (
        gemm_call("C", Operand("A", 0, (1, 12, 8), (0, 16, 2)), Operand("B", 0, (1, 8, 10), (0, 10, 1)), (0, 10, 1))
        is None
    )


def test_a_nested_scope_becomes_two_launches_and_a_temporary():
    expr = parse(*CHAIN)
    step, source, temporaries = cuda_kernel(expr, "Y")
    assert temporaries == {"Y.s0": (6 * 7,)}
    assert len(step.launches) == 2 and step.source == "Y.cu"
    known = {"A", "B", "C", "Y", *temporaries}
    for launch in step.launches:
        assert 'extern "C" __global__ void __launch_bounds__' in source and f" {launch.function}(" in source
        assert set(launch.args) <= known and np.prod(launch.block) <= 1024
    assert step.launches[0].args[-1] == "Y.s0" and "Y" in step.launches[1].args  # the nested scope first


PADDED = (  # zero-padded reads: a transposed convolution's weights, a convolution's input, a nested scope's
    ("L n:2, h:4, w:4, f:8 ; S x:2, y:2, c:4 ; A[n, x, y, c] * K[h+1-2*x, w+1-2*y, f, c]", {"A": (2, 2, 2, 4), "K": (4, 4, 8, 4)}),
    ("L n:1, f:3, h:6, w:6 ; S c:2, r:5, s:5 ; A[n, c, h+r-2, w+s-2] * K[f, c, r, s]", {"A": (1, 2, 6, 6), "K": (3, 2, 5, 5)}),
    ("L i:6, j:5 ; S k:4 ; { L a:5, b:4 ; A[a, b] + 1 }[i-1, k] * B[k, j]", {"A": (5, 4), "B": (4, 5)}),
)  # fmt: skip


@pytest.mark.parametrize("text, shapes", PADDED)
def test_for_the_gpu_schedules_no_guard_sits_inside_a_summing_stage(text, shapes):
    """dlight re-indexes a summing stage's reads and loses a guard written inside it (the read
    then faults on the GPU): there every zero-padded read is a padding stage it can inline, and
    the kernel still computes the expression (run here on the CPU, plain loops)."""
    expr = parse(text, shapes)
    guarded = lower_to_te(expr, "float32", pad=False)
    assert "if_then_else" in str(guarded.output.op.body)  # the case this is about
    lowering = lower_to_te(expr, "float32", pad=PAD_EVERY)
    summing = [t for t in _stages(lowering.output) if getattr(t.op, "reduce_axis", None)]
    assert summing and not any("if_then_else" in str(t.op.body) for t in summing)
    function = tvm.te.create_prim_func([*lowering.inputs.values(), lowering.output])
    library = tvm.compile(tvm.IRModule({"main": function}), target="llvm")
    rng = np.random.default_rng(0)
    values = {n: rng.uniform(-1, 1, s).astype(np.float32) for n, s in shapes.items()}
    out = tvm.runtime.empty(expr.shape, "float32")
    library["main"](*(tvm.runtime.tensor(values[n]) for n in lowering.inputs), out)
    np.testing.assert_allclose(out.numpy(), evaluate(expr, values), rtol=1e-5, atol=1e-5)


def _stages(tensor):
    """``tensor`` and every compute stage it reads, transitively."""
    seen, todo = [], [tensor]
    while todo:
        t = todo.pop()
        if t.op.name not in {s.op.name for s in seen} and hasattr(t.op, "body"):
            seen.append(t)
            todo.extend(t.op.input_tensors)
    return seen


def test_dlight_schedules_a_convolution_as_a_tiled_gemm():
    expr = parse(
        "L n:1, h:7, w:7, f:32 ; S c:16, r:3, s:3 ; A[n, h+r-1, w+s-1, c] * K[r, s, f, c]",
        {"A": (1, 7, 7, 16), "K": (3, 3, 32, 16)},
    )
    step, source, _ = cuda_kernel(expr, "Y")
    assert "__shared__" in source and len(step.launches) == 1  # tiled through shared memory, not a thread per output


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA compiler (nvcc) to compile the sources")
def test_generated_sources_compile_as_the_runtime_hands_them_to_nvrtc(tmp_path):
    convolution = parse(
        "L n:1, f:8, h:6, w:6 ; S c:4, r:3, s:3 ; A[n, c, h+r-1, w+s-1] * K[f, c, r, s]",
        {"A": (1, 4, 6, 6), "K": (8, 4, 3, 3)},
    )
    for k, expr in enumerate((parse(*CHAIN), convolution)):
        _, source, _ = cuda_kernel(expr, "Y")
        path = tmp_path / f"k{k}.cu"
        path.write_text(self_contained(source))
        assert "cuda/std" not in path.read_text()  # no header NVRTC might not find
        done = subprocess.run(
            ["nvcc", "-ptx", "-arch=compute_80", "--std=c++17", str(path), "-o", str(path.with_suffix(".ptx"))],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr


def test_a_bundle_round_trips_and_refuses_edits(tmp_path):
    expr = parse(*MATMUL_T)
    candidate = derive(expr, max_depth=1, backend="reference").best
    bundle = to_bundle(candidate, {"A": (8, 12), "B": (10, 8)})
    assert [type(s) for s in bundle.steps] == [GemmCall]
    inputs = check_inputs(bundle.inputs, bundle.check_seed, "float64")
    np.testing.assert_allclose(
        bundle.check["expected"], evaluate(expr, inputs).reshape(-1)[bundle.check["index"]], rtol=1e-5
    )
    path = bundle.write(tmp_path / "b")
    again = read(path)
    assert again.key == bundle.key and again.steps == bundle.steps and again.check_seed == bundle.check_seed
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # written through a temporary directory, renamed
    plan = json.loads((path / "bundle.json").read_text())
    plan["steps"][0]["lda"] += 1
    (path / "bundle.json").write_text(json.dumps(plan))
    with pytest.raises(BundleError, match="do not match the key"):
        read(path)
    with pytest.raises(BundleError, match="not a bundle"):
        read(tmp_path / "missing")


def test_derive_on_the_cuda_backend_writes_every_candidate_checked_on_cpu(tmp_path):
    expr = parse(*CHAIN)
    derivation = derive(expr, max_depth=2, backend=CudaBackend(bundles=tmp_path))
    keys = {p.bundle.key for p in derivation.candidates}
    assert keys == {p.name for p in tmp_path.iterdir()} and len(keys) >= 2
    kinds = {tuple(type(s).__name__ for s in p.bundle.steps) for p in derivation.candidates}
    assert ("GemmCall", "GemmCall") in kinds  # both matmuls as cuBLAS calls
    inputs = {n: np.random.default_rng(1).uniform(-1, 1, s) for n, s in CHAIN[1].items()}
    for program in derivation.candidates:  # cuBLAS emulated, generated kernels by the reference semantics
        np.testing.assert_allclose(program(**inputs), evaluate(expr, inputs), rtol=1e-4, atol=1e-5)


def test_gpu_timings_choose_the_program_and_unmeasured_ones_are_never_chosen(tmp_path):
    expr = parse(*CHAIN)
    prepared = derive(expr, max_depth=2, backend=CudaBackend(bundles=tmp_path / "bundles")).candidates
    slowest, fastest = prepared[0], prepared[-1]
    timings = {
        "device": "Test GPU",
        "bundles": {
            slowest.bundle.key: {"verified": True, "steps": [1e-3] * len(slowest.bundle.steps), "graph": 2e-3},
            fastest.bundle.key: {"verified": True, "steps": [1e-6] * len(fastest.bundle.steps), "graph": 5e-6},
        },
    }
    (tmp_path / "t.json").write_text(json.dumps(timings))
    backend = CudaBackend(timings=tmp_path / "t.json")
    chosen = derive(expr, max_depth=2, backend=backend)
    assert backend.device() == "Test GPU" and backend.measures
    assert chosen.best.bundle.key == fastest.bundle.key and chosen.best.cost == 5e-6
    assert [p.cost for p in chosen.candidates[:2]] == [5e-6, 2e-3]
    assert all(p.cost == float("inf") for p in chosen.candidates[2:])  # not measured on the GPU: never chosen


def test_bound_weights_travel_as_constants_and_weight_only_kernels_run_once(tmp_path):
    expr = parse(*CHAIN)  # (A @ B) @ C with A and B weights: A @ B reads weights only
    program = derive(expr, max_depth=2, weights=("A", "B"), backend=CudaBackend()).candidates
    program = next(p for p in program if len(p.bundle.steps) == 2)
    rng = np.random.default_rng(2)
    values = {n: rng.uniform(-1, 1, s) for n, s in CHAIN[1].items()}
    bound = program.bind({"A": values["A"], "B": values["B"]})
    assert bound.bundle.inputs == {"C": (7, 5)} and set(bound.bundle.constants) == {"A", "B"}
    assert [step.once for step in bound.bundle.steps] == [True, False]
    np.testing.assert_allclose(bound(C=values["C"]), evaluate(expr, values), rtol=1e-4, atol=1e-5)
    again = read(bound.save(tmp_path / "bound"))
    np.testing.assert_array_equal(again.constants["A"], values["A"].astype(np.float32))
    expected = evaluate(expr, {**values, "C": check_inputs(again.inputs, again.check_seed, "float64")["C"]})
    np.testing.assert_allclose(
        again.check["expected"], expected.reshape(-1)[again.check["index"]], rtol=1e-4, atol=1e-5
    )


def test_the_runtime_without_cupy_says_what_it_needs(tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    done = subprocess.run(
        [sys.executable, "-m", "bundle", "measure", str(tmp_path), "--out", str(tmp_path / "t.json")],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 2 and "needs" not in done.stdout and "with CuPy" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "t.json").exists()


# --------------------------------------------------------------------------------------------
# On the GPU (CuPy and an NVIDIA device)


@pytest.mark.gpu
def test_bundles_run_verified_on_the_gpu_as_one_graph_and_kernel_by_kernel(tmp_path):
    from bundle import cuda as gpu

    for text, shapes in (CHAIN, MATMUL_T):
        expr = parse(text, shapes)
        derive(expr, max_depth=2, backend=CudaBackend(bundles=tmp_path / "b"))
    measured = gpu.measure_directory(tmp_path / "b", repeats=3)
    assert measured["bundles"] and all(r["verified"] for r in measured["bundles"].values()), measured
    for path in (tmp_path / "b").iterdir():
        program = gpu.CudaProgram(read(path))
        inputs = check_inputs(program.bundle.inputs, 7, "float32")
        np.testing.assert_array_equal(program.run(inputs, graph=True), program.run(inputs, graph=False))
