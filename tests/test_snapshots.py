"""Snapshots: texts whose every change should be seen in review.

* the derivation paths (``Derivation.explain``) of every candidate that ``derive`` returns for
  the public cases at a small depth, with the reference backend: it ranks candidates by the
  analytic stand-in, so the texts do not depend on this machine's timings;
* the scheduled TIR of a few generated kernels (``TvmKernel.listing``), with the vector width
  fixed so that it does not depend on this CPU.

Each test compares its text with ``tests/snapshots/<name>.txt`` and shows a diff when they
differ. After a deliberate change, ``UPDATE_SNAPSHOTS=1 python3 -m pytest tests/test_snapshots.py``
rewrites the files; review their diff like code.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from rewriter import derive, parse
from rewriter.cases import CASES

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


def assert_snapshot(name: str, text: str) -> None:
    """``text`` equals the stored snapshot ``name`` (``UPDATE_SNAPSHOTS=1``: store it instead)."""
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no snapshot {path.name}: run with UPDATE_SNAPSHOTS=1 to write it", pytrace=False)
    stored = path.read_text()
    if stored != text:
        diff = difflib.unified_diff(
            stored.splitlines(keepends=True), text.splitlines(keepends=True), f"{path.name} (stored)", "now"
        )
        pytest.fail(
            f"{path.name} changed (UPDATE_SNAPSHOTS=1 rewrites it after review):\n{''.join(diff)}", pytrace=False
        )


def test_a_changed_text_fails_with_a_diff_and_the_update_mode_rewrites_it(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "SNAPSHOTS", tmp_path)
    monkeypatch.delenv("UPDATE_SNAPSHOTS", raising=False)
    with pytest.raises(pytest.fail.Exception, match="no snapshot x.txt"):
        assert_snapshot("x", "a\nb\n")
    monkeypatch.setenv("UPDATE_SNAPSHOTS", "1")
    assert_snapshot("x", "a\nb\n")
    monkeypatch.delenv("UPDATE_SNAPSHOTS")
    assert_snapshot("x", "a\nb\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)x.txt changed .*\n-b\n\+c\n"):
        assert_snapshot("x", "a\nc\n")
    assert (tmp_path / "x.txt").read_text() == "a\nb\n"


# --------------------------------------------------------------------------------------------
# Derivation paths

# depth per case: each derivation takes a few seconds with the reference backend
DERIVATIONS = {"conv3x3": 2, "convtranspose": 3, "g2bmm": 3, "matmul_chain": 3}


@pytest.mark.parametrize("case", sorted(DERIVATIONS))
def test_derivation_paths_of_the_public_cases(case):
    depth = DERIVATIONS[case]
    derivation = derive(CASES[case].expression(), max_depth=depth, backend="reference", time_limit=None)
    sections = [
        f"# candidate {k} of {len(derivation.candidates)}\n{derivation.explain(candidate)}"
        for k, candidate in enumerate(derivation.candidates, 1)
    ]
    header = (
        f"# derive(CASES[{case!r}].expression(), max_depth={depth}, backend='reference'): every candidate, best first\n"
    )
    assert_snapshot(f"derive_{case}_depth{depth}", header + "\n\n".join(sections) + "\n")


# --------------------------------------------------------------------------------------------
# Generated kernels

# one of each schedule path: padded stencil reads with a register tile, a blocked transposition,
# and vector lanes along a summation (the reads are contiguous along j, not along i)
KERNELS = {
    "stencil": ("L h:6, w:16 ; S r:3, s:3 ; A[h+r-1, w+s-1] * K[r, s]", {"A": (6, 16), "K": (3, 3)}),
    "transpose": ("L j:16, i:32 ; A[i, j]", {"A": (32, 16)}),
    "row_sums_of_exp": ("L i:4 ; S j:64 ; exp(A[i, j])", {"A": (4, 64)}),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_generated_kernel_text(name):
    from codegen import Schedule, compile_scope

    text, shapes = KERNELS[name]
    kernel = compile_scope(parse(text, shapes), schedule=Schedule(vector=8))
    assert_snapshot(f"kernel_{name}", f"# {text}, schedule Schedule(vector=8)\n{kernel.listing().rstrip()}\n")
