"""The program-level optimizer: subprograms derived once per shape, stitched, saved and loaded."""

import os
import subprocess
import sys

import numpy as np
import pytest

from codegen.backend import CpuBackend
from rewriter import evaluate, parse_program
from rewriter.ir import distinct_scopes, tensor_shapes
from rewriter.lower import match_operator
from rewriter.pipeline import (
    blocked_layouts,
    fold_weights,
    fuse_elementwise,
    load_optimized,
    merge_parallel,
    optimize_program,
    orchestrate_program,
    orchestrations,
    runners_up_raced,
)
from rewriter.pipeline.program import _faster_layout


def _two_products(relu_last: bool):
    """X @ W1, its relu, @ W2 (and its relu where ``relu_last``): the program, its weights and
    the generator that drew them (for inputs)."""
    shapes = {"X": (6, 5), "W1": (5, 5), "W2": (5, 5)}
    text = (
        "H = L i:6, j:5 ; S k:5 ; X[i, k] * W1[k, j]\n"
        "R = L i:6, j:5 ; relu(H[i, j])\n"
        "Y = L i:6, j:5 ; S k:5 ; R[i, k] * W2[k, j]\n"
    )
    text += "Z = L i:6, j:5 ; relu(Y[i, j])\nreturn Z" if relu_last else "return Y"
    rng = np.random.default_rng(0)
    weights = {"W1": rng.standard_normal((5, 5)), "W2": rng.standard_normal((5, 5))}
    return parse_program(text, shapes), weights, rng


def test_activations_fuse_and_equal_subprograms_are_searched_once_with_their_own_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    program, weights, rng = _two_products(relu_last=True)
    optimized = optimize_program(program, weights, max_depth=1)
    # each relu joins its matmul (R = relu(X W1), Z = relu(R W2)); the second is the first renamed
    assert [(s.name, s.state) for s in optimized.subprograms] == [("R", "derived"), ("Z", "reused")]
    x = rng.standard_normal((6, 5))
    want = evaluate(program, {"X": x, **weights})
    np.testing.assert_allclose(optimized(X=x), want, rtol=1e-4, atol=1e-4)
    optimized.save(tmp_path / "saved")
    np.testing.assert_allclose(load_optimized(tmp_path / "saved")(X=x), want, rtol=1e-4, atol=1e-4)
    assert not (tmp_path / "saved.partial").exists()


