"""The ``cuda`` backend: candidates as GPU bundles, measured on the GPU.

``compile(candidate)`` builds a ``bundle.Bundle`` (written to disk only with ``bundles=DIR``):

* a matched GEMM (Matmul, BatchMatmul) becomes one cuBLAS strided batched call on its operands
  in place, by the strides its iterator mapping table found (``bundle.gemm.gemm_call``);
  operands cuBLAS cannot read in place, and every other kernel, are generated as CUDA by TVM
  (``codegen.cuda_kernel``);
* its check data: seeded random inputs and the output the candidate's reference semantics
  gives on them, so the GPU verifies the program where it runs.

Where the GPU is (CuPy and a device here), programs run and are timed on it. Where it is not,
the two-machine workflow: ``bundles=DIR`` writes every compiled candidate there, ``python -m
bundle measure DIR --out timings.json`` verifies and times them on a GPU machine (numpy and CuPy
only), and ``timings=timings.json`` brings the timings back: a program costs its CUDA-graph
time there; one without a timing, or whose GPU output disagreed, costs infinity and is never
chosen over a measured one. Without a GPU, a program called here runs its cuBLAS calls as
cuBLAS computes them (``bundle.gemm.emulate``) and its generated kernels by the reference
semantics: that checks the plan (operand order, transposes, strides, buffers), the GPU checks
the generated code.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from bundle.format import Bundle, GemmCall, check_inputs, check_points
from bundle.gemm import emulate, gemm_call
from rewriter.ir import ExpressionError, tensor_shapes
from rewriter.lower import Candidate, GemmMatch, Kernel
from rewriter.semantics import bound_constants, evaluate

from .cuda_kernel import cuda_kernel

try:  # the GPU extra: present and a device visible
    from bundle import cuda as gpu

    gpu.device_name()
except Exception:  # noqa: BLE001  no CuPy, no driver or no device: bundles are measured elsewhere
    gpu = None

CHECK_SEED = 0


def to_bundle(
    candidate: Candidate,
    inputs: Mapping[str, tuple[int, ...]],
    dtype: str = "float32",
    weights: Mapping[str, np.ndarray] | None = None,
) -> Bundle:
    """``candidate`` as a GPU bundle over ``inputs``, with check data. ``weights`` (values of
    some inputs) are bound: they travel as constants, and the kernels that read only them run
    once, when the bundle is loaded (OLLIE 5.4)."""
    weights = {name: np.asarray(value, dtype) for name, value in (weights or {}).items()}
    reads = set().union(*(tensor_shapes(k.expr) for k in candidate.kernels))
    tables = {name: value.astype(dtype) for name, value in bound_constants(reads - set(inputs)).items()}
    weights.update(tables)  # a rule's constant tables travel as constants
    steps, sources, constant = [], {}, set(weights)
    buffers = {name: tuple(shape) for name, shape in inputs.items()} | {n: v.shape for n, v in tables.items()}
    for kernel in candidate.kernels:
        label = f"{kernel.output} = {kernel.kind}"
        call = None
        if isinstance(kernel.match, GemmMatch):
            call = gemm_call(kernel.output, kernel.match.a, kernel.match.b, kernel.match.out_strides, label)
        if call is None:
            call, source, temporaries = cuda_kernel(kernel.expr, kernel.output, dtype, label)
            sources[call.source] = source
            buffers.update(temporaries)
        if set(tensor_shapes(kernel.expr)) <= constant:
            call = replace(call, once=True)
            constant.add(kernel.output)
        buffers[kernel.output] = tuple(kernel.expr.shape)
        steps.append(call)
    shapes = {name: tuple(shape) for name, shape in inputs.items() if name not in weights}
    values = {**check_inputs(shapes, CHECK_SEED, dtype), **weights}
    expected = np.asarray(candidate(**{n: v.astype(np.float64) for n, v in values.items()}), dtype)
    meta = {"kernels": [f"{k.output} = {k.kind}: {k.expr}" for k in candidate.kernels]}
    output = candidate.kernels[-1].output
    return Bundle(
        dtype, shapes, output, buffers, steps, sources, weights, check_points(expected, CHECK_SEED), CHECK_SEED, meta
    )


@dataclass
class GpuProgram:
    """A compiled candidate: its bundle, loaded on the GPU when there is one here."""

    candidate: Candidate
    bundle: Bundle
    inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # every input's shape, weights too
    seconds: list[float | None] | None = None  # per step, measured on the GPU (None: runs once, at load)
    graph_seconds: float | None = None
    estimated: bool = False  # unmeasured, it costs the analytic stand-in (no timings at all), else infinity
    loaded: object = field(default=None, repr=False)

    @property
    def kernels(self) -> list[Kernel]:
        return self.candidate.kernels

    @property
    def source(self):
        return self.candidate.source

    @property
    def cost(self) -> float:
        """The whole program's time as one CUDA graph on the GPU. Before a GPU timed it: the
        analytic stand-in where nothing is measured (bundles being prepared), else infinity."""
        if self.graph_seconds is not None:
            return self.graph_seconds
        return self.candidate.cost if self.estimated else math.inf

    def listing(self) -> str:
        """One line per step: what computes which output, how (cuBLAS or a generated kernel), time."""
        lines = []
        for k, step in enumerate(self.bundle.steps):
            how = (
                f"cuBLAS gemm {'T' if step.transa else 'N'}{'T' if step.transb else 'N'} m={step.m} n={step.n} "
                f"k={step.k} batch={step.batch} lda={step.lda} ldb={step.ldb} ldc={step.ldc}"
                if isinstance(step, GemmCall)
                else f"CUDA {step.source}: "
                + ", ".join(f"{x.function}<<<{x.grid}, {x.block}>>>" for x in step.launches)
            )
            timed = "once, at load" if step.once else f"{self.seconds[k] * 1e3:.4f} ms" if self.seconds else "-"
            lines.append(f"{step.label}  [{how}]  {timed}")
        return "\n".join(lines)

    def bind(self, weights: Mapping[str, np.ndarray]) -> GpuProgram:
        """The same program with ``weights`` fixed: they travel as constants, the kernels that
        read only them run once at load, and the program takes the other inputs alone. Its
        bundle is new (a new key): a GPU times it again."""
        bundle = to_bundle(self.candidate, self.inputs, self.bundle.dtype, weights)
        return GpuProgram(self.candidate, bundle, self.inputs, estimated=self.estimated)

    def save(self, directory: str | Path) -> Path:
        """Write the program's bundle (``python -m bundle run`` runs it on a GPU)."""
        return self.bundle.write(directory)

    def timings(self) -> list[tuple[Kernel, float]]:
        return [(k, t) for k, t in zip(self.kernels, self.seconds or ()) if t is not None]

    def __call__(self, **inputs) -> np.ndarray:
        if gpu is not None:
            if self.loaded is None:
                self.loaded = gpu.CudaProgram(self.bundle)
            return self.loaded.run(inputs)
        return self._emulated(inputs)

    def _emulated(self, inputs) -> np.ndarray:
        values = {n: np.asarray(v, self.bundle.dtype) for n, v in {**inputs, **self.bundle.constants}.items()}
        for step, kernel in zip(self.bundle.steps, self.kernels):
            if isinstance(step, GemmCall):
                values[step.output] = np.zeros(self.bundle.buffers[step.output], self.bundle.dtype)
                emulate(step, {n: values[n] for n in (step.a, step.b, step.output)})
            else:
                values[step.output] = evaluate(kernel.expr, {n: values[n] for n in tensor_shapes(kernel.expr)})
        return values[self.bundle.output]


