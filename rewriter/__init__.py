"""rewriter: a derivation-based tensor program superoptimizer (OLLIE on equality saturation).

    from rewriter import parse, evaluate, derive, conv2d, ...

The layers, bottom to top (each imports only those below it; see DESIGN.md):

    ir          the language: nodes, notation, parser, builders
    index       index algebra, integer sets (islpy), bijections
    semantics   the reference semantics (evaluate)
    egraph      the expression language in egglog, the e-graph, extraction
    search      the rule DSL, fingerprints, explorative derivation
    lower       operator records (iterator mapping tables), instantiation, post-processing
    (codegen)   kernels to executables: BLAS, TVM, measurement (a top-level package)
    pipeline    derive (Algorithm 2) and the program optimizer (Algorithm 1)
    frontends   ONNX, PyTorch, the model zoo
    testing     the property-test harness and hypothesis strategies (strategies need hypothesis)
"""

from . import _threads  # noqa: F401  (first: before numpy loads its BLAS)
from .frontends import from_torch, load_onnx, zoo
from .ir import (
    Access,
    Binary,
    ExpressionError,
    Index,
    IndexNeg,
    IndexOp,
    Iterator,
    Lit,
    Num,
    Program,
    Scalar,
    Scope,
    Tensor,
    Unary,
    Var,
    builders,
    parse,
    parse_program,
    tensor_shapes,
)
from .ir.builders import *  # noqa: F403  (matmul, conv2d, ..., einsum: see builders.__all__)
from .pipeline import derive, optimize_program
from .search import explore
from .semantics import evaluate

__all__ = [
    *builders.__all__,
    "Access",
    "Binary",
    "ExpressionError",
    "Index",
    "IndexNeg",
    "IndexOp",
    "Iterator",
    "Lit",
    "Num",
    "Program",
    "Scalar",
    "Scope",
    "Tensor",
    "Unary",
    "Var",
    "derive",
    "evaluate",
    "explore",
    "from_torch",
    "load_onnx",
    "optimize_program",
    "parse",
    "parse_program",
    "tensor_shapes",
    "zoo",
]