def test_runners_up_are_raced_once_and_both_orchestrations_come_from_one_set_of_plans(tmp_path, monkeypatch):
    """The stitched program keeps each subprogram's runners-up; ``runners_up_raced`` races them
    where the program runs (the backend's race, once) and drops them. ``orchestrations`` then
    makes the BLP's program and the greedy one from one set of plans, racing no runner-up
    again: the two differ in their orchestration alone. Orchestrating a program whose
    runners-up are still there races them first. Every program computes the model."""
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    program, weights, rng = _two_products(relu_last=False)
    raced, race = [], CpuBackend.race_runners_up
    monkeypatch.setattr(CpuBackend, "race_runners_up", lambda self, *args: raced.append(args[1]) or race(self, *args))
    planned, plans = [], CpuBackend.orchestrations
    monkeypatch.setattr(
        CpuBackend, "orchestrations", lambda self, *args, **kw: planned.append(args) or plans(self, *args, **kw)
    )
    stitched = optimize_program(program, weights, max_depth=1, orchestration="none", layout="as written")
    assert stitched.alternatives and not raced  # not orchestrated: runners-up kept, not raced
    chosen = runners_up_raced(stitched)
    assert raced == [stitched.alternatives] and chosen.alternatives == {}
    taken = chosen.orchestration.figures["runners_up_in_place"]
    both = orchestrations(chosen)
    assert list(both) == ["blp", "greedy"] and len(planned) == 1 and len(raced) == 1
    x = rng.standard_normal((6, 5))
    want = evaluate(program, {"X": x, **weights})
    for method, orchestrated in both.items():
        assert orchestrated.orchestration.method in (
            {"blp", "greedy", "none"} if method == "blp" else {"greedy", "none"}
        )
        assert orchestrated.orchestration.figures["runners_up_in_place"] == taken
        np.testing.assert_allclose(orchestrated(X=x), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(orchestrate_program(stitched, "greedy")(X=x), want, rtol=1e-4, atol=1e-4)
    assert len(raced) == 2 and planned[-1][3] == ("greedy",)


def test_definitions_of_weights_alone_are_evaluated_once_and_read_as_weights(tmp_path, monkeypatch):
    """An exporter's Identity of a bias and a transposed weight: evaluated at optimize time, so
    the optimized program computes neither on a run; a definition that reads an input, or is an
    output, stays."""
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    shapes = {"X": (6, 5), "W": (4, 5), "B": (4,)}
    program = parse_program(
        "C = L j:4 ; B[j]\n"
        "T = L k:5, j:4 ; W[j, k] * 2\n"
        "Y = L i:6, j:4 ; S k:5 ; X[i, k] * T[k, j]\n"
        "Z = L i:6, j:4 ; Y[i, j] + C[j]\n"
        "return Z",
        shapes,
    )
    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((4, 5)).astype(np.float32), "B": rng.standard_normal(4).astype(np.float32)}
    folded, values = fold_weights(program, weights)
    assert [name for name, _ in folded.definitions] == ["Y", "Z"]
    np.testing.assert_array_equal(values["C"], weights["B"])
    np.testing.assert_allclose(values["T"], 2 * weights["W"].T)
    assert values["T"].dtype == np.float32
    # integer weights are data like any other here: a division of them folds to its fraction
    distances = parse_program(
        "D = L i:4 ; log(P[i] / 8)\nY = L i:4 ; X[0, i] + D[i]\nreturn Y", {"P": (4,), "X": (6, 5)}
    )
    values = fold_weights(distances, {"P": np.array([8, 12, 16, 24])})[1]
    np.testing.assert_allclose(values["D"], np.log([1.0, 1.5, 2.0, 3.0]))
    output_of_weights = parse_program("C = L j:4 ; B[j]\nreturn C", {"B": (4,)})
    assert fold_weights(output_of_weights, weights)[0] == output_of_weights  # an output is computed
    optimized = optimize_program(program, weights, max_depth=1)
    assert optimized.inputs == {"X": (6, 5)}
    assert [sub.name for sub in optimized.subprograms] == ["Z"]  # T, Y and C: no subprograms of their own
    per_run = [step.kernel.expr for step in optimized.program.steps if not step.kernel.weight_only]
    assert not {"W", "B"} & {name for expr in per_run for name in tensor_shapes(expr)}  # not 2 * W on every run
    x = rng.standard_normal((6, 5))
    np.testing.assert_allclose(optimized(X=x), evaluate(program, {"X": x, **weights}), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_depth", [None, 0])
def test_every_kernel_names_the_weights_it_reads_searched_or_as_written(max_depth, tmp_path, monkeypatch):
    """A kernel's weights are timed cold (a model streams each weight from memory once a run)
    and may be laid out once by its implementation; a kernel as written (no search, or the
    derivation's identity) that did not name them was timed on a weight in cache."""
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    shapes = {"X": (6, 5), "W": (5, 4), "B": (4,)}
    program = parse_program(
        "H = L i:6, j:4 ; S k:5 ; X[i, k] * W[k, j]\nY = L i:6, j:4 ; tanh(H[i, j] + B[j])\nreturn Y", shapes
    )
    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((5, 4)), "B": rng.standard_normal(4)}
    optimized = optimize_program(program, weights, max_depth=max_depth)
    for step in optimized.program.steps:
        read = set(tensor_shapes(step.kernel.expr))
        assert step.kernel.weights == read & set(weights) | (read & set(optimized.program.constants))
    x = rng.standard_normal((6, 5))
    np.testing.assert_allclose(optimized(X=x), evaluate(program, {"X": x, **weights}), rtol=1e-4, atol=1e-4)


def test_ctrl_c_keeps_what_was_derived_and_runs_the_rest_as_written(tmp_path, monkeypatch):
    """Ctrl-C in the second subprogram's search: the first stays derived, the second and any
    later one run as their identity kernel, post-processing is skipped, and the stitched
    program still computes the model."""
    import importlib

    derive_module = importlib.import_module("rewriter.pipeline.program")  # where optimize_program calls derive
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    shapes = {"X": (6, 5), "W1": (5, 5), "W2": (5, 3)}
    program = parse_program(
        "H = L i:6, j:5 ; S k:5 ; X[i, k] * W1[k, j]\n"
        "R = L i:6, j:5 ; relu(H[i, j])\n"
        "Y = L i:6, j:3 ; S k:5 ; R[i, k] * W2[k, j]\n"
        "return Y",
        shapes,
    )
    calls, derive = [], derive_module.derive

    def interrupted_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return derive(*args, **kwargs)

    monkeypatch.setattr(derive_module, "derive", interrupted_second)
    rng = np.random.default_rng(0)
    weights = {"W1": rng.standard_normal((5, 5)), "W2": rng.standard_normal((5, 3))}
    optimized = optimize_program(program, weights, max_depth=1)
    assert [(s.name, s.state) for s in optimized.subprograms] == [("R", "derived"), ("Y", "identity")]
    assert optimized.orchestration.method == "none"  # interrupted: the stitched kernels as derived
    x = rng.standard_normal((6, 5))
    np.testing.assert_allclose(optimized(X=x), evaluate(program, {"X": x, **weights}), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["srcnn", "gcn", "infogan", "dcgan", "resnet18", "csrnet", "longformer"])
