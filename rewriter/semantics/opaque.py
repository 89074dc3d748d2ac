"""Opaque operations (``rewriter.ir.Opaque``): what the scope language cannot express, as numpy
functions (``run_opaque``), and random inputs that are valid for them (``sample_inputs``).

Integer data (gather indices) are float data here, as everywhere in a program: exact below 2**24.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from rewriter.ir import OPAQUE_OPS, Definition, ExpressionError, Opaque, constants_among, tensor_shapes


def _positions(op: Opaque, indices: np.ndarray, size: int) -> np.ndarray:
    """Integer-valued float indices as int64 in [0, size) (negative ones count from the end)."""
    axis, name = op.attribute("axis"), op.inputs[1].name
    whole = np.rint(indices)
    if not np.array_equal(whole, indices):
        raise ExpressionError(f"{op.op}: indices {name} hold a value that is not an integer")
    outside = (whole < -size) | (whole >= size)
    if outside.any():
        raise ExpressionError(
            f"{op.op}: index {int(whole[outside].flat[0])} in {name} is out of range for axis {axis} of "
            f"{op.inputs[0].name} (size {size})"
        )
    return whole.astype(np.int64) % size


def _gather(op: Opaque, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """ONNX Gather: ``data`` at the entries of ``indices`` along ``axis``."""
    axis = op.attribute("axis")
    return np.take(data, _positions(op, indices, data.shape[axis]), axis=axis)


def _gather_elements(op: Opaque, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """ONNX GatherElements: ``data`` at ``indices`` along ``axis``, at their own positions along
    the others (an indices axis may be shorter than data's)."""
    axis = op.attribute("axis")
    positions = _positions(op, indices, data.shape[axis])
    if any(i > d for k, (i, d) in enumerate(zip(indices.shape, data.shape)) if k != axis):
        raise ExpressionError(
            f"{op.op}: indices {op.inputs[1].name} are larger than {op.inputs[0].name} off axis {axis}"
        )
    view = data[tuple(slice(0, n) if k != axis else slice(None) for k, n in enumerate(indices.shape))]
    return np.take_along_axis(view, positions, axis=axis)


# opaque operation -> (the operation, its inputs' values in order) -> its value
OPAQUE = {"gather": _gather, "gather_elements": _gather_elements}


def run_opaque(op: Opaque, values: Mapping[str, np.ndarray]) -> np.ndarray:
    """The value of an opaque operation on the named ``values`` of its inputs."""
    return OPAQUE[op.op](op, *(np.asarray(values[t.name]) for t in op.inputs))


def bound_constants(names) -> dict[str, np.ndarray]:
    """The recorded constant tables (``rewriter.ir.constant``) among ``names``, as arrays: what
    binds a tensor a rule introduced (never sampled)."""
    return {name: np.reshape(values, shape) for name, (shape, values) in constants_among(names).items()}


def index_bounds(definitions: Iterable[tuple[str, Definition]]) -> dict[str, int]:
    """For each input a gather reads as its indices (directly or through other definitions: a
    reshape of token ids), the size of the smallest axis it indexes: its values must lie below."""
    sources: dict[str, set[str]] = {}  # tensor -> the inputs it is computed from
    bounds: dict[str, int] = {}
    for name, expr in definitions:
        sources[name] = set().union(*(sources.get(t, {t}) for t in tensor_shapes(expr)))
        if isinstance(expr, Opaque) and OPAQUE_OPS[expr.op][0] == ("data", "indices"):
            size = expr.inputs[0].shape[expr.attribute("axis")]
            for source in sources.get(expr.inputs[1].name, {expr.inputs[1].name}):
                bounds[source] = min(bounds.get(source, size), size)
    return bounds


def sample_inputs(
    definitions: Iterable[tuple[str, Definition]],
    shapes: Mapping[str, tuple[int, ...]],
    seed: int = 0,
    integers: Iterable[str] = (),
) -> dict[str, np.ndarray]:
    """Random float32 values for the tensors ``shapes`` names, valid for the program of
    ``definitions``: standard normal, except a tensor a gather reads as its indices (directly or
    through other definitions: a reshape of token ids), which holds integers in range of every
    such gather, another of the ``integers`` (an integer or boolean model input: an attention
    mask), which holds 0 and 1, and a recorded constant table, which holds its values."""
    bounds = index_bounds(definitions)
    rng = np.random.default_rng(seed)
    tables = bound_constants(shapes)
    bounds = {**dict.fromkeys(integers, 2), **bounds}
    return {
        name: (
            tables[name]
            if name in tables
            else rng.integers(0, bounds[name], shape)
            if name in bounds
            else rng.standard_normal(shape)
        ).astype(np.float32)
        for name, shape in shapes.items()
    }
