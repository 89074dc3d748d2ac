"""The public cases of the design document: OLLIE's evaluation operators, as text and shapes.

These are inputs users and benchmarks start from; nothing in the engine, the rules or codegen
looks at them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rewriter.ir import Scope, parse


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    shapes: dict
    source: str

    def expression(self) -> Scope:
        return parse(self.text, self.shapes)


PUBLIC_CASES = (
    Case(
        "conv3x3",
        "L n:1, h:7, w:7, f:512 ; S c:512, r:3, s:3 ; A[n, h+r-1, w+s-1, c] * K[r, s, f, c]",
        {"A": (1, 7, 7, 512), "K": (3, 3, 512, 512)},
        "Conv3x3, NHWC input, RSFC weight, padding 1 (ResNet-18 layer)",
    ),
    Case(
        "convtranspose",
        "L n:16, h:4, w:4, f:448 ; S x:2, y:2, c:256 ; A[n, x, y, c] * K[h+1-2*x, w+1-2*y, f, c]",
        {"A": (16, 2, 2, 256), "K": (4, 4, 448, 256)},
        "ConvTranspose 4x4, stride 2, padding 1 (InfoGAN / DCGAN)",
    ),
    Case(
        "conv5x5",
        "L n:16, f:1, h:224, w:224 ; S c:32, r:5, s:5 ; A[n, c, h+r-2, w+s-2] * K[f, c, r, s]",
        {"A": (16, 32, 224, 224), "K": (1, 32, 5, 5)},
        "Conv5x5, NCHW, padding 2 (SRCNN)",
    ),
    Case(
        "g2bmm",
        "L b:8, i:10000, j:65 ; S k:64 ; Q[b, i, k] * Kt[b, i+4*j-128, k]",
        {"Q": (8, 10000, 64), "Kt": (8, 10000, 64)},
        "Dilated G2BMM, band half-width 32, dilation 4 (Longformer attention scores)",
    ),
    Case(
        "matmul_chain",
        "L c:64, r:64 ; S k0:64 ; { L c2:64, k2:64 ; S k1:64 ; A[c2, k1] * B[k1, k2] }[c, k0] * C[k0, r]",
        {"A": (64, 64), "B": (64, 64), "C": (64, 64)},
        "Two matmuls, the first instantiated as a scope (OLLIE Figure 4b)",
    ),
)

CASES = {case.name: case for case in PUBLIC_CASES}
