"""rewriter: a derivation-based tensor program superoptimizer (OLLIE on equality saturation).

    from rewriter import parse, evaluate, conv2d, ...

The IR lives in ``rewriter.ir``, the notation in ``rewriter.printer``/``rewriter.parser``, the
reference semantics in ``rewriter.reference``, the index algebra in ``rewriter.indexing``.
"""

from . import builders
from .builders import *  # noqa: F401,F403  (matmul, conv2d, ..., einsum: see builders.__all__)
from .errors import ExpressionError
from .reference import evaluate
from .ir import (
    Access,
    Binary,
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
    tensor_shapes,
)
from .parser import parse, parse_program
from .derive import derive, derive_program
from .search import explore
from .onnx_frontend import load_onnx  # imports onnx only when called
from .torch_frontend import from_torch  # imports torch only when called

__all__ = [
    *builders.__all__,
    "ExpressionError",
    "derive",
    "derive_program",
    "evaluate",
    "explore",
    "from_torch",
    "load_onnx",
    "parse",
    "parse_program",
    "tensor_shapes",
    "Access",
    "Binary",
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
]
