"""Thread pools' idle policy, set before numpy loads its BLAS (``rewriter`` imports this first).

numpy's OpenBLAS keeps its threads spinning for about 2**28 cycles after each call, holding the
cores that the generated kernels run on next: a MobileNetV2 program (104 BLAS and TVM kernels)
took 15.4 ms end to end that way and 11.9 ms with the threads asleep at once. TVM's pool does
the same: with its default spin count a worker stayed busy through the whole of a 50 ms pause
after one kernel (process CPU time), holding the core the next BLAS call, or the next library,
needs. Both pools are told to sleep when idle, as the benchmarks already ran them.
OpenBLAS reads ``OPENBLAS_THREAD_TIMEOUT`` (2**N cycles, N from 4) and TVM
``TVM_THREAD_POOL_SPIN_COUNT`` once, when they load; a value the user set still decides, and a
numpy imported before ``rewriter`` keeps its own. ``codegen.measure.device_id`` names both, so
timings taken under other policies are not reused.
"""

import os

IDLE_POLICY = {"OPENBLAS_THREAD_TIMEOUT": "4", "TVM_THREAD_POOL_SPIN_COUNT": "0"}

for _name, _value in IDLE_POLICY.items():
    os.environ.setdefault(_name, _value)
