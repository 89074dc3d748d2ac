"""Run a bundle on an NVIDIA GPU with CuPy alone: NVRTC for the generated kernels, cuBLAS for
the GEMM calls, the whole program replayed as one CUDA graph (MonoNN: no per-kernel launch
overhead) or kernel by kernel (for timing each step and for debugging).

    program = CudaProgram(read("bundle-dir"))
    y = program(x=x_host)                   # numpy in, numpy out (one graph launch)
    record = measure(program)               # verified on the bundle's check data, then timed
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Mapping

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from .format import Bundle, BundleError, CudaLaunches, GemmCall, check_inputs, read
from .nvrtc import OPTIONS, self_contained

_CUDA_R = {"float32": 0, "float64": 1}  # cudaDataType: CUDA_R_32F, CUDA_R_64F
_COMPUTE = {"float32": 68, "float64": 70}  # cublasComputeType_t: CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F
_GEMM_DEFAULT = -1  # cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT


def device_name() -> str:
    """The GPU's name, the key its timings are stored under."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _module(source: str, name: str) -> cp.RawModule:
    module = cp.RawModule(code=self_contained(source), options=OPTIONS)
    try:
        module.compile()
    except cp.cuda.compiler.CompileException as err:
        raise BundleError(f"kernel source {name}: NVRTC refused it: {str(err)[:2000]}") from None
    return module


class CudaProgram:
    """A bundle loaded on the current GPU: buffers allocated once, kernels compiled (NVRTC),
    constants uploaded, steps marked ``once`` run. ``program(**inputs)`` runs it on host arrays."""

    def __init__(self, bundle: Bundle):
        self.bundle = bundle
        self.dtype = np.dtype(bundle.dtype)
        self.stream = cp.cuda.Stream(non_blocking=True)
        # a handle of its own, bound to the program's stream once: cuBLAS calls are then captured
        # into the CUDA graph as they are (CuPy refuses to rebind a stream while capturing)
        self.cublas = cublas.create()
        cublas.setStream(self.cublas, self.stream.ptr)
        cublas.setPointerMode(self.cublas, cublas.CUBLAS_POINTER_MODE_HOST)
        self.buffers = {name: cp.zeros(shape, self.dtype) for name, shape in bundle.buffers.items()}
        for name, value in bundle.constants.items():
            self.buffers[name].set(np.ascontiguousarray(value, self.dtype))
        self.modules = {name: _module(text, name) for name, text in bundle.sources.items()}
        self._scalars = (np.ones((), self.dtype), np.zeros((), self.dtype))  # alpha, beta (host pointers)
        self.steps = [self._call(step) for step in bundle.steps]
        self.graph = None
        # allocations and uploads ran on the default stream, which a non-blocking one does not wait for
        cp.cuda.Device().synchronize()
        with self.stream:
            for step, call in zip(bundle.steps, self.steps):
                if step.once:
                    call()
            self.stream.synchronize()

    def _call(self, step) -> Callable[[], None]:
        if isinstance(step, CudaLaunches):
            module = self.modules[step.source]
            launches = []
            for launch in step.launches:
                args = tuple(self.buffers[a] if isinstance(a, str) else np.int32(a) for a in launch.args)
                function = module.get_function(launch.function)
                if launch.shared > 48 * 1024:  # past the default limit a kernel must ask for it
                    function.max_dynamic_shared_size_bytes = launch.shared
                launches.append((function, launch.grid, launch.block, args, launch.shared))

            def run():
                for function, grid, block, args, shared in launches:
                    function(grid, block, args, shared_mem=shared, stream=self.stream)

            return run
        if isinstance(step, GemmCall):
            return self._gemm(step)
        raise BundleError(f"unknown step {step!r}")

    def _gemm(self, call: GemmCall) -> Callable[[], None]:
        size = self.dtype.itemsize
        a = self.buffers[call.a].data.ptr + call.a_offset * size
        b = self.buffers[call.b].data.ptr + call.b_offset * size
        c = self.buffers[call.output].data.ptr + call.c_offset * size
        kind, compute = _CUDA_R[self.dtype.name], _COMPUTE[self.dtype.name]
        alpha, beta = (s.ctypes.data for s in self._scalars)
        ops = [cublas.CUBLAS_OP_T if t else cublas.CUBLAS_OP_N for t in (call.transa, call.transb)]

        def run():
            cublas.gemmStridedBatchedEx(
                self.cublas, *ops, call.m, call.n, call.k, alpha, a, kind, call.lda, call.stride_a,
                b, kind, call.ldb, call.stride_b, beta, c, kind, call.ldc, call.stride_c,
                call.batch, compute, _GEMM_DEFAULT,
            )  # fmt: skip

        return run

    def launch(self, graph: bool = True) -> None:
        """One run on the current buffers, on the program's stream (not synchronised)."""
        if graph:
            self._graph().launch(self.stream)
            return
        for step, call in zip(self.bundle.steps, self.steps):
            if not step.once:
                call()

    def launch_checked(self) -> None:
        """One run kernel by kernel, waiting for each step, so a fault names the step that made it.
        A fault (an illegal address, say) leaves the CUDA context unusable: the process must end."""
        for number, (step, call) in enumerate(zip(self.bundle.steps, self.steps)):
            if step.once:
                continue
            try:
                call()
                self.stream.synchronize()
            except (cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError, cublas.CUBLASError) as err:
                raise BundleError(f"step {number} ({step.label or step.output}) failed on the GPU: {err}") from None

    def _graph(self):
        if self.graph is None:
            self.launch(graph=False)  # once outside the capture: cuBLAS and the modules initialise lazily
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self.launch(graph=False)
            finally:
                self.graph = self.stream.end_capture()
        return self.graph

    def __call__(self, graph: bool = True, **inputs) -> np.ndarray:
        return self.run(inputs, graph)

    def run(self, inputs: Mapping[str, np.ndarray], graph: bool = True, checked: bool = False) -> np.ndarray:
        """The output on host ``inputs``: one CUDA graph launch, or the steps one by one
        (``checked``: each waited for, a fault raised as a BundleError naming its step)."""
        for name, shape in self.bundle.inputs.items():
            if name not in inputs:
                raise BundleError(f"missing input {name}")
            value = np.ascontiguousarray(inputs[name], self.dtype)
            if value.shape != tuple(shape):
                raise BundleError(f"input {name} has shape {value.shape}, the bundle expects {tuple(shape)}")
            self.buffers[name].set(value, stream=self.stream)
        if checked:
            self.launch_checked()
        else:
            self.launch(graph)
        out = self.buffers[self.bundle.output].get(stream=self.stream)
        self.stream.synchronize()
        return out

    def __del__(self):
        handle, self.cublas = getattr(self, "cublas", None), None
        if handle is not None:
            cublas.destroy(handle)