def test_every_zoo_model_optimizes_saves_and_runs_in_a_new_process(name, tmp_path):
    """Issue acceptance, small sizes: each zoo model optimized end to end (search depth 1), saved,
    then loaded and run by ``rewriter run`` in a fresh process, matching onnxruntime. Slow (SRCNN
    46 s, GCN 121 s on a 2-core AMD Zen 3), so with ``RUN_SLOW=1``; the default run does this for
    SRCNN in ``test_cli``. The optimizer shares the suite's kernel cache, as a user's runs share theirs;
    ``run`` gets an empty one, so everything it runs comes from the saved program."""
    pytest.importorskip("onnx")
    from rewriter import zoo
    from rewriter.frontends.onnx import load_onnx

    out = tmp_path / name
    optimize = [
        sys.executable,
        "-m",
        "rewriter.cli",
        "optimize",
        name,
        "--small",
        "--max-depth",
        "1",
        "--subprogram-time-limit",
        "5",
        "--out",
        str(out),
    ]
    subprocess.run(optimize, check=True, capture_output=True)
    model = load_onnx(zoo.build(name, small=True))
    ((input_name, shape),) = model.inputs.items()
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    run = [
        sys.executable,
        "-m",
        "rewriter.cli",
        "run",
        str(out),
        "--input",
        f"{input_name}={tmp_path / 'x.npy'}",
        "--out",
        str(tmp_path / "y.npy"),
    ]
    subprocess.run(run, check=True, env=dict(os.environ, REWRITER_CACHE=str(tmp_path / "empty")), capture_output=True)
    want = model.original({input_name: x})[model.outputs[0]]
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-3, atol=1e-3 * scale)


def test_the_longformer_unfold_fuses_into_its_band_products():
    """The zoo's Longformer writes each band as Pad + 2W+1 Slices + Concat (ONNX has no band
    operator). The eager rules merge each unfold into one affine read (a view writing 5x what
    it reads), and such views fuse into the band products that read them: the G2BMM and GBMM
    read the K and V projections with the band's row index ``b1+2*i-4`` (dilation 2, W = 2),
    and no slice, pad or concat is left."""
    pytest.importorskip("onnx")
    from rewriter import zoo
    from rewriter.frontends.onnx import load_onnx

    model = load_onnx(zoo.build("longformer", small=True))
    fused = fuse_elementwise(model.program)
    assert not [n for n, _ in fused.definitions if n.startswith(("slice", "pad", "concat"))]
    assert str(fused).count("+2*i-4") == 1 and str(fused).count("+2*k-4") == 1  # scores: slot i; context: slot k
    feeds = model.feeds({"input": np.random.default_rng(0).standard_normal((1, 16, 8))})
    np.testing.assert_allclose(evaluate(fused, feeds), evaluate(model.program, feeds), rtol=1e-9, atol=1e-9)


def test_a_reshape_that_only_drops_a_dimension_of_one_fuses_into_the_product_reading_it():
    """ViT's query, key and value products each read a 197x768 copy of their 1x197x768 input:
    the copy moves nothing (same memory, same order), so the product reads the input itself and
    still matches as a matmul; a transposing copy stays, for the operators to match."""
    shapes = {"X": (1, 6, 4), "W": (4, 3)}
    program = parse_program(
        "R = L i:6, k:4 ; X[0, i, k]\nY = L i:6, j:3 ; S k:4 ; R[i, k] * W[k, j]\n"
        "T = L k:4, i:6 ; X[0, i, k]\nZ = L i:6, j:3 ; S k:4 ; T[k, i] * W[k, j]\nreturn Y, Z",
        shapes,
    )
    fused = fuse_elementwise(program)
    definitions = dict(fused.definitions)
    assert "R" not in definitions and "T" in definitions
    assert str(definitions["Y"]) == "L i:6, j:3 ; S k:4 ; X[0, i, k] * W[k, j]"
    assert match_operator(definitions["Y"])[0] == "matmul"
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s) for n, s in shapes.items()}
    np.testing.assert_allclose(evaluate(fused, feeds), evaluate(program, feeds), rtol=1e-12)


