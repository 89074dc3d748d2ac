"""How often a whole-run race calls a program faster or slower than itself (an A/A test).

    python3 bench/race_calibration.py DIR [--races 20] [--seconds 5]

DIR is a program saved by ``rewriter optimize --out``. Each race runs the program whole against
a copy of itself in turns (``codegen.program.race_whole``) for at most ``--seconds`` (5: the
settling's races, ``codegen.orchestrate.SETTLE_S``), the copy of one of two kinds, in turn:

- "shared": the same kernels and laid-out weights, buffers of its own. This is how the settling
  races a change (``adopted_where_faster``: the changed program shares the weights of the
  program it changes), so the count of intervals below ``1 - SETTLE_MARGIN`` is how often the
  settling would take a change that changes nothing.
- "loaded": the directory loaded again, its weights laid out again. This is how separately
  prepared programs meet: the end-to-end race of the plans, ``rewriter compare``, a benchmark's
  columns.

Every copy computes the same thing as the program, so every interval that excludes 1 is a
false verdict. Prints each race and, per kind, how many intervals lay below 1, below the
settling's margin and above 1, and the range of the median ratios; adds (or replaces) one row
per directory name and CPU in bench/results/race_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy before they load)

from codegen.measure import cpu_model  # noqa: E402
from codegen.orchestrate import SETTLE_MARGIN, SETTLE_S  # noqa: E402
from codegen.program import race_whole  # noqa: E402
from rewriter.pipeline import load_optimized  # noqa: E402

KINDS = ("shared", "loaded")


def copy_of(directory: Path, program, kind: str):
    """A second program that computes what ``program`` does, of ``kind``."""
    return replace(program, buffers={}) if kind == "shared" else load_optimized(directory).program


def summary(ratios: list[tuple[float, float, float]]) -> dict:
    """How many of the races' intervals (low, median, high) call the copy faster or slower."""
    return {
        "races": len(ratios),
        "below_1": sum(high < 1 for _, _, high in ratios),
        "below_margin": sum(high < 1 - SETTLE_MARGIN for _, _, high in ratios),
        "above_1": sum(low > 1 for low, _, _ in ratios),
        "medians": [round(min(m for _, m, _ in ratios), 4), round(max(m for _, m, _ in ratios), 4)],
        "ratios": [[round(x, 4) for x in r] for r in ratios],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--races", type=int, default=20, help="in all, the kinds in turn")
    parser.add_argument("--seconds", type=float, default=SETTLE_S, help="the longest one race runs")
    args = parser.parse_args()
    program = load_optimized(args.directory).program
    found: dict[str, list] = {kind: [] for kind in KINDS}
    for number in range(args.races):
        kind = KINDS[number % len(KINDS)]
        raced = race_whole(
            {"program": program, "copy": copy_of(args.directory, program, kind)}, "program", max_seconds=args.seconds
        )
        found[kind].append(raced.ratios["copy"])
        low, median, high = raced.ratios["copy"]
        print(f"{number:>3} {kind:<7} {raced.rounds:>4} rounds: copy / program {median:.4f} ({low:.4f}-{high:.4f})")
    row = {"program": args.directory.name, "cpu": cpu_model(), "seconds": args.seconds, "margin": SETTLE_MARGIN}
    row |= {kind: summary(ratios) for kind, ratios in found.items() if ratios}
    for kind in KINDS:
        if kind in row:
            figures = {k: v for k, v in row[kind].items() if k != "ratios"}
            print(f"{kind}: {figures}")
    out = ROOT / "bench" / "results" / "race_calibration.json"
    key = lambda r: (r["program"], r["cpu"])  # noqa: E731
    rows = [r for r in (json.loads(out.read_text()) if out.exists() else []) if key(r) != key(row)]
    write_rows(out, sorted(rows + [row], key=key))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
