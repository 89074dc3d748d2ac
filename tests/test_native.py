"""A program's compiled kernels run as one native call (codegen.native, ``_Dispatch``)."""

import numpy as np
import pytest

from codegen.native import NativeRun, driver
from codegen.program import CompiledProgram, _step
from codegen.tvm_kernel import CodegenError, address, aligned_copy, aligned_empty, bindable
from rewriter import matmul, parse
from rewriter.lower import Kernel, instantiate, postprocess

pytestmark = pytest.mark.usefixtures("module_cache")  # kernels and timings in a fresh cache

SHAPES = {"X": (8, 16), "W": (16, 32)}


def _program(product: str) -> CompiledProgram:
    """relu(X) @ W + 1 with the product by ``product``, W bound as a weight."""
    relu = Kernel("eop", "T0", parse("L i:8, k:16 ; max(X[i, k], 0)", SHAPES))
    (gemm,) = postprocess(instantiate(matmul((8, 16), (16, 32))), weights=("B",)).kernels
    gemm = gemm.renamed({"A": "T0", "B": "W", "out": "T1"})
    bias = Kernel("eop", "out", parse("L i:8, j:32 ; T1[i, j] + 1", {"T1": (8, 32)}))
    steps = [_step(relu, "tvm", "float32"), _step(gemm, product, "float32"), _step(bias, "tvm", "float32")]
    return CompiledProgram(steps, dict(SHAPES))


def _kernel_by_kernel(program: CompiledProgram, inputs: dict) -> np.ndarray:
    """Each step's call from Python, in turn, on arrays of its own (aligned, as the calls assume)."""
    values = {**program.constants, **program.prepared, **{n: aligned_copy(v, program.dtype) for n, v in inputs.items()}}
    for step in program.steps:
        out = aligned_empty(step.kernel.expr.shape, program.dtype)
        step.call(values, out)
        values[step.kernel.output] = out
    return values[program.output]


@pytest.mark.parametrize("product, runs", [("packed", ["native"]), ("blas", ["native", "python", "native"])])
def test_compiled_kernels_run_as_one_native_call_with_the_outputs_of_the_kernels_called_in_turn(product, runs):
    """Consecutive compiled kernels (TVM's, a packed product over its bound weight) are one
    native call; a library call through numpy runs from Python between two of them. The outputs
    are those of the same kernels called one by one from Python, bit for bit, run after run."""
    rng = np.random.default_rng(0)
    w = rng.uniform(-1, 1, SHAPES["W"]).astype(np.float32)
    program = _program(product).bind({"W": w})
    for _ in range(3):
        x = rng.uniform(-1, 1, SHAPES["X"]).astype(np.float32)
        got = program(X=x)
        np.testing.assert_array_equal(got, _kernel_by_kernel(program, {"X": x}))
        np.testing.assert_allclose(got, np.maximum(x, 0) @ w + 1, rtol=1e-5, atol=1e-5)
    (dispatch,) = program._dispatches.values()
    assert ["native" if isinstance(c, NativeRun) else "python" for c in dispatch.calls] == runs
    assert sum(len(n.labels) for n in dispatch.natives) == (3 if product == "packed" else 2)


def test_a_kernel_that_fails_in_a_native_run_is_named_with_tvms_message():
    program = _program("packed").bind({"W": np.ones(SHAPES["W"], np.float32)})
    program(X=np.ones(SHAPES["X"], np.float32))
    (dispatch,) = program._dispatches.values()
    (native,) = dispatch.natives
    native.slots["X"][0].ndim = 3  # the first kernel now gets X as a tensor of the wrong rank
    with pytest.raises(CodegenError, match=r"kernel .*max\(X\[.*failed: .*ndim"):
        program(X=np.ones(SHAPES["X"], np.float32))


def test_without_a_c_compiler_the_kernels_are_called_from_python(monkeypatch):
    monkeypatch.setattr("codegen.program.driver", lambda: None)  # what driver() gives where cc fails
    w = np.ones(SHAPES["W"], np.float32)
    program = _program("packed").bind({"W": w})
    x = np.arange(128, dtype=np.float32).reshape(SHAPES["X"]) / 128
    np.testing.assert_allclose(program(X=x), np.maximum(x, 0) @ w + 1, rtol=1e-5)
    (dispatch,) = program._dispatches.values()
    assert not dispatch.natives and len(dispatch.calls) == 3


def test_a_run_loop_that_does_not_compile_is_a_warning_not_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path))
    driver.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="compiled kernels run from Python.*did not compile"):
            assert driver() is None
        assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.c"))  # nothing half-written
    finally:
        driver.cache_clear()


def test_addresses_come_through_the_buffer_protocol_and_bindable_arrays_need_no_copy():
    """``address`` is numpy's own for every array; ``bindable`` holds only for one a kernel
    takes as it is: writable, C-contiguous, aligned to 64 bytes."""
    aligned = aligned_empty((4, 16), "float32")
    arrays = {
        "aligned": aligned,
        "offset by a float": aligned.reshape(-1)[1:17],
        "transposed": aligned.T,
        "read-only": np.broadcast_to(aligned[0], (4, 16)),
        "empty": aligned[:0],
    }
    for array in arrays.values():
        assert address(array) == array.ctypes.data
    assert [name for name, array in arrays.items() if bindable(array)] == ["aligned"]