def test_parallel_definitions_merge_into_a_batched_one_where_it_costs_less():
    """Q, K and V projections share their input: one batched definition computes all three and
    each is read back as a view, where the cost says the batched one is cheaper."""
    shapes = {"X": (6, 4), "Wq": (4, 4), "Wk": (4, 4), "Wv": (4, 4)}
    program = parse_program(
        "Q = L i:6, j:4 ; S k:4 ; X[i, k] * Wq[k, j]\n"
        "K = L i:6, j:4 ; S k:4 ; X[i, k] * Wk[k, j]\n"
        "V = L i:6, j:4 ; S k:4 ; X[i, k] * Wv[k, j]\n"
        "Y = L i:6, j:4 ; Q[i, j] * K[i, j] + V[i, j]\n"
        "return Y",
        shapes,
    )
    batched = merge_parallel(program, costs=lambda exprs: [1.0] * len(exprs))  # one batched kernel for three
    assert [n for n, _ in batched.definitions] == ["Q_K_etc", "Q", "K", "V", "Y"]
    assert batched.definitions[0][1].shape == (3, 6, 4)
    feeds = {name: np.random.default_rng(0).standard_normal(shape) for name, shape in shapes.items()}
    np.testing.assert_allclose(evaluate(batched, feeds), evaluate(program, feeds), rtol=1e-9, atol=1e-9)
    flops = lambda exprs: [float(np.prod(e.shape)) for e in exprs]  # noqa: E731  (a batched one: the three's)
    assert merge_parallel(program, costs=flops) == program


def test_each_layers_parallel_definitions_merge_with_each_other_and_not_across_layers():
    """Two layers, each with a gate and an up projection of its own input (a decoder's MLP):
    each pair becomes one batched definition; the second layer's pair does not join the first's
    (its input is computed later), nor does a pair that differs in a computed tensor."""
    shapes = {"X": (4, 4), "G1": (4, 4), "U1": (4, 4), "G2": (4, 4), "U2": (4, 4)}
    program = parse_program(
        "A1 = L i:4, j:4 ; S k:4 ; X[i, k] * G1[k, j]\n"
        "B1 = L i:4, j:4 ; S k:4 ; X[i, k] * U1[k, j]\n"
        "H = L i:4, j:4 ; A1[i, j] * B1[i, j]\n"
        "A2 = L i:4, j:4 ; S k:4 ; H[i, k] * G2[k, j]\n"
        "B2 = L i:4, j:4 ; S k:4 ; H[i, k] * U2[k, j]\n"
        "C = L i:4, j:4 ; S k:4 ; A2[i, k] * G2[k, j]\n"
        "D = L i:4, j:4 ; S k:4 ; B2[i, k] * G2[k, j]\n"
        "Y = L i:4, j:4 ; C[i, j] + D[i, j]\n"
        "return Y",
        shapes,
    )
    merged = merge_parallel(program, costs=lambda exprs: [1.0] * len(exprs))
    names = [n for n, _ in merged.definitions]
    assert names == ["A1_B1", "A1", "B1", "H", "A2_B2", "A2", "B2", "C", "D", "Y"]
    assert all(merged_expr.shape == (2, 4, 4) for n, merged_expr in merged.definitions if n in ("A1_B1", "A2_B2"))
    feeds = {name: np.random.default_rng(1).standard_normal(shape) for name, shape in shapes.items()}
    np.testing.assert_allclose(evaluate(merged, feeds), evaluate(program, feeds), rtol=1e-9, atol=1e-9)


def test_layers_equal_up_to_tensor_names_are_weighed_once_and_merge_alike():
    """Two layers' Q, K and V (equal but for their tensors' names): the first layer's batched
    definition is weighed against its three members in one call, measured together, and the
    second layer takes that decision without being measured, though a measurement now would
    say otherwise (a noisy machine's second opinion)."""
    layer = (
        "Q{n} = L i:6, j:4 ; S k:4 ; X{n}[i, k] * Wq{n}[k, j]\n"
        "K{n} = L i:6, j:4 ; S k:4 ; X{n}[i, k] * Wk{n}[k, j]\n"
        "V{n} = L i:6, j:4 ; S k:4 ; X{n}[i, k] * Wv{n}[k, j]\n"
        "X{m} = L i:6, j:4 ; Q{n}[i, j] * K{n}[i, j] + V{n}[i, j]\n"
    )
    shapes = {f"{w}{n}": (4, 4) for w in ("Wq", "Wk", "Wv") for n in (1, 2)} | {"X1": (6, 4)}
    program = parse_program(layer.format(n=1, m=2) + layer.format(n=2, m=3) + "return X3", shapes)
    asked = []

    def costs(exprs):  # the batched one cheaper the first time only
        asked.append([e.shape for e in exprs])
        return [1.0 if len(asked) == 1 else 9.0] + [1.0] * (len(exprs) - 1)

    merged = merge_parallel(program, costs=costs)
    assert asked == [[(3, 6, 4), (6, 4), (6, 4), (6, 4)]]
    batched = [n for n, e in merged.definitions if e.shape == (3, 6, 4)]
    assert batched == ["Q1_K1_etc", "Q2_K2_etc"]
    feeds = {name: np.random.default_rng(2).standard_normal(shape) for name, shape in shapes.items()}
    np.testing.assert_allclose(evaluate(merged, feeds), evaluate(program, feeds), rtol=1e-9, atol=1e-9)