def _seconds(run: Callable[[], None], stream, repeats: int, budget: float = 2e-3) -> float:
    """Median seconds per call: batches of calls between CUDA events, each batch ≈ ``budget``."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        run()
    start.record(stream)
    run()
    end.record(stream)
    end.synchronize()
    once = max(cp.cuda.get_elapsed_time(start, end) * 1e-3, 1e-7)
    inner = max(1, min(1000, int(budget / once)))
    samples = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(inner):
            run()
        end.record(stream)
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end) * 1e-3 / inner)
    return float(np.median(samples))


def verify(program: CudaProgram, rtol: float = 1e-3) -> tuple[bool, float]:
    """(agrees, error): the program's output on the bundle's check inputs, run step by step,
    against the expected output stored with it (error: the largest difference over the largest
    expected value); then the CUDA graph must give the very same output as the steps did."""
    bundle = program.bundle
    if "expected" not in bundle.check:
        raise BundleError("the bundle has no check data (expected output)")
    inputs = check_inputs(bundle.inputs, bundle.check_seed, bundle.dtype)
    stepwise = program.run(inputs, checked=True)
    got, expected = stepwise.reshape(-1)[bundle.check["index"]], bundle.check["expected"]
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    error = float(np.abs(got - expected).max(initial=0.0)) / scale
    agrees = bool(error <= rtol and np.isfinite(got).all() == np.isfinite(expected).all())
    if agrees and not np.array_equal(program.run(inputs, graph=True), stepwise, equal_nan=True):
        raise BundleError("the CUDA graph's output differs from the steps run one by one")
    return agrees, error


def measure(program: CudaProgram, repeats: int = 20) -> dict:
    """Verify, then time: each step alone, the steps launched one by one, and the CUDA graph.
    A program that disagrees with its check data is not timed."""
    agrees, error = verify(program)
    record = {"verified": agrees, "error": error, "device": device_name()}
    if not agrees:
        return record
    timed = [(s, c) for s, c in zip(program.bundle.steps, program.steps) if not s.once]
    with program.stream:
        record["steps"] = [_seconds(call, program.stream, repeats) for _, call in timed]
        record["labels"] = [step.label or step.output for step, _ in timed]
        record["kernel_by_kernel"] = _seconds(lambda: program.launch(graph=False), program.stream, repeats)
        record["graph"] = _seconds(lambda: program.launch(graph=True), program.stream, repeats)
    return record


_FAILURES = (BundleError, cp.cuda.driver.CUDADriverError, cp.cuda.runtime.CUDARuntimeError, cublas.CUBLASError)


def measure_path(path: Path, repeats: int = 20) -> tuple[str, dict]:
    """(key, record) of the bundle at ``path``; a failure is recorded with its message, not raised."""
    bundle = read(path)
    try:
        record = {"path": path.name, **measure(CudaProgram(bundle), repeats)}
    except _FAILURES as err:
        record = {"path": path.name, "verified": False, "error": float("inf"), "failure": str(err)[:2000]}
    return bundle.key, {**record, "meta": bundle.meta}


def measure_directory(directory: str | Path, repeats: int = 20) -> dict:
    """Every bundle under ``directory`` (itself, or its sub-directories) verified and timed:
    ``{"device": ..., "bundles": {key: record}}``. Bundles run in a worker process, and after a
    failure the next one gets a fresh worker: a kernel that faults leaves its CUDA context
    unusable, and a bundle's fault must not fail the bundles after it."""
    directory = Path(directory)
    found = (
        [directory]
        if (directory / "bundle.json").exists()
        else sorted(p.parent for p in directory.glob("*/bundle.json"))
    )
    if not found:
        raise BundleError(f"{directory}: no bundle.json in it or its sub-directories")
    records, worker = {}, None
    for path in found:
        worker = worker or ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            key, record = worker.submit(measure_path, path, repeats).result()
        except BrokenProcessPool:
            key = read(path).key
            record = {"path": path.name, "verified": False, "error": float("inf"), "failure": "its process died"}
        records[key] = record
        if "failure" in record:
            worker.shutdown()
            worker = None
    if worker is not None:
        worker.shutdown()
    return {"device": device_name(), "bundles": records}
