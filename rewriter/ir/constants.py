"""Constant tables: small tensors whose values a rule fixes (Winograd's transform matrices).

A rule that introduces a constant reads it as an ordinary ``Tensor`` made by ``constant(name,
rows)``, which records its values under its name; everything that binds inputs (the reference
evaluator, derivation's checks, compiled programs) takes a tensor it is not given from here.
A name is a pure function of the values a rule gives it (``winograd_AT_m2_r3``), so recording it
again, in this process or another, gives the same table; two different tables under one name are
refused.
"""

from __future__ import annotations

from .errors import ExpressionError
from .nodes import Tensor

_TABLES: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}


def constant(name: str, rows) -> Tensor:
    """The tensor ``name`` holding the matrix ``rows`` (a sequence of equal-length rows of
    numbers), recorded so that every evaluation binds it."""
    rows = [tuple(float(v) for v in row) for row in rows]
    if not rows or any(len(row) != len(rows[0]) for row in rows) or not rows[0]:
        raise ExpressionError(f"constant {name}: rows must be non-empty and of one length")
    tensor = Tensor(name, (len(rows), len(rows[0])))
    table = (tensor.shape, tuple(v for row in rows for v in row))
    if _TABLES.setdefault(name, table) != table:
        raise ExpressionError(f"constant {name} is already recorded with other values")
    return tensor


def constants_among(names) -> dict[str, tuple[tuple[int, ...], tuple[float, ...]]]:
    """The recorded constants among ``names``, each with its shape and values."""
    return {name: _TABLES[name] for name in names if name in _TABLES}
