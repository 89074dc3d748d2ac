"""Lowering of instantiated programs to executables: BLAS calls, TVM eOperators, measurement."""

from .tvm_kernel import CodegenError, Schedule, TvmKernel, candidate_schedules, compile_scope

__all__ = ["CodegenError", "Schedule", "TvmKernel", "candidate_schedules", "compile_scope"]
