"""The console script: the main job (public cases) and expression evaluation."""

import os
import re
import subprocess
import sys

import numpy as np

from rewriter.cli import main


def test_cases_main_job_shows_every_case_and_one_in_full(capsys):
    assert main(["cases", "--show", "conv3x3"]) == 0
    out = capsys.readouterr().out
    for name in ("conv3x3", "convtranspose", "conv5x5", "g2bmm", "matmul_chain"):
        assert name in out
    assert "NO" not in out.split("conv3x3: ")[0]  # every case round-trips
    assert "L n:1, h:7, w:7, f:512 ; S c:512, r:3, s:3 ; A[n, h+r-1, w+s-1, c] * K[r, s, f, c]" in out


def test_eval_writes_the_result(tmp_path, capsys):
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    np.save(tmp_path / "a.npy", a)
    code = main(
        [
            "eval",
            "L i:3 ; S k:2 ; A[k, i]",
            "--shape",
            "A=2,3",
            "--input",
            f"A={tmp_path / 'a.npy'}",
            "--out",
            str(tmp_path / "y.npy"),
        ]
    )
    assert code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), a.sum(axis=0))


def test_errors_are_one_line_not_a_traceback(capsys):
    assert main(["eval", "L i:3 ; A[i, j]", "--shape", "A=3,3"]) == 2
    assert "unbound iterator 'j'" in capsys.readouterr().out
    assert main(["cases", "--show", "nope"]) == 2
    assert "unknown case 'nope'" in capsys.readouterr().out
    assert main(["eval", "L i:3 ; A[i]", "--shape", "A=three"]) == 2


def test_derive_lists_verified_candidates_and_explains_the_best(capsys):
    code = main(
        ["derive", "L i:4, j:5 ; S k:3 ; A[i, k] * B[k, j]", "--shape", "A=4,3", "--shape", "B=3,5", "--max-depth", "1"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "verified candidates" in out and "matmul" in out and "E1 = L i:4, j:5" in out


def test_optimize_a_zoo_model_then_run_and_explain_the_saved_program(tmp_path, capsys, monkeypatch):
    import pytest

    pytest.importorskip("onnx")
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "srcnn"
    assert main(["optimize", "srcnn", "--small", "--max-depth", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "srcnn: optimized" in printed and "total" in printed and "speedup" in printed
    assert {"model.json", "stats.jsonl", "measurements.sqlite", "onnx.json"} <= {p.name for p in out.iterdir()}
    x = np.random.default_rng(0).standard_normal((2, 1, 12, 12)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    # run in a new process with an empty kernel cache: everything it runs comes from the saved program
    run = ["run", str(out), "--input", f"input={tmp_path / 'x.npy'}", "--out", str(tmp_path / "y.npy")]
    empty = dict(os.environ, REWRITER_CACHE=str(tmp_path / "empty"))
    subprocess.run([sys.executable, "-m", "rewriter.cli", *run], check=True, env=empty, capture_output=True)
    from rewriter import zoo
    from rewriter.frontends.onnx import load_onnx

    want = load_onnx(zoo.build("srcnn", small=True)).run({"input": x})["output"]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-3, atol=1e-3)
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    explained = capsys.readouterr().out
    assert "== relu1" in explained  # conv1 fused into its activation
    # the kernel orchestration's figures (the BLP's plan, or the greedy one where it ran faster whole)
    assert re.search(r"== orchestration: (blp|greedy|none)", explained) and "BLP:" in explained
    # each figure on one line, however narrow the terminal (rich folds what is not soft-wrapped)
    assert re.search(r"BLP: \d+ variables, \d+ constraints, .* gap ", explained)
    # the stitched kernels, the last writing the model's output (how many there are is measured:
    # orchestration may make one kernel of several primitives of the small model)
    assert "as it runs" in explained and "output[2, 1, 12, 12] =" in explained.split("as it runs")[1]
    # its recorded time by implementation: shares of the whole, summing to it
    shares = re.findall(r"^  (\w+): (\d+) kernels, (\S+) ms \((\S+)%\)", explained.split("by implementation")[1], re.M)
    assert shares and sum(float(share) for *_, share in shares) == pytest.approx(100, abs=0.2)
    assert main(["compare", str(out), str(out), "--seconds", "1"]) == 0
    compared = capsys.readouterr().out
    median, low, high = map(
        float, re.search(r"B / A, \d+ rounds in turns: (\S+) \(95%: (\S+)-(\S+)\)", compared).groups()
    )
    assert low <= median <= high and f"A = {out}" in compared


def test_run_without_inputs_samples_a_models_integer_mask_as_0s_and_1s(tmp_path, capsys, monkeypatch):
    """``rewriter run DIR`` without ``--input`` samples the saved program's inputs as the
    optimizer's own check did: an integer input that no gather reads (an attention mask) holds
    0s and 1s, real inputs normal values; each is printed with what it holds."""
    import pytest

    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, save

    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    nodes = [
        helper.make_node("Cast", ["mask"], ["kept"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "kept"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]),
        helper.make_tensor_value_info("mask", TensorProto.INT64, [2, 8]),
    ]
    graph = helper.make_graph(nodes, "masked", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "masked.onnx")
    out = tmp_path / "out"
    assert main(["optimize", str(tmp_path / "masked.onnx"), "--max-depth", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mask: sampled, integers 0 to 1" in printed and "x: sampled, real values" in printed
    other = tmp_path / "other.onnx"  # another model: x alone, of another shape
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "other",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), other)
    assert main(["optimize", str(other), "--max-depth", "0", "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert main(["compare", str(out), str(tmp_path / "other")]) == 2
    refused = " ".join(capsys.readouterr().out.split())  # (the console wraps long lines)
    assert "take different inputs ({'x': (2, 8), 'mask': (2, 8)} against {'x': (2, 4)})" in refused


def test_optimize_refuses_a_model_it_cannot_read_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    assert main(["optimize", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "bad.onnx" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
