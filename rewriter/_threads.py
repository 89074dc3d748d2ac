"""Thread pools' idle policy, set before numpy loads its BLAS (``rewriter`` imports this first).

numpy's OpenBLAS keeps its threads spinning for about 2**28 cycles after each call, holding the
cores that the generated kernels run on next: a MobileNetV2 program (104 BLAS and TVM kernels)
took 15.4 ms end to end that way and 11.9 ms with the threads asleep at once. OpenBLAS reads
``OPENBLAS_THREAD_TIMEOUT`` (2**N cycles, N from 4) once, when it loads; a value the user set
still decides, and a numpy imported before ``rewriter`` keeps its own.
"""

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
