"""derive() on OLLIE's evaluation operators: states, time, and the forms it finds, beside OLLIE.

    python3 bench/derive_stats.py [--depth 7] [--time-limit 300] [--cases conv3x3,...]

For each case: states explored, why the search stopped, seconds (search, then the whole derive
with guided steps, instantiation and verification), candidates, and the distinct kernel
structures among them, with OLLIE's published search time and states (../shared/DESIGN.md) where
it gives them. ``csrnet`` (a dilated Conv3x3, not a public case) is built here with the builder.
Updates the cases' rows in bench/results/derive_stats.json. The reference backend: search,
instantiation and verification only (bench/vs_torch.py compiles and measures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rewriter import conv2d, derive  # noqa: E402
from rewriter.cases import CASES  # noqa: E402

# OLLIE's search at depth 7 on an A100 host (DESIGN.md): seconds, states
OLLIE = {
    "conv3x3": (7.2, 158_000),
    "convtranspose": (53.6, 901_000),
    "conv5x5": (101.0, 2_200_000),
    "g2bmm": (0.7, 18_000),
}
EXTRA = {"csrnet": lambda: conv2d((1, 512, 14, 14), (512, 512, 3, 3), dilation=2, padding=2)}


def _structure(candidate) -> str:
    parts = []
    for k in candidate.kernels:
        if k.kind == "conv2d":
            sizes = {it.name: it.size for it in k.expr.iterators}
            (_, r, _, dr), (_, s, _, _) = k.match.spatial
            parts.append(f"conv{sizes[r]}x{sizes[s]}" + (f"d{dr}" if dr > 1 else ""))
        elif k.kind in ("g2bmm", "gbmm"):
            parts.append(f"{k.kind}" + (f"d{k.match.dilation}" if k.match.dilation > 1 else ""))
        else:
            parts.append(k.kind)
    return "+".join(parts)


def run(name: str, depth: int, time_limit: float) -> dict:
    expr = EXTRA[name]() if name in EXTRA else CASES[name].expression()
    start = time.perf_counter()
    derivation = derive(expr, max_depth=depth, time_limit=time_limit, backend="reference")
    seconds = time.perf_counter() - start
    structures = sorted({_structure(c) for c in derivation.candidates})
    ollie = OLLIE.get(name, (None, None))
    return {
        "case": name,
        "depth": depth,
        "states": derivation.stats.states,
        "stop": derivation.stats.stop_reason,
        "search_s": round(derivation.stats.seconds, 1),
        "derive_s": round(seconds, 1),
        "candidates": len(derivation.candidates),
        "rejected": len(derivation.rejected),
        "best": _structure(derivation.best),
        "structures": structures,
        "ollie_s": ollie[0],
        "ollie_states": ollie[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--time-limit", type=float, default=300.0, help="search budget per case, seconds")
    parser.add_argument("--cases", default="conv3x3,convtranspose,conv5x5,g2bmm,csrnet")
    args = parser.parse_args()
    rows = []
    print(
        f"{'case':<14}{'states':>8}{'stop':>10}{'search s':>9}{'derive s':>9}{'OLLIE s':>8}{'OLLIE states':>13}  structures"
    )
    for name in args.cases.split(","):
        row = run(name, args.depth, args.time_limit)
        rows.append(row)
        print(
            f"{name:<14}{row['states']:>8}{row['stop']:>10}{row['search_s']:>9}{row['derive_s']:>9}"
            f"{row['ollie_s'] or '-':>8}{row['ollie_states'] or '-':>13}  {', '.join(row['structures'])}",
            flush=True,
        )
    out = ROOT / "bench" / "results" / "derive_stats.json"
    earlier = json.loads(out.read_text()) if out.exists() else []
    merged = {row["case"]: row for row in earlier if "stop" in row}  # rows of this script's format
    merged.update({row["case"]: row for row in rows})
    out.write_text(json.dumps(list(merged.values()), indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
