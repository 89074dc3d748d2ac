"""The bundle: a GPU program as files, readable with numpy alone.

A bundle directory holds ``bundle.json`` (the plan below), one CUDA source file per generated
kernel, ``constants.npz`` (bound weights) and ``check.npz``: the output the reference semantics
gives on the check inputs, at up to ``CHECK_POINTS`` positions, so the GPU run is verified
where it happens. The check inputs are not stored (a convolution's input can outweigh the
whole bundle many times): ``check_inputs`` draws them again from ``check_seed``.

The plan lists every buffer (its shape; inputs, constants, temporaries and the output share one
name space) and the steps in execution order:

* ``CudaLaunches``: one generated kernel, its source file and the launches its host code makes
  (function name, grid, block, dynamic shared memory, arguments by buffer name or as integers);
* ``GemmCall``: one cuBLAS ``gemmStridedBatchedEx`` call, in cuBLAS's own column-major terms:
  for each batch ``i``, ``C_i = op(A_i) @ op(B_i)`` where ``A_i`` starts ``offset + i*stride``
  elements into its buffer and element ``(r, c)`` of the stored matrix is ``r + c*ld`` further.

A step marked ``once`` reads only constants: it runs when the bundle is loaded, not per call.
Writing is atomic (a temporary directory renamed into place): no half-written bundle is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

FORMAT = 1
CHECK_POINTS = 1 << 16  # output positions compared on the GPU


class BundleError(ValueError):
    """A bundle that cannot be read or run (names the file, step or buffer)."""


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``args`` are buffer names (device pointers) or ints (32-bit scalars)."""

    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[str | int, ...]
    shared: int = 0  # dynamic shared memory, bytes


@dataclass(frozen=True)
class CudaLaunches:
    """A generated kernel: CUDA source (``source``: the file name in the bundle) and its launches."""

    output: str
    source: str
    launches: tuple[Launch, ...]
    once: bool = False
    label: str = ""  # what it computes, for listings


@dataclass(frozen=True)
class GemmCall:
    """``C_i = op(A_i) @ op(B_i)`` for i < batch, column-major (cuBLAS): m×k times k×n into m×n."""

    output: str
    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    a: str
    a_offset: int
    lda: int
    stride_a: int
    b: str
    b_offset: int
    ldb: int
    stride_b: int
    c_offset: int
    ldc: int
    stride_c: int
    batch: int
    once: bool = False
    label: str = ""

    @property
    def c(self) -> str:
        return self.output


Step = CudaLaunches | GemmCall


@dataclass
class Bundle:
    """A whole GPU program: buffers, steps, sources, constants and check data."""

    dtype: str
    inputs: dict[str, tuple[int, ...]]
    output: str
    buffers: dict[str, tuple[int, ...]]  # every buffer's shape: inputs, constants, temporaries, output
    steps: list[Step]
    sources: dict[str, str] = field(default_factory=dict)  # file name -> CUDA source
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    check: dict[str, np.ndarray] = field(default_factory=dict)  # "index" (flat positions) and "expected"
    check_seed: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        for step in self.steps:
            names = [step.output] + ([step.a, step.b] if isinstance(step, GemmCall) else [])
            names += [arg for launch in getattr(step, "launches", ()) for arg in launch.args if isinstance(arg, str)]
            for name in names:
                if name not in self.buffers:
                    raise BundleError(
                        f"step {step.label or step.output}: buffer {name!r} is not in the bundle's buffers"
                    )
            if isinstance(step, CudaLaunches) and step.source not in self.sources:
                raise BundleError(f"step {step.label or step.output}: source {step.source!r} is not in the bundle")

    @property
    def key(self) -> str:
        """A content hash of what runs (plan and sources, not constants or check data): the
        name timings are stored and imported under."""
        text = json.dumps([self.dtype, self.inputs, self.output, self.buffers, _plan(self.steps), self.sources])
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def write(self, directory: str | Path) -> Path:
        """Write the bundle to ``directory`` (replaced if it exists), atomically."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            for name, text in self.sources.items():
                (tmp / name).write_text(text)
            np.savez(tmp / "constants.npz", **self.constants)
            np.savez(tmp / "check.npz", **self.check)
            plan = {
                "format": FORMAT,
                "key": self.key,
                "dtype": self.dtype,
                "inputs": self.inputs,
                "output": self.output,
                "buffers": self.buffers,
                "steps": _plan(self.steps),
                "check_seed": self.check_seed,
                "meta": self.meta,
            }
            (tmp / "bundle.json").write_text(json.dumps(plan, indent=1))
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return directory


def check_inputs(inputs: Mapping[str, tuple[int, ...]], seed: int, dtype: str) -> dict[str, np.ndarray]:
    """The check inputs: uniform in [-1, 1) from numpy's default generator seeded with ``seed``,
    drawn in the order of ``inputs`` (numpy keeps this stream stable across versions)."""
    rng = np.random.default_rng(seed)
    return {name: rng.uniform(-1, 1, shape).astype(dtype) for name, shape in inputs.items()}


def check_points(expected: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The check data kept for an output: every position, or ``CHECK_POINTS`` of them at random."""
    flat = expected.reshape(-1)
    if flat.size <= CHECK_POINTS:
        index = np.arange(flat.size)
    else:
        index = np.sort(np.random.default_rng(seed).choice(flat.size, CHECK_POINTS, replace=False))
    return {"index": index.astype(np.int64), "expected": flat[index]}


def _plan(steps) -> list[dict]:
    return [{"op": "gemm" if isinstance(s, GemmCall) else "cuda", **asdict(s)} for s in steps]


def _step(entry: Mapping) -> Step:
    entry = dict(entry)
    op = entry.pop("op")
    if op == "gemm":
        return GemmCall(**entry)
    if op == "cuda":
        launches = tuple(
            Launch(x["function"], tuple(x["grid"]), tuple(x["block"]), tuple(x["args"]), x.get("shared", 0))
            for x in entry.pop("launches")
        )
        return CudaLaunches(launches=launches, **entry)
    raise BundleError(f"unknown step {op!r}")


def read(directory: str | Path) -> Bundle:
    """The bundle in ``directory``; a BundleError names what is missing or malformed."""
    directory = Path(directory)
    try:
        plan = json.loads((directory / "bundle.json").read_text())
    except (OSError, ValueError) as err:
        raise BundleError(f"{directory}: not a bundle ({err})") from None
    if plan.get("format") != FORMAT:
        raise BundleError(f"{directory}: bundle format {plan.get('format')!r}, this runtime reads {FORMAT}")
    try:
        steps = [_step(s) for s in plan["steps"]]
        sources = {s.source: (directory / s.source).read_text() for s in steps if isinstance(s, CudaLaunches)}
        with np.load(directory / "constants.npz") as npz:
            constants = {n: npz[n] for n in npz.files}
        with np.load(directory / "check.npz") as npz:
            check = {n: npz[n] for n in npz.files}
        bundle = Bundle(
            plan["dtype"],
            {n: tuple(s) for n, s in plan["inputs"].items()},
            plan["output"],
            {n: tuple(s) for n, s in plan["buffers"].items()},
            steps,
            sources,
            constants,
            check,
            plan["check_seed"],
            plan.get("meta", {}),
        )
    except (OSError, KeyError, TypeError, ValueError) as err:
        raise BundleError(f"{directory}: malformed bundle ({type(err).__name__}: {err})") from None
    if bundle.key != plan.get("key"):
        raise BundleError(f"{directory}: its files do not match the key in bundle.json (edited or corrupt)")
    return bundle
