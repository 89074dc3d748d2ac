"""Thread pools' idle policy, set before numpy loads its BLAS (``rewriter`` imports this first).

numpy's OpenBLAS keeps its threads spinning for about 2**28 cycles after each call, holding the
cores that the generated kernels run on next: a MobileNetV2 program (104 BLAS and TVM kernels)
took 15.4 ms end to end that way and 11.9 ms with the threads asleep at once. TVM's pool does
the same: with its default spin count a worker stayed busy through the whole of a 50 ms pause
after one kernel (process CPU time), holding the core the next BLAS call, or the next library,
needs. OpenBLAS's threads sleep at once. TVM's worker yields its core for about half a
millisecond (1000 turns of ``sched_yield``: 0.5 ms of CPU time in a 50 ms pause after a
kernel, against 0.1 asleep at once and 8 at 20000), long enough to catch the next kernel of a
program, short enough to leave the cores to whatever runs after it: asleep at once, every
parallel kernel woke it first, and MobileNetV2 ran at 0.69-0.70x onnxruntime, 0.91-0.97x with
1000 turns (0.82-0.85x with 200; ResNet-50 0.81x and 0.84x with 2000; ViT-Base, whose products
run in OpenBLAS and in TVM, 0.86x and 0.87x; BERT-base 1.10-1.13x and 1.18-1.20x with 1000;
onnxruntime's own times unchanged, each pair interleaved in one process). OpenBLAS reads ``OPENBLAS_THREAD_TIMEOUT`` (2**N cycles, N from 4) and TVM
``TVM_THREAD_POOL_SPIN_COUNT`` once, when they load; a value the user set still decides, and a
numpy imported before ``rewriter`` keeps its own. ``codegen.measure.device_id`` names both, so
timings taken under other policies are not reused.
"""

import os

IDLE_POLICY = {"OPENBLAS_THREAD_TIMEOUT": "4", "TVM_THREAD_POOL_SPIN_COUNT": "1000"}

for _name, _value in IDLE_POLICY.items():
    os.environ.setdefault(_name, _value)
