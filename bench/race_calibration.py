"""How often the settling takes a change that is not there (an A/A test), and how often it
takes a saving of known size.

    python3 bench/race_calibration.py DIR [--races 20] [--seconds 5]
        [--copies shared loaded] [--savings 0.003 0.01]

DIR is a program saved by ``rewriter optimize --out``. Each trial settles one change as the
orchestration does (``codegen.orchestrate.surely_faster``: whole runs of the program with the
change against the program as it stands, in turns, races of at most ``--seconds`` once past
their first ``WHOLE_RACE_ROUNDS`` rounds, 5 as the settling's ``SETTLE_S``). The kinds of
change, in turn:

- "shared" (A/A): a copy of the program, the same kernels and laid-out weights, as a settled
  change's program is (it shares the weights of the program it changes; the race runs both in
  its one pool of buffers). Taking it is taking a change that changes nothing.
- "loaded" (A/A): the directory loaded again, its kernels and weights loaded and laid out
  again, as separately prepared programs meet (the end-to-end race of the plans, ``rewriter
  compare``, a benchmark's columns); the race pools the weights the two hold alike
  (``in_one_pool``, since the 85th stop), so the copy differs in where its code lies.
- "saving F" (``--savings``): the program against itself with one kernel run again, a few
  times at most (into tensors nothing reads), the kernel and count whose measured times add
  up nearest to F of a run; the program is the change, a saving of that size.

Prints each trial's races and verdict and, per kind, how many changes were taken and how many
first races' intervals lay below 1, below the settling's margin and above 1, and how many were
undecided with their medians below the margin (raced again), with the range of their medians;
adds (or updates) one row per directory name and CPU in bench/results/race_calibration.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy before they load)

from codegen.measure import cpu_model  # noqa: E402
from codegen.orchestrate import SETTLE_MARGIN, SETTLE_S, surely_faster  # noqa: E402
from codegen.program import race_whole  # noqa: E402
from rewriter.pipeline import load_optimized  # noqa: E402

KINDS = ("shared", "loaded")


def copy_of(directory: Path, program, kind: str):
    """A second program that computes what ``program`` does, of ``kind``."""
    return replace(program, buffers={}) if kind == "shared" else load_optimized(directory).program


def run_again(program, fraction: float, run_seconds: float, most: int = 8):
    """``program`` with one of its kernels run again (up to ``most`` times) right after itself,
    into tensors nothing reads: the kernel and count whose measured times add up nearest to
    ``fraction`` of ``run_seconds``. Returns the copy (sharing the program's weights) and the
    added kernels' share of a run."""
    target = fraction * run_seconds
    timed = [s for s in program.steps if s.seconds and s.kernel.output not in program.constants]
    options = [(s, n) for s in timed for n in range(1, most + 1)]
    step, times = min(options, key=lambda o: (abs(o[0].seconds * o[1] - target), o[1]))
    again = [step.renamed({step.kernel.output: f"{step.kernel.output}_again{i}"}, program.dtype) for i in range(times)]
    at = program.steps.index(step) + 1
    slowed = replace(program, steps=[*program.steps[:at], *again, *program.steps[at:]], buffers={})
    return slowed, step.seconds * times / run_seconds


def summary(settled: list[tuple[bool, list]]) -> dict:
    """How many changes the settling took, and how many of its first races' intervals (low,
    median, high) lay below 1, below the margin, above 1, or reached past 1 with the median
    below the margin (undecided: raced again)."""
    ratios = [raced[0] for _, raced in settled]
    return {
        "races": len(ratios),
        "taken": sum(taken for taken, _ in settled),
        "below_1": sum(high < 1 for _, _, high in ratios),
        "below_margin": sum(high < 1 - SETTLE_MARGIN for _, _, high in ratios),
        "undecided": sum(high >= 1 and median < 1 - SETTLE_MARGIN for _, median, high in ratios),
        "above_1": sum(low > 1 for low, _, _ in ratios),
        "medians": [round(min(m for _, m, _ in ratios), 4), round(max(m for _, m, _ in ratios), 4)],
        "ratios": [[round(x, 4) for r in raced for x in r] for _, raced in settled],
    }


def settling(directory: Path, program, kind: str, slowed: dict, seconds: float) -> tuple[bool, list[tuple]]:
    """The settling's verdict on one change of ``kind`` (``surely_faster``, its races of at most
    ``seconds``): a copy against the program (A/A: no change), or the program against its
    slowed copy (a saving, ``slowed[kind]``). Returns whether it took the change, and the
    ratios of its races, one or two."""
    race = functools.partial(race_whole, max_seconds=seconds)
    if kind in slowed:
        return surely_faster(slowed[kind][0], program, race)
    return surely_faster(program, copy_of(directory, program, kind), race)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--races", type=int, default=20, help="changes settled in all, the kinds in turn")
    parser.add_argument(
        "--seconds", type=float, default=SETTLE_S, help="the longest one race runs past its first rounds"
    )
    parser.add_argument("--copies", nargs="*", choices=KINDS, default=list(KINDS), help="the A/A kinds raced")
    parser.add_argument("--savings", type=float, nargs="*", default=[], help="fractions of a run saved, raced too")
    args = parser.parse_args()
    if not args.copies and not args.savings:
        parser.error("nothing to race: give --copies, --savings or both")
    if args.races < len(args.copies) + len(args.savings):
        parser.error(f"--races {args.races} leaves a kind unraced: give at least one race per kind of change")
    program = load_optimized(args.directory).program
    whole = race_whole({"program": program}, "program", max_seconds=2).seconds["program"] if args.savings else 0.0
    slowed = {f"saving {f:g}": run_again(program, f, whole) for f in args.savings}
    kinds = args.copies + list(slowed)
    found: dict[str, list] = {kind: [] for kind in kinds}
    for number in range(args.races):
        kind = kinds[number % len(kinds)]
        taken, ratios = settling(args.directory, program, kind, slowed, args.seconds)
        found[kind].append((taken, ratios))
        raced = ", then ".join(f"{m:.4f} ({lo:.4f}-{hi:.4f})" for lo, m, hi in ratios)
        print(f"{number:>3} {kind:<14} {raced}{'  taken' if taken else ''}", flush=True)
    row = {"program": args.directory.name, "cpu": cpu_model(), "margin": SETTLE_MARGIN}
    for kind, settled in found.items():
        share = {"share": round(slowed[kind][1], 4)} if kind in slowed else {}
        row[kind] = {"seconds": args.seconds} | share | summary(settled)
        print(f"{kind}: { ({k: v for k, v in row[kind].items() if k != 'ratios'}) }")
    out = ROOT / "bench" / "results" / "race_calibration.json"
    key = lambda r: (r["program"], r["cpu"])  # noqa: E731
    rows = json.loads(out.read_text()) if out.exists() else []
    merged = next((r for r in rows if key(r) == key(row)), {}) | row  # the other kinds' rows kept
    write_rows(out, sorted([r for r in rows if key(r) != key(row)] + [merged], key=key))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
