"""Lowering of instantiated programs to executables: BLAS calls, TVM eOperators, measurement."""
