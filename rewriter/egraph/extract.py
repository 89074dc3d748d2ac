"""Extraction from the e-graph: the cheapest program of an e-class, scope by scope, bottom up.

The search unions every rule result with the scope it came from (``rewriter.search``), so an
e-class of scopes holds every form found for it, and a parent's nested scopes are e-classes too.
Extraction picks, for each e-class of scopes, the member whose own kernel plus the best programs
of the nested e-classes it reads cost least. A parent may so combine forms that no single search
state holds: one nested scope rewritten in one state, another in another.

``extract(graph, root, cost)`` reads the e-graph as egglog serialises it (e-nodes with their
child e-classes), through the language table's reader (``language.Reader``). Classes of indices
and scalars take their smallest member (egglog's own eager rules only simplify index arithmetic
there); each member of a class of scopes is costed once, with its nested scopes read as
placeholder tensors, and the sums are found by passes to a fixpoint (the e-graph may have
cycles), under a deadline.

``cost`` is the caller's: ``derive`` passes measured kernel times where a kernel was measured
and the analytic stand-in, scaled to the measurements, elsewhere (lazy measurement).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Callable, Iterable

from rewriter.ir import Access, ExpressionError, Scope, Tensor, replace_reads, tensor_shapes

from .graph import ExpressionGraph
from .language import CONSTRUCTORS, HANDLES, INDEX_LIST, ITER_LIST, REF, Constructor, Reader

ACCESS, NESTED, MKSCOPE = CONSTRUCTORS["Access"], CONSTRUCTORS["Nested"], CONSTRUCTORS["MkScope"]

INFINITE = float("inf")


class _SerialisedGraph:
    """E-nodes by e-class: each node's constructor (or literal) and its child e-classes."""

    def __init__(self, graph: ExpressionGraph):
        nodes = graph.serialize()["nodes"]
        self.op = {key: node["op"] for key, node in nodes.items()}
        self.children = {key: [nodes[c]["eclass"] for c in node["children"]] for key, node in nodes.items()}
        self.members: dict[str, list[str]] = defaultdict(list)
        refs = {}
        for key, node in nodes.items():
            if node["op"] == REF.name:  # a handle, not a term: it names its e-class
                refs[json.loads(nodes[node["children"][0]]["op"])] = node["eclass"]
            elif node["op"] not in HANDLES and not node.get("subsumed"):
                self.members[node["eclass"]].append(key)
        self.class_of_handle = refs
        self.size = self._sizes()
        self.smallest = {
            e: min(ms, key=lambda m: sum(self.size[c] for c in self.children[m])) for e, ms in self.members.items()
        }

    def _sizes(self) -> dict[str, float]:
        """Nodes in each class's smallest member term (a fixpoint: classes may be cyclic)."""
        size = defaultdict(lambda: INFINITE)
        changed = True
        while changed:
            changed = False
            for eclass, members in self.members.items():
                best = min(1 + sum(size[c] for c in self.children[m]) for m in members)
                if best < size[eclass]:
                    size[eclass], changed = best, True
        return size


class _Reader(Reader):
    """The IR of e-classes (terms are e-class ids): every class takes its smallest member, and a
    read of a nested scope's e-class becomes a read of a placeholder tensor (``placeholders``:
    e-class -> Tensor, with the scope's lower bounds) so that a member's own kernel is costed
    apart from the scopes it reads."""

    def __init__(self, graph: _SerialisedGraph):
        super().__init__()
        self.graph = graph
        self.placeholders: dict[str, tuple[Tensor, tuple[int, ...]]] = {}

    def app(self, eclass: str) -> tuple[str, list[str]]:
        node = self.graph.smallest[eclass]
        return self.graph.op[node], self.graph.children[node]

    def lit(self, eclass: str):
        return json.loads(self.graph.op[self.graph.members[eclass][0]])

    def node(self, row: Constructor, args):
        if row is ACCESS:
            source, source_args = self.app(args[0])
            if source == NESTED.name:
                tensor, lows = self.placeholder(source_args[0])
                indices = self.read(INDEX_LIST, args[1])
                return Access(tensor, tuple(ix - lo if lo else ix for ix, lo in zip(indices, lows)))
        return super().node(row, args)

    def placeholder(self, eclass: str) -> tuple[Tensor, tuple[int, ...]]:
        if eclass not in self.placeholders:
            node = next(m for m in self.graph.members[eclass] if self.graph.op[m] == MKSCOPE.name)
            traversal = self.read(ITER_LIST, self.graph.children[node][0])
            tensor = Tensor(f"_e{len(self.placeholders)}", tuple(it.size for it in traversal))
            self.placeholders[eclass] = tensor, tuple(it.lo for it in traversal)
        return self.placeholders[eclass]

    def own(self, node: str) -> Scope:
        """The member ``node`` (a MkScope e-node) with its nested scopes as placeholders."""
        return super().node(MKSCOPE, self.graph.children[node])


