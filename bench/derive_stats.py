"""derive() on the public cases: time, states, candidates and what the best ones are made of.

    python3 bench/derive_stats.py [--depth 4] [--cases conv3x3,convtranspose,conv5x5,g2bmm]

Writes bench/results/derive_stats.json. Costs are the analytic stand-in until codegen measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rewriter import derive  # noqa: E402
from rewriter.cases import CASES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--cases", default="conv3x3,convtranspose,conv5x5,g2bmm")
    args = parser.parse_args()
    rows = []
    print(f"{'case':<14}{'depth':>6}{'states':>8}{'cands':>7}{'seconds':>9}  best kernels / with a matmul")
    for name in args.cases.split(","):
        start = time.perf_counter()
        derivation = derive(CASES[name].expression(), max_depth=args.depth)
        seconds = time.perf_counter() - start
        kinds = [[k.kind for k in c.kernels] for c in derivation.candidates]
        with_matmul = next((k for k in kinds if "matmul" in k or "batch_matmul" in k), None)
        row = {
            "case": name,
            "depth": args.depth,
            "states": derivation.stats.states,
            "candidates": len(derivation.candidates),
            "rejected": len(derivation.rejected),
            "seconds": round(seconds, 2),
            "best": kinds[0],
            "best_with_matmul": with_matmul,
        }
        rows.append(row)
        print(f"{name:<14}{args.depth:>6}{row['states']:>8}{row['candidates']:>7}{seconds:>9.1f}  {kinds[0]} / {with_matmul}", flush=True)
    out = ROOT / "bench" / "results" / "derive_stats.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
