"""Selection among candidates: which are admitted, in what order they are verified and
compiled, and extraction from the e-graph by measured kernel costs.

Candidates equal up to iterator names are one (``key``). The analytic stand-in orders them, the
cheapest of each kernel structure first (``diverse``) so that it cannot crowd out a structure
measurement may prefer. ``Extraction`` costs each e-class member's kernels at their measured time
where codegen measured them (lazy measurement), else at the analytic stand-in scaled to the
measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rewriter.egraph import extract
from rewriter.ir import ExpressionError, Scope, nested_scopes, rename_tensors, tensor_shapes
from rewriter.lower import Candidate, Kernel, instantiate, postprocess
from rewriter.search import fingerprint

# A candidate may not build a temporary more than this many times the largest tensor the
# expression reads or writes (partial sums kept per summed channel can be 64x the output: a
# full-size SRCNN ran out of memory on them), unless the temporary is small in itself: the
# Figure 3b form of a KxK convolution keeps K*K partial images, K*K times its output.
INTERMEDIATE_FACTOR = 8
SMALL_TEMPORARY = 1 << 22  # elements (16 MiB of float32)


def admitted(candidate: Candidate, identity: Candidate, expr: Scope) -> Candidate | None:
    """``candidate`` if it is worth verifying: not the identity re-indexed with no less work
    (codegen's business), and without oversized temporaries."""
    if [k.kind for k in candidate.kernels] == ["eop"] and candidate.cost >= identity.cost:
        return None
    if oversized(candidate.kernels, expr):
        return None
    if candidate.unfused and oversized(candidate.unfused, expr):
        candidate.unfused = None  # only the fused form stays within memory
    return candidate


def oversized(kernels: list[Kernel], expr: Scope) -> bool:
    """Whether a kernel's output or a stage inside it (a nested scope, materialised) is over
    ``INTERMEDIATE_FACTOR`` times the largest tensor of ``expr`` and over ``SMALL_TEMPORARY``."""
    largest = max([math.prod(expr.shape), *(math.prod(s) for s in tensor_shapes(expr).values())])
    limit = max(INTERMEDIATE_FACTOR * largest, SMALL_TEMPORARY)
    scopes = [scope for k in kernels for scope in (k.expr, *nested_scopes(k.expr))]
    return any(math.prod(scope.shape) > limit for scope in scopes)


def diverse(ranked: list[Candidate]) -> list[Candidate]:
    """The cheapest candidate of each kernel structure first, then the rest, each by cost:
    the analytic stand-in must not crowd out a structure that measurement may prefer."""
    firsts, seen = [], set()
    for candidate in ranked:
        structure = tuple(_structure(k) for k in candidate.kernels)
        if structure not in seen:
            seen.add(structure)
            firsts.append(candidate)
    return firsts + [c for c in ranked if c not in firsts]


def _structure(kernel: Kernel) -> tuple:
    """A kernel's kind and its operator's structural parameters (``match.structure``: a
    convolution's kernel extents and dilations, a band matmul's dilation): a dilated and a
    plain convolution are different structures, two layouts of the same eOperator are not."""
    return (kernel.kind,) if kernel.match is None else (kernel.kind, *kernel.match.structure)


def key(candidate: Candidate) -> tuple:
    """Candidates equal up to iterator names are one candidate."""
    return tuple((k.kind, k.output, fingerprint(k.expr)) for k in candidate.kernels)


@dataclass
class Extracted:
    """The source of a candidate extracted from the e-graph (no single search state holds it)."""

    expr: Scope

    def explain(self, root: Scope) -> str:
        return f"E1 = {root}\n  extracted from the e-graph (forms of several states combined)\nE2 = {self.expr}"


class Extraction:
    """Extraction from the e-graph (``rewriter.egraph.extract``) by kernel costs: measured
    seconds where codegen measured the kernel, else the analytic stand-in scaled by the ratio of
    measured to analytic time of the kernels of that kind measured so far. Weight-only kernels
    run once at build time and cost nothing."""

    def __init__(self, graph, expr: Scope, weights):
        self.graph, self.expr, self.weights = graph, expr, frozenset(weights)
        self.programs: dict[tuple, Candidate] = {}
        self.seconds: dict[tuple, float] = {}  # kernel signature -> measured seconds
        self.ratios: dict[str, list[float]] = {}  # kind -> measured / analytic
        self.signatures: dict[Scope, tuple] = {}

    def cost(self, own: Scope, constants: frozenset = frozenset()) -> float:
        key = (own, constants)
        if key not in self.programs:
            self.programs[key] = postprocess(instantiate(own), self.weights | constants)
        program = self.programs[key]
        forms = [program.kernels] + ([program.unfused] if program.unfused else [])
        return min(sum(self._seconds(k) for k in kernels if not k.weight_only) for kernels in forms)

    def _signature(self, kernel: Kernel) -> tuple:
        """The kernel up to tensor names (a temporary's name is an accident of numbering)."""
        if kernel.expr not in self.signatures:
            names = {name: f"t{'x'.join(map(str, shape))}" for name, shape in tensor_shapes(kernel.expr).items()}
            self.signatures[kernel.expr] = (kernel.kind, fingerprint(rename_tensors(kernel.expr, names)))
        return self.signatures[kernel.expr]

    def _seconds(self, kernel: Kernel) -> float:
        if self.seconds:
            measured = self.seconds.get(self._signature(kernel))
            if measured is not None:
                return measured
        ratios = self.ratios.get(kernel.kind) or [r for rs in self.ratios.values() for r in rs] or [1.0]
        return kernel.cost * float(np.median(ratios))

    def learn(self, program) -> None:
        """The measured time of each kernel of a compiled ``program``."""
        for kernel, seconds in program.timings():
            if not kernel.weight_only:
                self.seconds[self._signature(kernel)] = seconds
                self.ratios.setdefault(kernel.kind, []).append(seconds / kernel.cost)

    def best(self, deadline: float | None) -> Candidate | None:
        try:
            result = extract(self.graph, self.expr, self.cost, self.weights, deadline)
        except ExpressionError:
            return None
        if result is None:
            return None
        scope, _ = result
        program = postprocess(instantiate(scope), self.weights)
        return Candidate(list(program.kernels), Extracted(scope), program.unfused)
