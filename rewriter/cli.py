"""The ``rewriter`` command line.

rewriter cases [--show NAME]               parse, print and evaluate the public cases
rewriter eval "EXPRESSION" --shape A=2,3 --shape B=3,4 [--input A=a.npy] [--out y.npy]
rewriter derive "EXPRESSION" --shape A=1,7,7,512 --shape K=3,3,512,512 [--max-depth 3]
rewriter optimize MODEL.onnx|ZOO-NAME [--small] [--max-depth 3] [--orchestration blp|greedy|none]
                   [--layout auto|blocked|as-written] --out DIR
rewriter explain DIR                       the rule path of every subprogram, the orchestration
rewriter run DIR --input NAME=FILE.npy [--out y.npy]
rewriter compare DIR-A DIR-B [--seconds 30]  two saved programs' whole runs in turns: B / A
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from codegen.backend import CpuBackend, CudaBackend, ReferenceBackend
from codegen.measure import default_path
from codegen.program import WHOLE_RACE_ROUNDS, race_whole

from .cases import CASES, PUBLIC_CASES
from .frontends import load_onnx, zoo
from .ir import ExpressionError, parse, tensor_shapes
from .pipeline import derive, load_optimized, optimize_program
from .semantics import evaluate, sample_inputs


def cmd_cases(args, console: Console) -> int:
    if args.show and args.show not in CASES:
        raise ExpressionError(f"unknown case {args.show!r}; known: {', '.join(CASES)}")
    table = Table(title="Public cases: parse, print, evaluate")
    for column in ("case", "inputs", "output", "round-trip", "evaluate ms"):
        table.add_column(column, no_wrap=True)
    for case in PUBLIC_CASES:
        shapes = case.shapes
        expr = parse(case.text, shapes)
        round_trip = str(expr) == case.text and parse(str(expr), shapes) == expr
        inputs = sample_inputs((), shapes)
        start = time.perf_counter()
        out = evaluate(expr, inputs)
        elapsed = (time.perf_counter() - start) * 1e3
        inputs_text = " ".join(f"{n}{tuple(s)}".replace(" ", "") for n, s in shapes.items())
        table.add_row(
            case.name, inputs_text, str(out.shape).replace(" ", ""), "yes" if round_trip else "NO", f"{elapsed:.1f}"
        )
    console.print(table)
    if args.show:
        _show(CASES[args.show], console)
    return 0


def _show(case, console: Console) -> None:
    expr = case.expression()
    out = evaluate(expr, sample_inputs((), case.shapes))
    console.print(f"\n[bold]{case.name}[/bold]: {case.source}")
    console.print(f"  expression  {expr}", markup=False, highlight=False, soft_wrap=True)
    for name, shape in tensor_shapes(expr).items():
        console.print(f"  input       {name}: {shape}", markup=False)
    console.print(f"  output      shape {out.shape}, mean {out.mean():.4f}, std {out.std():.4f}")
    console.print(f"  first row   {np.array2string(out.reshape(-1)[:6], precision=3)}", markup=False)


def _parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, dims = text.partition("=")
    if not name or not dims:
        raise ExpressionError(f"--shape expects NAME=D1,D2,..., got {text!r}")
    try:
        return name, tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise ExpressionError(f"--shape {text!r}: dimensions must be integers") from None


def cmd_eval(args, console: Console) -> int:
    shapes = dict(_parse_shape(s) for s in args.shape)
    expr = parse(args.expression, shapes)
    inputs = sample_inputs((), shapes, args.seed)
    for item in args.input:
        name, _, path = item.partition("=")
        inputs[name] = np.load(path)
    out = evaluate(expr, inputs)
    console.print(str(expr), markup=False, highlight=False, soft_wrap=True)
    console.print(f"output shape {out.shape}, mean {out.mean():.6g}, std {out.std():.6g}")
    if args.out:
        np.save(args.out, out)
    return 0


def cmd_derive(args, console: Console) -> int:
    shapes = dict(_parse_shape(s) for s in args.shape)
    expr = parse(args.expression, shapes) if args.expression not in CASES else CASES[args.expression].expression()
    start = time.perf_counter()
    if (args.bundles or args.timings) and args.backend != "cuda":
        raise ExpressionError("--bundles and --timings go with --backend cuda")
    backends = {
        "cpu": lambda: CpuBackend(tune=args.tune),
        "reference": ReferenceBackend,
        "cuda": lambda: CudaBackend(bundles=args.bundles, timings=args.timings),
    }
    backend = backends[args.backend]()
    derivation = derive(expr, max_depth=args.max_depth, time_limit=args.time_limit, backend=backend)
    elapsed = time.perf_counter() - start
    console.print(f"{len(derivation.candidates)} verified candidates in {elapsed:.1f} s")
    if args.bundles:
        console.print(f"every compiled candidate written to {args.bundles} (python -m bundle measure it on a GPU)")
    measured = backend.measures
    table = Table()
    for column in ("#", "kernels", "measured ms" if measured else "estimated ms"):
        table.add_column(column, no_wrap=True)
    for rank, candidate in enumerate(derivation.candidates[: args.show], start=1):
        table.add_row(str(rank), " + ".join(k.kind for k in candidate.kernels), f"{candidate.cost * 1e3:.3f}")
    console.print(table)
    console.print(derivation.stats.table(), markup=False, highlight=False)
    console.print("\nbest:", markup=False)
    console.print(derivation.explain(derivation.best), markup=False, highlight=False, soft_wrap=True)
    if measured:
        console.print(derivation.best.listing(), markup=False, highlight=False, soft_wrap=True)
        if args.out:
            console.print(f"saved to {derivation.best.save(args.out)}")
    if derivation.rejected:
        console.print(f"[red]{len(derivation.rejected)} candidate(s) failed verification and were dropped[/red]")
    return 0


def cmd_optimize(args, console: Console) -> int:
    """OLLIE Algorithm 1 on a model: import, derive every subprogram, verify, save, report."""
    source = zoo.build(args.model, small=args.small) if args.model in zoo.NAMES else args.model
    model = load_onnx(source)
    console.print(f"{args.model}: {len(model.program.definitions)} operators, inputs {model.inputs}")
    table = Table(title=f"{args.model}: optimized")
    for column in ("subprogram", "state", "original ms", "optimized ms", "speedup", "kernels before/after", "search s"):
        table.add_column(column, no_wrap=True, justify="right" if column != "subprogram" else "left")

    # a bar over the subprograms (search, compilation and measurement) with the time remaining
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    bar = progress.add_task("deriving, compiling, measuring", total=None)

    def report(sub, index, total):
        speedup = sub.original_s / sub.optimized_s if sub.optimized_s else float("nan")
        progress.console.print(
            f"[{index + 1}/{total}] {sub.name}: {sub.state}, {sub.original_s * 1e3:.3f} -> "
            f"{sub.optimized_s * 1e3:.3f} ms ({'+'.join(sub.kernels)})",
            markup=False,
            highlight=False,
        )
        progress.update(bar, total=total, completed=index + 1)
        table.add_row(
            sub.name,
            sub.state,
            f"{sub.original_s * 1e3:.3f}",
            f"{sub.optimized_s * 1e3:.3f}",
            f"{speedup:.2f}x",
            f"{sub.kernels_before}/{sub.kernels_after}",
            f"{sub.search_s:.1f}",
        )

    with progress:
        optimized = optimize_program(
            model.program,
            model.weights,
            max_depth=args.max_depth,
            time_limit=args.time_limit,
            subprogram_time_limit=args.subprogram_time_limit,
            backend=CpuBackend(tune=args.tune),
            orchestration=args.orchestration,
            layout=args.layout.replace("-", " "),
            on_subprogram=report,
        )
    shapes = {model.names[name]: shape for name, shape in model.inputs.items()}
    integers = {model.names[name] for name in model.integers if name in model.names}  # masks: 0 and 1
    samples = sample_inputs(model.program.definitions, shapes, args.seed, integers)  # token ids in range, too
    feeds = {name: samples[model.names[name]] for name in model.inputs}
    want = model.original(feeds)
    got = optimized(**{model.names[n]: v for n, v in feeds.items()})
    got = got if isinstance(got, tuple) else (got,)
    for name, value in zip(model.outputs, got):
        error = float(np.abs(value - want[name]).max()) / max(1.0, float(np.abs(want[name]).max()))
        if error > 1e-3:
            raise ExpressionError(
                f"optimized {name} disagrees with the original model (relative error {error:.2e}); nothing saved"
            )
    for kernel in optimized.orchestration.shared:  # primitives that share a kernel (weights only: 0 s)
        speedup = f"{kernel.apart_seconds / kernel.seconds:.2f}x" if kernel.seconds else "-"
        table.add_row(
            f"{kernel.output}: {len(kernel.primitives)} primitives in one kernel",
            optimized.orchestration.method,
            f"{kernel.apart_seconds * 1e3:.3f}",
            f"{kernel.seconds * 1e3:.3f}",
            speedup,
            f"{len(kernel.primitives)}/1",
            "",
        )
    total_before = sum(s.original_s for s in optimized.subprograms)
    table.add_row(
        "total",
        "",
        f"{total_before * 1e3:.3f}",
        f"{optimized.cost * 1e3:.3f}",
        f"{total_before / optimized.cost:.2f}x",
        f"{sum(s.kernels_before for s in optimized.subprograms)}/{len(optimized.program.kernels)}",
        "",
    )
    console.print(table)
    if args.out:
        meta = {
            "model": args.model,
            "names": model.names,
            "inputs": model.inputs,
            "outputs": list(model.outputs),
            "integers": sorted(integers),  # what ``run`` samples as 0s and 1s without --input
        }
        out = optimized.save(args.out, extra={"onnx.json": json.dumps(meta, indent=1)}, measurements=default_path())
        console.print(f"saved to {out}")
    return 0


def _load_saved(directory):
    optimized = load_optimized(directory)
    meta_path = Path(directory) / "onnx.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return optimized, meta


def cmd_explain(args, console: Console) -> int:
    optimized, _ = _load_saved(args.directory)
    for sub in optimized.subprograms:
        console.print(f"== {sub.name} ({sub.state})", markup=False, highlight=False)
        console.print(sub.explain, markup=False, highlight=False, soft_wrap=True)
    console.print(f"== {optimized.orchestration.describe()}", markup=False, highlight=False, soft_wrap=True)
    console.print("== the stitched program, as it runs", markup=False, highlight=False)
    console.print(optimized.program.listing(), markup=False, highlight=False, soft_wrap=True)
    console.print("== where its recorded time lies, by implementation", markup=False, highlight=False)
    shares = optimized.program.by_implementation()
    total = sum(share.seconds for share in shares) or 1.0  # no recorded time: no shares to speak of
    for share in shares:
        rate = f", {share.gflops:.0f} GFLOP/s" if share.multiply_adds else ""
        console.print(
            f"  {share.impl}: {share.kernels} kernels, {share.seconds * 1e3:.3f} ms"
            f" ({share.seconds / total:.1%}){rate}",
            markup=False,
            highlight=False,
        )
    return 0


def cmd_run(args, console: Console) -> int:
    optimized, meta = _load_saved(args.directory)
    names = meta.get("names", {})
    inputs = {}
    for item in args.input:
        name, _, path = item.partition("=")
        inputs[names.get(name, name)] = np.load(path)
    if not args.input:  # random inputs, for a quick check: token ids in range, masks of 0s and 1s
        definitions = [(k.output, k.expr) for k in optimized.program.kernels]
        inputs = sample_inputs(definitions, optimized.inputs, args.seed, meta.get("integers", ()))
        given = {internal: name for name, internal in names.items()}
        for name, value in inputs.items():
            console.print(f"{given.get(name, name)}: sampled, {_sampled(value)}")
    start = time.perf_counter()
    outs = optimized(**inputs)
    elapsed = time.perf_counter() - start
    outs = outs if isinstance(outs, tuple) else (outs,)
    for name, value in zip(optimized.outputs, outs):
        console.print(f"{name}: shape {value.shape}, mean {value.mean():.6g}, std {value.std():.6g}")
    console.print(f"ran in {elapsed * 1e3:.2f} ms")
    if args.out:
        np.save(args.out, outs[0])
    return 0


def cmd_compare(args, console: Console) -> int:
    """Two saved programs of one model run whole in turns (``race_whole``: on zeros, in one pool
    of buffers, each round in another order) until B's time over A's in the same round is known
    to lie above or below 1 (95%) or within 0.5% of it, or ``--seconds`` have passed."""
    first, second = load_optimized(args.first).program, load_optimized(args.second).program
    if first.inputs != second.inputs:
        raise ExpressionError(
            f"{args.first} and {args.second} take different inputs ({first.inputs} against {second.inputs}):"
            " they are not programs of one model"
        )
    raced = race_whole({"A": first, "B": second}, "A", max_seconds=args.seconds)
    low, median, high = raced.ratios["B"]
    verdict = "B is faster" if high < 1 else "B is slower" if low > 1 else "neither is surely faster"
    for label, path in (("A", args.first), ("B", args.second)):
        console.print(f"{label} = {path}: {raced.seconds[label] * 1e3:.3f} ms (median)", highlight=False)
    console.print(
        f"B / A, {raced.rounds} rounds in turns: {median:.4f} (95%: {low:.4f}-{high:.4f}): {verdict}", highlight=False
    )
    return 0


def _sampled(value: np.ndarray) -> str:
    """What a sampled input holds: integers (token ids, a mask) or real values."""
    if value.size and np.array_equal(value, np.round(value)):
        return f"integers {int(value.min())} to {int(value.max())}"
    return f"real values, mean {value.mean():.3g}, std {value.std():.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rewriter", description="Derivation-based tensor program optimizer.")
    sub = parser.add_subparsers(dest="command", required=True)
    cases = sub.add_parser("cases", help="parse, print and evaluate the public cases")
    cases.add_argument("--show", metavar="NAME", help="print one case in full")
    ev = sub.add_parser("eval", help="evaluate an expression with the reference semantics")
    ev.add_argument("expression")
    ev.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2")
    ev.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    ev.add_argument("--out", metavar="FILE.npy")
    ev.add_argument("--seed", type=int, default=0)
    dv = sub.add_parser("derive", help="derive candidate programs (an expression or a public case name)")
    dv.add_argument("expression")
    dv.add_argument("--shape", action="append", default=[], metavar="NAME=D1,D2")
    dv.add_argument("--max-depth", type=int, default=3)
    dv.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS")
    dv.add_argument("--show", type=int, default=5, metavar="N", help="candidates to list")
    dv.add_argument(
        "--backend",
        choices=("cpu", "reference", "cuda"),
        default="cpu",
        help="cpu: compile and measure (default); reference: numpy, analytic ranking; "
        "cuda: cuBLAS + TVM CUDA bundles, measured on the GPU (here, or via --bundles/--timings)",
    )
    dv.add_argument("--out", metavar="DIR", help="save the best compiled program here (cpu, cuda)")
    dv.add_argument("--bundles", metavar="DIR", help="cuda: write every compiled candidate here, to measure on a GPU")
    dv.add_argument("--timings", metavar="FILE", help="cuda: timings from `python -m bundle measure` on a GPU")
    dv.add_argument("--tune", type=int, default=0, metavar="N", help="race up to N TVM schedules per kernel")
    op = sub.add_parser("optimize", help="optimize a model (an ONNX file or a zoo name) subprogram by subprogram")
    op.add_argument("model")
    op.add_argument("--small", action="store_true", help="the reduced zoo model (quick runs)")
    op.add_argument("--max-depth", type=int, default=3)
    op.add_argument("--time-limit", type=float, default=None, metavar="SECONDS", help="for the whole model")
    op.add_argument("--subprogram-time-limit", type=float, default=60.0, metavar="SECONDS", help="for each subprogram")
    op.add_argument("--out", metavar="DIR")
    op.add_argument("--tune", type=int, default=0, metavar="N", help="race up to N TVM schedules per kernel")
    op.add_argument("--seed", type=int, default=0)
    op.add_argument(
        "--orchestration",
        choices=("blp", "greedy", "none"),
        default="blp",
        help="which primitives share a kernel: Korch's binary linear program over measured candidates, its "
        "program raced whole against the greedy one's and kept where surely faster (default), greedy fusion "
        "across subprograms, or none",
    )
    op.add_argument(
        "--layout",
        choices=("auto", "blocked", "as-written"),
        default="auto",
        help="how NCHW tensors are stored: with their channels in blocks of the CPU's vector and as written, "
        "each optimized and the blocked one kept where its whole runs are surely faster (default), or only one",
    )
    ex = sub.add_parser("explain", help="the rule path of every subprogram and the orchestration of an optimized model")
    ex.add_argument("directory")
    rn = sub.add_parser("run", help="run an optimized model saved by optimize --out")
    rn.add_argument("directory")
    rn.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    rn.add_argument("--out", metavar="FILE.npy")
    rn.add_argument("--seed", type=int, default=0)
    cp = sub.add_parser("compare", help="two saved programs of one model, run whole in turns: which is faster")
    cp.add_argument("first", metavar="DIR-A")
    cp.add_argument("second", metavar="DIR-B")
    cp.add_argument(
        "--seconds", type=float, default=30.0, help=f"at most this long, once {WHOLE_RACE_ROUNDS} rounds are run"
    )
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and CI logs: do not squeeze the tables to 80 columns
    try:
        commands = {
            "cases": cmd_cases,
            "eval": cmd_eval,
            "derive": cmd_derive,
            "optimize": cmd_optimize,
            "explain": cmd_explain,
            "run": cmd_run,
            "compare": cmd_compare,
        }
        return commands[args.command](args, console)
    except ExpressionError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