def extract(
    graph: ExpressionGraph,
    root: Scope,
    cost: Callable[[Scope, frozenset], float],
    weights: Iterable[str] = (),
    deadline: float | None = None,
) -> tuple[Scope, float] | None:
    """The cheapest scope equivalent to ``root`` in ``graph``, with its cost; None when the
    deadline (a ``time.perf_counter()`` value) came before the root's e-class was costed.

    A member's cost is ``cost(own, constants)`` for its own kernel (``own``: the member with
    each nested scope read as a placeholder tensor; ``constants``: the placeholders whose scope
    reads only ``weights``, computed once at build time) plus the costs of the nested e-classes
    that are not constant."""
    handle = graph.handle(root)
    if handle is None:
        raise ExpressionError("extract: the root scope is not in the e-graph")
    serialised = _SerialisedGraph(graph)
    root_class = serialised.class_of_handle[handle]
    reader, weights = _Reader(serialised), frozenset(weights)
    members: list[tuple[str, str, Scope]] = []  # (e-class, node, own form)
    for eclass, nodes in serialised.members.items():
        for node in nodes:
            if serialised.op[node] == MKSCOPE.name:
                if deadline is not None and time.perf_counter() > deadline:
                    return None
                members.append((eclass, node, reader.own(node)))
    by_name = {tensor.name: eclass for eclass, (tensor, _) in reader.placeholders.items()}
    reads = {
        node: (set(tensor_shapes(own)) - set(by_name), [by_name[n] for n in tensor_shapes(own) if n in by_name])
        for _, node, own in members
    }
    best: dict[str, tuple[float, str, frozenset]] = {}  # e-class -> (cost, node, the inputs it reads)
    costs: dict[tuple, float] = {}
    changed = True
    while changed:
        changed = False
        for eclass, node, own in members:
            inputs, nested = reads[node]
            if any(n not in best for n in nested):
                continue
            constants = frozenset(reader.placeholders[n][0].name for n in nested if best[n][2] <= weights)
            key = (own, constants)
            if key not in costs:
                if deadline is not None and time.perf_counter() > deadline:
                    return _result(reader, serialised, members, best, root_class)
                costs[key] = cost(own, constants)
            total = costs[key] + sum(best[n][0] for n in nested if not best[n][2] <= weights)
            if total < best.get(eclass, (INFINITE,))[0]:
                best[eclass] = (total, node, frozenset(inputs).union(*(best[n][2] for n in nested)))
                changed = True
    result = _result(reader, serialised, members, best, root_class)
    if result is None:
        raise ExpressionError("extract: no member of the root e-class could be read back")
    return result


def _result(
    reader: _Reader, serialised: _SerialisedGraph, members, best: dict, root_class: str
) -> tuple[Scope, float] | None:
    """The root's best member with the best member of each nested e-class put back in place."""
    if root_class not in best:
        return None
    own = {node: scope for _, node, scope in members}
    built: dict[str, Scope] = {}

    def build(eclass: str) -> Scope:
        if eclass not in built:
            scope = own[best[eclass][1]]
            body = scope.body
            for nested, (tensor, lows) in reader.placeholders.items():
                if tensor.name in tensor_shapes(scope):
                    inner = build(nested)
                    body = replace_reads(
                        body,
                        tensor.name,
                        lambda ix, inner=inner, lows=lows: inner[tuple(i + lo if lo else i for i, lo in zip(ix, lows))],
                    )
            built[eclass] = scope.with_body(body)
        return built[eclass]

    return build(root_class), best[root_class][0]
