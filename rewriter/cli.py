"""The ``rewriter`` command line.

    rewriter cases [--show NAME]               parse, print and evaluate the public cases
    rewriter eval "EXPRESSION" --shape A=2,3 --shape B=3,4 [--input A=a.npy] [--out y.npy]
    rewriter derive "EXPRESSION" --shape A=1,7,7,512 --shape K=3,3,512,512 [--max-depth 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .cases import PUBLIC_CASES, CASES
from .errors import ExpressionError
from .reference import evaluate
from .ir import tensor_shapes
from .parser import parse


def _random_inputs(shapes: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


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
        inputs = _random_inputs(shapes)
        start = time.perf_counter()
        out = evaluate(expr, inputs)
        elapsed = (time.perf_counter() - start) * 1e3
        inputs_text = " ".join(f"{n}{tuple(s)}".replace(" ", "") for n, s in shapes.items())
        table.add_row(case.name, inputs_text, str(out.shape).replace(" ", ""), "yes" if round_trip else "NO", f"{elapsed:.1f}")
    console.print(table)
    if args.show:
        _show(CASES[args.show], console)
    return 0


def _show(case, console: Console) -> None:
    expr = case.expression()
    out = evaluate(expr, _random_inputs(case.shapes))
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
    inputs = _random_inputs(shapes, args.seed)
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
    from .derive import derive

    shapes = dict(_parse_shape(s) for s in args.shape)
    expr = parse(args.expression, shapes) if args.expression not in CASES else CASES[args.expression].expression()
    start = time.perf_counter()
    derivation = derive(expr, max_depth=args.max_depth, time_limit=args.time_limit, backend=args.backend)
    elapsed = time.perf_counter() - start
    console.print(f"{len(derivation.candidates)} verified candidates in {elapsed:.1f} s")
    measured = args.backend == "cpu"
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
    dv.add_argument("--time-limit", type=float, default=None, metavar="SECONDS")
    dv.add_argument("--show", type=int, default=5, metavar="N", help="candidates to list")
    dv.add_argument("--backend", choices=("cpu", "reference"), default="cpu",
                    help="cpu: compile and measure (default); reference: numpy, analytic ranking")
    dv.add_argument("--out", metavar="DIR", help="save the best compiled program here (cpu backend)")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # pipes and CI logs: do not squeeze the tables to 80 columns
    try:
        return {"cases": cmd_cases, "eval": cmd_eval, "derive": cmd_derive}[args.command](args, console)
    except ExpressionError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}", highlight=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
