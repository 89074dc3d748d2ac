"""Code generation: kernel descriptions (``rewriter.lower``) in, executables out.

``backend`` is what the pipeline sees (compile, measure, device key); ``program`` compiles a
candidate's kernels into one callable over reused buffers, racing the implementations each
operator record lists; ``native`` runs a program's compiled kernels by one call into C;
``tvm_kernel`` compiles a scope with TVM; ``packed`` runs a matmul over a weight laid out in
panels once (a TVM kernel), ``panels`` a convolution directly over its weight laid out in panels
of output channels; ``im2col`` runs a matched convolution as batched BLAS calls, ``band`` a band
matmul as blocked batched BLAS calls, both copying operands through ``strided`` views;
``measure`` times and remembers.
"""

# Load order: importing any ``rewriter`` module runs the ``rewriter`` package, whose ``derive``
# imports this package's backend. Importing the IR first, before any module of this package
# starts, lets that happen while none of them is half-initialised.
import rewriter.ir  # noqa: F401  isort: skip

from .backend import Backend, CpuBackend, ReferenceBackend, as_backend
from .tvm_kernel import CodegenError, Schedule, TvmKernel, candidate_schedules, compile_scope

__all__ = [
    "Backend",
    "CodegenError",
    "CpuBackend",
    "ReferenceBackend",
    "Schedule",
    "TvmKernel",
    "as_backend",
    "candidate_schedules",
    "compile_scope",
]
