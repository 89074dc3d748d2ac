"""Operands read as strided views: what the library implementations (im2col, band) copy from.

An affine read ``X[sum(c*i) + k, ..]`` of a row-major tensor is a strided view over its
iterators: iterator i steps ``sum over dimensions of c * (that dimension's element stride)``.
``StridedRead`` keeps each dimension's affine form and the zero padding it reads beyond the
tensor; ``pad`` copies the tensor into a reused zero-bordered buffer, and ``view`` gives the
(padded) tensor over any order of the iterators, without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rewriter.index import affine_coefficients
from rewriter.ir import Access

from .tvm_kernel import aligned_empty


@dataclass(frozen=True)
class StridedRead:
    """An operand read as a strided view over some of the scope's iterators."""

    tensor: str
    shape: tuple[int, ...]
    forms: tuple  # per dimension: ({iterator: coefficient}, constant)
    pads: tuple  # per dimension: (zeros before, zeros after) the tensor's extent

    @property
    def iterators(self) -> set[str]:
        return {n for coeffs, _ in self.forms for n in coeffs}

    @property
    def padded(self) -> bool:
        return any(p != (0, 0) for p in self.pads)

    def pad(self, array: np.ndarray, buffers: dict, dtype) -> np.ndarray:
        """``array`` inside a zero border as wide as the padding it reads (a buffer in
        ``buffers``, allocated once: the border is never written, so it stays zero)."""
        if not self.padded:
            return array
        key = ("padded", self.tensor)
        if key not in buffers:
            buffers[key] = aligned_empty([e + a + b for e, (a, b) in zip(self.shape, self.pads)], dtype)
            buffers[key][...] = 0
        buffers[key][tuple(slice(a, a + e) for e, (a, _) in zip(self.shape, self.pads))] = array
        return buffers[key]

    def view(self, array: np.ndarray, iterators: list, box: dict) -> np.ndarray:
        """``array`` (already padded by ``pads``) over ``iterators`` in that order."""
        array = np.ascontiguousarray(array)
        unit = [s // array.itemsize for s in array.strides]
        offset = sum(
            (const + before + sum(c * box[n][0] for n, c in coeffs.items())) * u
            for (coeffs, const), (before, _), u in zip(self.forms, self.pads, unit)
        )
        strides = [
            sum(coeffs.get(n, 0) * u for (coeffs, _), u in zip(self.forms, unit)) * array.itemsize for n in iterators
        ]
        shape = [box[n][1] - box[n][0] for n in iterators]
        return np.lib.stride_tricks.as_strided(array.reshape(-1)[offset:], shape, strides, writeable=False)


def strided_read(access: Access, box: dict, forms: dict | None = None) -> StridedRead | None:
    """``access`` as a ``StridedRead`` over the iterators of ``box``, or None if an index is not
    affine. ``forms`` replaces the affine form of some dimensions ({dimension: (coefficients,
    constant)}): a band reads its window dimension through one iterator of its own."""
    result, pads = [], []
    for dim, (ix, extent) in enumerate(zip(access.indices, access.source.shape)):
        form = (forms or {}).get(dim) or affine_coefficients(ix)
        if form is None:
            return None
        coeffs, const = form
        lo = const + sum(c * (box[n][0] if c > 0 else box[n][1] - 1) for n, c in coeffs.items())
        hi = const + sum(c * (box[n][1] - 1 if c > 0 else box[n][0]) for n, c in coeffs.items())
        result.append((coeffs, const))
        pads.append((max(0, -lo), max(0, hi - (extent - 1))))
    return StridedRead(access.source.name, tuple(access.source.shape), tuple(result), tuple(pads))
