"""Opaque operations (``rewriter.ir.Opaque``): what the scope language cannot express, as numpy
functions (``run_opaque``), and random inputs that are valid for them (``sample_inputs``).

Integer data (gather indices) are float data here, as everywhere in a program: exact below 2**24.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from rewriter.ir import Definition, ExpressionError, Opaque, tensor_shapes


def _gather(op: Opaque, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """ONNX Gather: ``data`` at the entries of ``indices`` along ``axis`` (integer-valued float
    data: negative entries count from the end)."""
    axis, name, size = op.attribute("axis"), op.inputs[1].name, data.shape[op.attribute("axis")]
    whole = np.rint(indices)
    if not np.array_equal(whole, indices):
        raise ExpressionError(f"gather: indices {name} hold a value that is not an integer")
    outside = (whole < -size) | (whole >= size)
    if outside.any():
        raise ExpressionError(
            f"gather: index {int(whole[outside].flat[0])} in {name} is out of range for axis {axis} of "
            f"{op.inputs[0].name} (size {size})"
        )
    return np.take(data, whole.astype(np.int64) % size, axis=axis)


# opaque operation -> (the operation, its inputs' values in order) -> its value
OPAQUE = {"gather": _gather}


def run_opaque(op: Opaque, values: Mapping[str, np.ndarray]) -> np.ndarray:
    """The value of an opaque operation on the named ``values`` of its inputs."""
    return OPAQUE[op.op](op, *(np.asarray(values[t.name]) for t in op.inputs))


def sample_inputs(
    definitions: Iterable[tuple[str, Definition]], shapes: Mapping[str, tuple[int, ...]], seed: int = 0
) -> dict[str, np.ndarray]:
    """Random float32 values for the tensors ``shapes`` names, valid for the program of
    ``definitions``: standard normal, except a tensor a gather reads as its indices (directly or
    through other definitions: a reshape of token ids), which holds integers in range of every
    such gather."""
    sources: dict[str, set[str]] = {}  # tensor -> the tensors of ``shapes`` it is computed from
    bounds: dict[str, int] = {}
    for name, expr in definitions:
        sources[name] = set().union(*(sources.get(t, {t}) for t in tensor_shapes(expr)))
        if isinstance(expr, Opaque) and expr.op == "gather":
            size = expr.inputs[0].shape[expr.attribute("axis")]
            for source in sources.get(expr.inputs[1].name, {expr.inputs[1].name}):
                bounds[source] = min(bounds.get(source, size), size)
    rng = np.random.default_rng(seed)
    return {
        name: (rng.integers(0, bounds[name], shape) if name in bounds else rng.standard_normal(shape)).astype(
            np.float32
        )
        for name, shape in shapes.items()
    }