def test_nchw_tensors_are_stored_in_blocks_of_the_vector_then_of_half_where_it_does_not_divide():
    """The output C too, then copied back to its layout once (the copy is not blocked again)."""
    program = parse_program(
        "A = L n:1, c:32, h:4, w:4 ; relu(X[n, c, h, w])\n"
        "B = L n:1, g:24, h:4, w:4 ; S c:32 ; A[n, c, h, w] * V[g, c]\n"
        "C = L n:1, g:24, h:4, w:4 ; relu(B[n, g, h, w])\n"
        "return C",
        {"X": (1, 32, 4, 4), "V": (24, 32)},
    )
    blocked = blocked_layouts(program, lanes=16)
    assert [(n, e.shape) for n, e in blocked.definitions] == [
        ("A_16c", (1, 2, 4, 4, 16)),
        ("B_8c", (1, 3, 4, 4, 8)),
        ("C_8c", (1, 3, 4, 4, 8)),
        ("C", (1, 24, 4, 4)),
    ]
    assert str(dict(blocked.definitions)["C"]) == "L n:1, g:24, h:4, w:4 ; C_8c[n, g/8, h, w, g%8]"
    assert blocked_layouts(program, lanes=0) == program  # no vector to fill: as written
    rng = np.random.default_rng(0)
    x, v = rng.standard_normal((1, 32, 4, 4)), rng.standard_normal((24, 32))
    np.testing.assert_allclose(evaluate(blocked, {"X": x, "V": v}), evaluate(program, {"X": x, "V": v}))


def test_a_program_optimized_in_blocked_layouts_computes_what_it_did_and_auto_keeps_the_faster(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    shapes = {"X": (1, 8, 6, 6), "W": (16, 8, 3, 3), "V": (16, 16)}
    program = parse_program(
        "A = L n:1, f:16, h:6, w:6 ; relu({ L n:1, f:16, h:6, w:6 ; S c:8, r:3, s:3 ; "
        "X[n, c, h+r-1, w+s-1] * W[f, c, r, s] }[n, f, h, w])\n"
        "B = L n:1, g:16, h:6, w:6 ; S c:16 ; A[n, c, h, w] * V[g, c]\n"
        "return B",
        shapes,
    )
    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((16, 8, 3, 3)), "V": rng.standard_normal((16, 16))}
    x = rng.standard_normal((1, 8, 6, 6))
    want = evaluate(program, {"X": x, **weights})
    blocked = optimize_program(program, weights, max_depth=1, layout="blocked")
    shapes = [s.shape for k in blocked.program.kernels for s in distinct_scopes(k.expr)]
    assert any(len(shape) == 5 and shape[-1] in (8, 16) for shape in shapes)  # A's channels in blocks, alone or fused
    np.testing.assert_allclose(blocked(X=x), want, rtol=1e-4, atol=1e-4)
    auto = optimize_program(program, weights, max_depth=1)
    assert auto.orchestration.figures["layout"] in ("blocked", "as written")
    assert set(auto.orchestration.figures["layouts_ms"]) == {"blocked", "as written"}
    assert f"kept {auto.orchestration.figures['layout']}" in auto.orchestration.describe()
    np.testing.assert_allclose(auto(X=x), want, rtol=1e-4, atol=1e-4)
    # a blocked program that computes something else is left out before the race
    written = optimize_program(program, weights, max_depth=1, layout="as written")
    wrong = optimize_program(program, {**weights, "V": -weights["V"]}, max_depth=1, layout="blocked")
    with pytest.warns(RuntimeWarning, match="the blocked program computes B unlike the program as written"):
        assert _faster_layout({"blocked": wrong, "as written": written}) is written
