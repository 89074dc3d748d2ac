"""Iterator mapping tables (OLLIE section 4.3.1, Table 2) as data.

Each operator lists its iterator groups: for every group, whether its iterators index the input,
the weight and the output, and whether the group is summed. Matching (rewriter/instantiate.py)
fills a scope's iterators into these groups by where they appear, so adding an operator whose
iterators are separable (each index reads one iterator) is adding a row here.

Convolution and the band matmuls (G2BMM, GBMM) correlate two iterators in one index (``h+r``,
``i+D*j``); their rows are listed for completeness but matching them needs the correlation check
of section 4.3.1, which is not written yet.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    name: str
    input: bool
    weight: bool
    output: bool
    summed: bool = False


@dataclass(frozen=True)
class OperatorTable:
    kind: str  # the kernel kind users see: "matmul", "batch_matmul", ...
    groups: tuple[Group, ...]
    separable: bool = True  # every index reads a single iterator of a single group

    def group_of(self, input: bool, weight: bool, output: bool) -> Group | None:
        summed = not output
        for group in self.groups:
            if (group.input, group.weight, group.output, group.summed) == (input, weight, output, summed):
                return group
        return None


MATMUL = OperatorTable(
    "matmul",
    (
        Group("m", input=True, weight=False, output=True),
        Group("n", input=False, weight=True, output=True),
        Group("k", input=True, weight=True, output=False, summed=True),
    ),
)

BATCH_MATMUL = OperatorTable(
    "batch_matmul",
    (
        Group("b", input=True, weight=True, output=True),
        Group("m", input=True, weight=False, output=True),
        Group("n", input=False, weight=True, output=True),
        Group("k", input=True, weight=True, output=False, summed=True),
    ),
)

CONV2D = OperatorTable(
    "conv2d",
    (
        Group("nhw", input=True, weight=False, output=True),
        Group("f", input=False, weight=True, output=True),
        Group("crs", input=True, weight=True, output=False, summed=True),
    ),
    separable=False,
)

G2BMM = OperatorTable(
    "g2bmm",
    (
        Group("bm", input=True, weight=True, output=True),
        Group("w", input=False, weight=False, output=True),
        Group("k", input=True, weight=True, output=False, summed=True),
    ),
    separable=False,
)

TABLES = (MATMUL, BATCH_MATMUL, CONV2D, G2BMM)
