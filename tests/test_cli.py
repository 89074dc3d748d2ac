"""The console script: the main job (public cases) and expression evaluation."""

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
    code = main(["eval", "L i:3 ; S k:2 ; A[k, i]", "--shape", "A=2,3", "--input", f"A={tmp_path / 'a.npy'}", "--out", str(tmp_path / "y.npy")])
    assert code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), a.sum(axis=0))


def test_errors_are_one_line_not_a_traceback(capsys):
    assert main(["eval", "L i:3 ; A[i, j]", "--shape", "A=3,3"]) == 2
    assert "unbound iterator 'j'" in capsys.readouterr().out
    assert main(["cases", "--show", "nope"]) == 2
    assert "unknown case 'nope'" in capsys.readouterr().out
    assert main(["eval", "L i:3 ; A[i]", "--shape", "A=three"]) == 2


def test_derive_lists_verified_candidates_and_explains_the_best(capsys):
    code = main(["derive", "L i:4, j:5 ; S k:3 ; A[i, k] * B[k, j]", "--shape", "A=4,3", "--shape", "B=3,5", "--max-depth", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "verified candidates" in out and "matmul" in out and "E1 = L i:4, j:5" in out
