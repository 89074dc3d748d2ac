"""The backend interface: derive and the program optimizer reach code generation only through it."""

import numpy as np
import pytest

from codegen.backend import ReferenceBackend, as_backend
from rewriter import ExpressionError, derive, evaluate, parse, parse_program
from rewriter.pipeline import optimize_program
from rewriter.testing import random_inputs


class Recording:
    """A backend written against the interface alone (as a new device's would be): it runs the
    candidates as they are, costs each kernel one unit, and records what derive asks of it."""

    name, measures, tolerance = "recording", True, 1e-9

    def __init__(self):
        self.compiled, self.measured, self.raced = [], [], []

    def device(self) -> str:
        return "recording device"

    def compile(self, candidate, inputs):
        self.compiled.append((candidate, dict(inputs)))
        return candidate

    def measure(self, program) -> float:
        self.measured.append(program)
        return len(program.kernels)

    def remeasure(self, programs) -> None:
        self.raced.append(list(programs))


def test_derive_compiles_measures_and_races_through_the_backend_it_is_given():
    expr = parse("L j:6, i:8 ; S k:4 ; A[i, k] * B[k, j]", {"A": (8, 4), "B": (4, 6)})
    backend = Recording()
    derivation = derive(expr, max_depth=1, backend=backend)
    assert derivation.candidates and all(any(p is c for c, _ in backend.compiled) for p in derivation.candidates)
    assert {name: shape for name, shape in backend.compiled[0][1].items()} == {"A": (8, 4), "B": (4, 6)}
    assert all(any(p is m for m in backend.measured) for p in derivation.candidates)
    assert len(derivation.candidates) >= 2 and any(derivation.best in front for front in backend.raced)
    inputs = random_inputs(expr)
    for program in derivation.candidates:  # every program it returns was checked against the reference
        np.testing.assert_allclose(program(**inputs), evaluate(expr, inputs), rtol=1e-9)


def test_backends_by_name_and_a_clear_error_for_an_unknown_one():
    assert isinstance(as_backend("reference"), ReferenceBackend)
    backend = Recording()
    assert as_backend(backend) is backend
    with pytest.raises(ExpressionError, match="unknown backend 'gpu'; known: cpu, reference, cuda"):
        derive(parse("L i:4 ; A[i]", {"A": (4,)}), max_depth=0, backend="gpu")


def test_the_program_optimizer_refuses_a_backend_that_compiles_nothing():
    program = parse_program("Y = L i:4 ; A[i] * 2\nreturn Y", {"A": (4,)})
    with pytest.raises(ExpressionError, match="backend 'reference' compiles none"):
        optimize_program(program, {}, backend="reference")
