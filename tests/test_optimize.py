"""The program-level optimizer: subprograms derived once per shape, stitched, saved and loaded."""

import numpy as np

from rewriter import evaluate, parse_program
from rewriter.optimize import load_optimized, optimize_program


def test_activations_fuse_and_equal_subprograms_are_searched_once_with_their_own_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    shapes = {"X": (6, 5), "W1": (5, 5), "W2": (5, 5)}
    program = parse_program(
        "H = L i:6, j:5 ; S k:5 ; X[i, k] * W1[k, j]\n"
        "R = L i:6, j:5 ; relu(H[i, j])\n"
        "Y = L i:6, j:5 ; S k:5 ; R[i, k] * W2[k, j]\n"
        "Z = L i:6, j:5 ; relu(Y[i, j])\n"
        "return Z",
        shapes,
    )
    rng = np.random.default_rng(0)
    weights = {"W1": rng.standard_normal((5, 5)), "W2": rng.standard_normal((5, 5))}
    optimized = optimize_program(program, weights, max_depth=1)
    # each relu joins its matmul (R = relu(X W1), Z = relu(R W2)); the second is the first renamed
    assert [(s.name, s.state) for s in optimized.subprograms] == [("R", "derived"), ("Z", "reused")]
    x = rng.standard_normal((6, 5))
    want = evaluate(program, {"X": x, **weights})
    np.testing.assert_allclose(optimized(X=x), want, rtol=1e-4, atol=1e-4)
    optimized.save(tmp_path / "saved")
    np.testing.assert_allclose(load_optimized(tmp_path / "saved")(X=x), want, rtol=1e-4, atol=1e-4)
    assert not (tmp_path / "saved.partial").exists()
