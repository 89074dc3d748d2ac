"""Search statistics of ``explore`` on the public cases at depths 1..7 (issue: derivation engine).

Each (case, depth) runs in a fresh subprocess so its peak memory (max RSS) is its own. Writes
``bench/results/search_stats.json`` and prints a table beside OLLIE's figures at depth 7
(DESIGN.md) with the ratios of ours to them, and the e-graph's share of the search time.

    python3 bench/search_stats.py [--depths 1-7] [--time-limit 300] [--cases conv3x3,...] [--no-egraph]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLLIE = {  # DESIGN.md: OLLIE's C++ search at depth 7 (Conv5x5 needed depth 8 there)
    "conv3x3": (158_000, 7.2),
    "convtranspose": (901_000, 53.6),
    "conv5x5": (2_200_000, 101.0),
    "g2bmm": (18_000, 0.7),
}


def run_one(case: str, depth: int, time_limit: float, use_egraph: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    from rewriter import explore
    from rewriter.cases import CASES

    start = time.perf_counter()
    exploration = explore(CASES[case].expression(), max_depth=depth, time_limit=time_limit, use_egraph=use_egraph)
    stats = exploration.stats
    last = stats.rounds[-1] if stats.rounds else None
    return {
        "case": case,
        "depth": depth,
        "states": stats.states,
        "fingerprint_hits": stats.fingerprint_hits,
        "shared": stats.shared,
        "enodes": last.enodes if last else 0,
        "eclasses": last.eclasses if last else 0,
        "seconds": round(time.perf_counter() - start, 3),
        "rule_s": round(sum(r.rule_s for r in stats.rounds), 3),
        "rebuild_s": round(sum(r.rebuild_s for r in stats.rounds), 3),
        "egraph_s": round(sum(r.egraph_s for r in stats.rounds), 3),
        "stop": stats.stop_reason,
        "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "applications": dict(stats.applications),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="1-7")
    parser.add_argument("--cases", default=",".join(OLLIE))
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--no-egraph", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "DEPTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]), args.time_limit, not args.no_egraph)))
        return
    lo, _, hi = args.depths.partition("-")
    depths = range(int(lo), int(hi or lo) + 1)
    rows = []
    print(
        f"{'case':<14}{'depth':>6}{'states':>9}{'hits':>9}{'shared':>9}{'enodes':>9}{'seconds':>9}{'egraph':>7}{'peak MiB':>10}"
        f"  stop   {'OLLIE d7 states':>15}{'s':>7}{'states/OLLIE':>13}{'s/OLLIE':>9}"
    )
    for case in args.cases.split(","):
        for depth in depths:
            command = [sys.executable, __file__, "--one", case, str(depth), "--time-limit", str(args.time_limit)]
            if args.no_egraph:
                command.append("--no-egraph")
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            ollie_states, ollie_s = OLLIE[case]
            row["states_per_ollie"] = round(row["states"] / ollie_states, 4)
            row["seconds_per_ollie"] = round(row["seconds"] / ollie_s, 3)
            share = row["egraph_s"] / row["seconds"] if row["seconds"] else 0.0
            print(
                f"{case:<14}{depth:>6}{row['states']:>9}{row['fingerprint_hits']:>9}{row['shared']:>9}{row['enodes']:>9}"
                f"{row['seconds']:>9.2f}{share:>7.0%}{row['peak_mib']:>10.0f}  {row['stop']:<6} {ollie_states:>15}"
                f"{ollie_s:>7}{row['states_per_ollie']:>13.3f}{row['seconds_per_ollie']:>9.2f}",
                flush=True,
            )
            if row["stop"] == "time":
                break  # deeper levels would only hit the same limit
    out_path = ROOT / "bench" / "results" / "search_stats.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
