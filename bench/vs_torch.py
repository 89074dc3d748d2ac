"""The derived program against PyTorch (eager and torch.compile) and TVM on the original expression.

    python3 bench/vs_torch.py [--cases conv3x3,convtranspose,conv5x5,g2bmm] [--depth 3]
                              [--time-limit 120] [--rounds 15] [--tune 0]

For each public case: ``derive`` from the naive expression (cpu backend: compiled, verified,
measured), the best program bound to the case's weights; PyTorch eager and ``torch.compile`` on
the same computation in PyTorch's own layouts (written here by hand: this is the baseline, not the
engine); and TVM compiling the original expression as one kernel (the identity candidate). All
four are checked against ``evaluate`` and timed in one process, interleaved round by round, in
float32. Writes bench/results/vs_torch.json and prints medians and ratios.

Three thread pools share the cores here (PyTorch's OpenMP, numpy's OpenBLAS, TVM's): each one
spinning after its call steals the next library's cores, which doubled PyTorch's conv3x3 time
in a first run. So PyTorch's pool is told to sleep when idle and numpy's and TVM's take the
project's idle policy (``rewriter._threads``, set below, before they load), and each round
calls every function twice, timing the second call.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rewriter._threads  # noqa: E402, F401, I001  (the idle policy, before numpy and TVM load)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
from torch_cases import to_case_layout, torch_version  # noqa: E402

from codegen import CpuBackend, compile_scope  # noqa: E402
from codegen.measure import race_in_turns  # noqa: E402
from codegen.program import WHOLE_RACE_ROUNDS, in_one_pool, in_place_times, outside_kernels  # noqa: E402
from rewriter import derive, evaluate  # noqa: E402
from rewriter.cases import CASES  # noqa: E402
from rewriter.pipeline import optimize_program, orchestrations, runners_up_raced  # noqa: E402

WEIGHTS = {"conv3x3": ("K",), "convtranspose": ("K",), "conv5x5": ("K",), "g2bmm": ()}


def interleaved(functions: dict, rounds: int) -> dict:
    """Median seconds per function, timed round-robin so drifts hit every one alike."""
    for fn in functions.values():  # warm up (and trigger torch.compile)
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            fn()  # the first call after another library's pays for its threads waking up
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired(functions: dict, max_seconds: float = 30.0) -> dict:
    """Each function's time over the first one's in the same round, as ``[low, median, high]``
    (columns ``vs_NAME_paired``, and ``paired_rounds``):
    the median of those ratios and the interval that holds the true one at 95%
    (``race_in_turns``: in turns, each round in another order, for ``max_seconds``, and at
    least ``WHOLE_RACE_ROUNDS`` rounds, however the intervals lie before: until the 87th stop
    the rounds stopped where every interval first said which side of 1 it lay, looked at
    after 32 rounds and each doubling, and BERT's BLP and greedy programs, one program (the
    same kernels, in one pool), came out 1.017x apart (1.0007-1.051) after 32 rounds), and each
    one's median ms in those rounds (``paired_ms``: a ratio moves where one side slows more
    than the other in a state of the machine, and these say which side did). Each timed
    call follows an untimed one (another library's threads waking). A column of medians of
    their own moves with the machine's slow spells (seconds long, a third slower on the Zen 4
    of the 74th stop); a ratio taken a moment apart does not, unless the state slows one side
    more than the other. Above 1: slower than the first. A function "copy" (ours again, in
    its pool of buffers) is the control: its interval is what the rounds cannot tell from
    nothing, which a difference must clear to be one (BERT at 32 tokens, a Zen 3, 88th
    stop: copies of one program 0.9995-1.0015x apart in races of 90 s)."""
    first = next(iter(functions))
    race = race_in_turns(
        functions, first, min_rounds=WHOLE_RACE_ROUNDS, max_seconds=max_seconds, warm_calls=1, decide=False
    )
    columns = {
        f"vs_{name}_paired": [round(r, 4) for r in ratio] for name, ratio in race.ratios.items() if name != first
    }
    return columns | {
        "paired_rounds": race.rounds,
        "paired_ms": {k: round(v * 1e3, 3) for k, v in race.seconds.items()},
    }


def kernel_sums(compiled, rounds: int = 10) -> dict:
    """A compiled program's kernel medians summed, in ms: as the optimizer recorded them
    ("alone": as recorded, timed on their own, or where a program ran them: the BLP's trial
    programs, the races of implementations), and timed where this program runs them
    (``in_place_times``: every call timed where it runs, compiled kernels by the native loop's
    clock, whole runs on zeros, the first left out);
    those in-place times by implementation (``by_implementation``: kernels, ms, GFLOP/s);
    and a whole run's time over its kernels' summed in the run after it, as ``[low, median,
    high]`` (``outside_kernels``: what a run spends outside its kernels, taken a moment apart,
    which a slow spell of the machine does not move; a median of whole runs set over the sum of
    in-place medians did)."""
    per_step = in_place_times([compiled], rounds)[0]
    in_place = sum(statistics.median(s) for s in per_step if s)
    shares = compiled.by_implementation([statistics.median(s) if s else None for s in per_step])
    return {
        "kernels_alone_ms": round(compiled.cost * 1e3, 3),
        "kernels_in_place_ms": round(in_place * 1e3, 3),
        # where the in-place time lies: what orchestration, which fuses generated kernels, can reach
        "in_place_by_impl": {
            g.impl: {"kernels": g.kernels, "ms": round(g.seconds * 1e3, 3), "gflops": round(g.gflops, 1)}
            for g in shares
        },
        "whole_over_kernels": [round(r, 4) for r in outside_kernels(compiled)],
    }


def write_rows(out: Path, rows: list) -> None:
    """``rows`` as JSON at ``out``, written whole to a temporary file first and renamed."""
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(rows, indent=1))
    partial.replace(out)


def greedy_and_orchestrated(program, weights, **options) -> tuple[dict, dict]:
    """A whole program optimized once (derived, stitched, its subprograms raced against their
    runners-up where they run), then orchestrated both ways from one set of plans
    (``orchestrations``): Korch's BLP ("blp", what ``optimize_program`` does by default) and the
    greedy baseline ("greedy", the plan the BLP's was settled on), each kept on the same
    end-to-end race; so the two differ in what the BLP adds alone. The two run in one set of
    buffers and read one copy of each laid-out weight (``in_one_pool``, as ``race_whole`` runs
    the programs it races), so that their paired rounds compare plans, not where each
    program's memory happens to lie (DESIGN.md, "Measuring"). A third, "copy", is the BLP's
    program again in that pool: raced against ours in the paired rounds, it shows what they
    cannot tell apart. Returns the programs and the seconds each step took."""
    start = time.perf_counter()
    stitched = optimize_program(program, weights, orchestration="none", **options)
    stitched = runners_up_raced(stitched, options.get("backend", "cpu"))
    seconds = {"derive": time.perf_counter() - start}
    start = time.perf_counter()
    programs = orchestrations(stitched, ("blp", "greedy"), options.get("backend", "cpu"))
    seconds["orchestrate"] = time.perf_counter() - start
    programs["copy"] = programs["blp"]  # ours again, the paired rounds' control (``paired``)
    pooled = in_one_pool({method: optimized.program for method, optimized in programs.items()})
    return {method: replace(optimized, program=pooled[method]) for method, optimized in programs.items()}, seconds


# the BLP's figures a row keeps ("started": HiGHS began from the greedy plan)
BLP_FIGURES = (
    "candidates",
    "seeded",
    "measured",
    "refused",
    "variables",
    "constraints",
    "solve_s",
    "gap",
    "started",
    "retimed",
    "resolves",
)


def orchestration_columns(programs: dict, seconds: dict) -> dict:
    """The result row's orchestration figures: time, kernels and the BLP's size and solve time."""
    figures = programs["blp"].orchestration.figures
    return {
        "optimize_s": round(seconds["derive"] + seconds["orchestrate"], 1),
        "orchestrate_s": round(seconds["orchestrate"], 1),  # both plans, from one set
        "kernels": len(programs["blp"].program.kernels),
        "greedy_kernels": len(programs["greedy"].program.kernels),
        "kept": programs["blp"].orchestration.method,  # the BLP's plan, or the greedy one where faster whole
        "end_to_end_ms": figures.get("end_to_end_ms"),
        "end_to_end_vs": figures.get("end_to_end_vs"),  # each plan's time over the greedy one's, round by round
        "end_to_end_rounds": figures.get("end_to_end_rounds"),
        # a plan's end-to-end rounds pooled with its settling's races of the same two: rounds, low, median, high
        "end_to_end_pooled": figures.get("end_to_end_pooled"),
        "layout": figures.get("layout", "as written"),  # NCHW tensors' channels in blocks, or as written
        "layouts_ms": figures.get("layouts_ms"),  # the stitched programs' whole runs, in turns
        "layouts_vs": figures.get("layouts_vs"),  # the blocked one's over the one as written, round by round
        "shared_kernels": len(programs["blp"].orchestration.shared),
        "recomputed": len(programs["blp"].orchestration.recomputed),
        **{f"blp_{k}": figures.get(k) for k in BLP_FIGURES},
        # the BLP's plan and the greedy one's in the BLP's terms (kernels timed where trial programs ran them, summed)
        **{f"blp_{k}_ms": round(figures[k] * 1e3, 3) for k in ("seconds", "greedy_seconds") if k in figures},
        # each plan taken into the one before it where whole runs say so (``settled``): regions, groups raced, taken
        **{key: figures.get(key) for key in ("settled_greedy", "settled_blp")},
    }


def run(name: str, depth: int, time_limit: float, rounds: int, tune: int = 0) -> dict:
    expr = CASES[name].expression()
    rng = np.random.default_rng(0)
    inputs = {n: rng.uniform(-1, 1, s).astype(np.float32) for n, s in CASES[name].shapes.items()}
    expected = evaluate(expr, inputs)
    start = time.perf_counter()
    derivation = derive(
        expr, max_depth=depth, time_limit=time_limit, weights=WEIGHTS[name], backend=CpuBackend(tune=tune)
    )
    derive_s = time.perf_counter() - start
    best = derivation.best.bind({w: inputs[w] for w in WEIGHTS[name]})
    activations = {n: v for n, v in inputs.items() if n not in WEIGHTS[name]}
    original = compile_scope(expr)
    fn, args = torch_version(name, inputs)
    compiled_fn = torch.compile(fn)
    functions = {
        "derived": lambda: best(**activations),
        "tvm_original": lambda: original(**inputs),
        "torch_eager": lambda: fn(*args),
        "torch_compile": lambda: compiled_fn(*args),
    }
    scale = float(np.abs(expected).max())
    for label, f in functions.items():
        got = np.asarray(f())
        got = to_case_layout(name, got) if label.startswith("torch") else got
        error = float(np.abs(got - expected).max()) / scale
        assert error < 1e-3, f"{name}: {label} disagrees with the reference ({error:.2e})"
    with torch.no_grad():
        medians = interleaved(functions, rounds)
    return {
        "case": name,
        "derive_s": round(derive_s, 1),
        "tune": tune,
        "kernels": [k.kind for k in best.kernels],
        "listing": best.listing(),
        **{f"{k}_ms": round(v * 1e3, 3) for k, v in medians.items()},
        "vs_torch_eager": round(medians["torch_eager"] / medians["derived"], 2),
        "vs_torch_compile": round(medians["torch_compile"] / medians["derived"], 2),
        "vs_tvm_original": round(medians["tvm_original"] / medians["derived"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="conv3x3,convtranspose,conv5x5,g2bmm")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tune", type=int, default=0, help="TVM schedules raced per kernel (derive's tune)")
    args = parser.parse_args()
    rows = []
    print(
        f"{'case':<14}{'derived ms':>11}{'eager ms':>10}{'compile ms':>11}{'tvm ms':>9}{'x eager':>9}{'x compile':>10}{'x tvm':>7}  kernels"
    )
    for name in args.cases.split(","):
        row = run(name, args.depth, args.time_limit, args.rounds, args.tune)
        rows.append(row)
        print(
            f"{name:<14}{row['derived_ms']:>11}{row['torch_eager_ms']:>10}{row['torch_compile_ms']:>11}{row['tvm_original_ms']:>9}"
            f"{row['vs_torch_eager']:>9}{row['vs_torch_compile']:>10}{row['vs_tvm_original']:>7}  {'+'.join(row['kernels'])}",
            flush=True,
        )
    out = ROOT / "bench" / "results" / "vs_torch.json"
    write_rows(out, rows)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
