"""Cost of the Python/egglog boundary of ``rewriter.egraph``: prints tables.

    python3 bench/egraph_boundary.py [--terms 2000] [--quick]

1. insertion cost per e-node against scope size;
2. handles: ``(Ref N)`` vs egglog ``let`` as the graph grows;
3. the other operations: writing egglog text, union of handles, ``equivalent``, ``lookup``,
   ``size`` (nodes; classes via freeze), ``extract`` (+ reading the IR back), the high-level
   egglog-python insertion, and one run of ``eager_rules``.

"fresh" terms use a new tensor name each (almost every e-node is new).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from egglog import union  # noqa: E402

from rewriter import parse  # noqa: E402
from rewriter.egraph import CONSTRUCTORS, ExpressionGraph, ScopeTerm, adapter, eager_rules  # noqa: E402
from rewriter.egraph.language import SCOPE, Fold, text_app, text_lit  # noqa: E402

CONV = "L n:1, h:7, w:7, f:512 ; S c:512, r:3, s:3 ; {A}[n, h+r-{a}, w+s-{b}, c] * K[r, s, f, c]"


def conv_scope(k: int, fresh: bool):
    name = f"A{k}" if fresh else "A"
    a, b = divmod(k, 97)
    return parse(CONV.format(A=name, a=a, b=b), {name: (1, 7, 7, 512), "K": (3, 3, 512, 512)})


def sum_scope(k: int, terms: int):
    """A scope whose body adds ``terms`` accesses with distinct offsets (about 12 e-nodes each)."""
    body = " + ".join(f"X{k}[i+{j}, j*2-{k % 7}]" for j in range(terms))
    return parse(f"L i:8, j:8 ; {body}", {f"X{k}": (64, 64)})


def text(scope) -> str:
    """The egglog text ``ExpressionGraph.add`` sends for a scope with no handles inside."""
    return Fold(text_app, text_lit)(SCOPE, scope)


def nodes_of(scope) -> int:
    return text(scope).count("(")


def per_term_ms(seconds: float, count: int) -> float:
    return seconds / count * 1e3


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


def time_inserts(scopes) -> float:
    """Seconds to add every scope."""
    graph = ExpressionGraph()
    start = time.perf_counter()
    for scope in scopes:
        graph.add(scope)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--terms", type=int, default=2000, help="terms per measurement (default 2000)")
    parser.add_argument("--quick", action="store_true", help="500 terms, fewer sizes")
    args = parser.parse_args()
    n = 500 if args.quick else args.terms

    time_inserts([conv_scope(k, True) for k in range(50)])  # warm-up (imports, first egglog graph)

    # 1. scope size
    rows = []
    sizes = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    for terms in sizes:
        count = max(50, n // terms)
        scopes = [sum_scope(k, terms) for k in range(count)]
        nodes = nodes_of(scopes[0])
        build = time.perf_counter()
        writer = Fold(text_app, text_lit)
        for scope in scopes:
            writer(SCOPE, scope)
        build = time.perf_counter() - build
        total = time_inserts(scopes)
        rows.append(
            [
                terms,
                nodes,
                count,
                f"{per_term_ms(total, count):.3f}",
                f"{total / count / nodes * 1e6:.1f}",
                f"{build / count / nodes * 1e6:.2f}",
            ]
        )
    table(
        "1. add(), fresh terms: cost against term size",
        ["accesses", "nodes/term", "terms", "ms/term", "us/node", "text us/node"],
        rows,
    )

    # 2. Ref handles vs let bindings as the graph grows
    rows = []
    count = 2 * n if args.quick else 8 * n
    texts = [text(conv_scope(k, True)) for k in range(count)]
    for mode in ("ref", "let"):
        raw = adapter.bindings_egraph(ExpressionGraph().egraph)
        step = count // 4
        for part in range(4):
            start = time.perf_counter()
            for k in range(part * step, (part + 1) * step):
                command = f"(union (Ref {k}) {texts[k]})" if mode == "ref" else f"(let $e{k} {texts[k]})"
                raw.run_program(*raw.parse_program(command))
            rows.append([mode, (part + 1) * step, f"{per_term_ms(time.perf_counter() - start, step):.3f}"])
    table(
        "2. handle kind: ms per term as handles accumulate (fresh conv terms)",
        ["handle", "handles so far", "ms/term"],
        rows,
    )

    # 3. other operations on a graph of n fresh conv terms
    graph = ExpressionGraph()
    scopes = [conv_scope(k, True) for k in range(n)]
    handles = [graph.add(scope) for scope in scopes]
    rows = []

    def op(name: str, fn, repeat: int) -> None:
        times = []
        for i in range(repeat):
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        rows.append([name, repeat, f"{statistics.median(times) * 1e3:.3f}"])

    writer = Fold(text_app, text_lit)
    op("egglog text of a scope (48 nodes, memoised indices)", lambda i: writer(SCOPE, scopes[i]), 200)
    op("union(handle, handle)", lambda i: graph.union(handles[2 * i], handles[2 * i + 1]), min(200, n // 2))
    op("equivalent(handle, handle)", lambda i: graph.equivalent(handles[i], handles[i + 1]), 200)
    op(
        "equivalent(handle, scope) via node lookups",
        lambda i: graph.equivalent(handles[i], conv_scope(i + 1, False)),
        200,
    )
    op("lookup(scope) of a scope it holds", lambda i: graph.lookup(scopes[i]), 200)
    op("extract(handle) -> Scope (egglog extract command)", lambda i: graph.extract(handles[i]), 50)
    op(f"size(classes=False), {graph.size()[0]} nodes", lambda i: graph.size(classes=False), 20)
    op(f"size() with class count, {graph.size()[0]} nodes", lambda i: graph.size(), 20)
    high = ExpressionGraph()
    term = Fold(lambda name, args: CONSTRUCTORS[name].term(*args), lambda kind, value: kind.encode(value))
    op(
        "high-level egglog-python: register(union(ref).with_(term)), term from the table",
        lambda i: high.egraph.register(union(ScopeTerm.ref(i)).with_(term(SCOPE, scopes[i]))),
        50,
    )
    op(f"run(eager_rules, 1) on {graph.size()[0]} nodes", lambda i: graph.run(eager_rules, 1), 5)
    table(
        f"3. other operations (graph of {n} fresh conv terms): median ms per call", ["operation", "calls", "ms"], rows
    )
    print(f"\ngraph stats after section 3: {graph.stats}")


if __name__ == "__main__":
    main()