@dataclass
class CudaBackend:
    """NVIDIA GPUs: cuBLAS for matched GEMMs, TVM-generated CUDA for the rest (see the module).

    ``bundles``: a directory every compiled program is written to (by its key); ``timings``: a
    file ``python -m bundle measure`` wrote on a GPU machine."""

    dtype: str = "float32"
    bundles: str | Path | None = None
    timings: str | Path | None = None
    name: str = field(default="cuda", init=False)

    def __post_init__(self):
        self._records = {}
        self._device = gpu.device_name() if gpu is not None else None
        if self.timings is not None:
            try:
                measured = json.loads(Path(self.timings).read_text())
            except (OSError, ValueError) as err:
                raise ExpressionError(f"timings file {self.timings}: {err}") from None
            self._records = measured.get("bundles", {})
            self._device = self._device or measured.get("device")

    @property
    def measures(self) -> bool:
        return gpu is not None or self.timings is not None

    @property
    def tolerance(self) -> float:
        return 1e-3 if np.dtype(self.dtype) == np.float32 else 1e-6

    def device(self) -> str:
        return self._device or "cuda (not measured)"

    def compile(self, candidate: Candidate, inputs: Mapping[str, tuple[int, ...]]) -> GpuProgram:
        bundle = to_bundle(candidate, inputs, self.dtype)
        program = GpuProgram(candidate, bundle, dict(inputs), estimated=not self.measures)
        if self.bundles is not None:
            program.bundle.write(Path(self.bundles) / program.bundle.key)
        return program

    def measure(self, program: GpuProgram) -> float:
        if gpu is not None:
            record = gpu.measure(program.loaded or gpu.CudaProgram(program.bundle))
        else:
            record = self._records.get(program.bundle.key, {})
        if record.get("verified"):
            timed = iter(record["steps"])  # the steps that run per call (not the ``once`` ones)
            program.seconds = [None if step.once else next(timed) for step in program.bundle.steps]
            program.graph_seconds = record["graph"]
        return program.cost

    def remeasure(self, programs: Sequence[GpuProgram]) -> None:
        if gpu is not None:
            for program in programs:
                self.measure(program)
