"""The notation's transcendental functions in generated code: each one's kernel timed alone.

    python3 bench/scalar_functions.py [--cases gelu_tanh:197x3072,tanh:64x56x56,...] [--rounds 9]

Each case is ``FUNCTION:SHAPE``: a unary function of the notation (``exp``, ``tanh``,
``sigmoid``, ``erf``, ``log``, ...) applied element-wise, or one of the activations built
from them, ``gelu`` (erf's form), ``gelu_tanh`` (GPT-2's) and ``silu`` (``x * sigmoid(x)``),
over a tensor of that shape. Each kernel is compiled by ``codegen.compile_scope`` (TVM, this
CPU), its buffers prepared once, and the kernels are timed in turns, ``--rounds`` times (``vs_torch.interleaved``), so a
drift of the machine hits every one alike. The script only uses ``compile_scope`` and the
builders, so a copy of it times an older commit's code generation too (a worktree): compare
two commits in alternating processes. Prints ms per kernel; writes
bench/results/scalar_functions.json, each row naming its CPU and commit (rows of other cases,
CPUs or commits kept).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import interleaved, write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy)

import numpy as np  # noqa: E402

from codegen import compile_scope  # noqa: E402
from codegen.measure import cpu_model  # noqa: E402
from rewriter import gelu, parse, tensor_shapes  # noqa: E402
from rewriter.ir import UNARY_FUNCTIONS  # noqa: E402

DEFAULT_CASES = "gelu_tanh:32x3072,gelu_tanh:197x3072,gelu:196x1536,tanh:64x56x56,silu:256x28x28,exp:12x197x197"
OUT = ROOT / "bench" / "results" / "scalar_functions.json"


def case_scope(function: str, shape: tuple[int, ...]):
    """``function`` element-wise over a tensor ``A`` of ``shape``, as the notation writes it."""
    if function == "gelu":
        return gelu(shape)
    if function == "gelu_tanh":
        return gelu(shape, approximate="tanh")
    names = [f"i{k}" for k in range(len(shape))]
    box = ", ".join(f"{name}:{n}" for name, n in zip(names, shape))
    read = f"A[{', '.join(names)}]"
    if function == "silu":
        return parse(f"L {box} ; {read} * sigmoid({read})", {"A": shape})
    if function not in UNARY_FUNCTIONS:
        raise SystemExit(f"unknown function {function!r}: one of {sorted(UNARY_FUNCTIONS)}, gelu, gelu_tanh, silu")
    return parse(f"L {box} ; {function}({read})", {"A": shape})


def parse_case(text: str) -> tuple[str, tuple[int, ...]]:
    function, _, shape = text.partition(":")
    try:
        return function, tuple(int(n) for n in shape.split("x"))
    except ValueError:
        raise SystemExit(f"a case is FUNCTION:SHAPE (tanh:64x56x56), not {text!r}") from None


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    calls = {}
    for text in args.cases.split(","):
        function, shape = parse_case(text)
        scope = case_scope(function, shape)
        kernel = compile_scope(scope)
        inputs, out = kernel.prepare(
            **{n: rng.standard_normal(s).astype(np.float32) for n, s in tensor_shapes(scope).items()}
        )
        calls[text] = lambda kernel=kernel, inputs=inputs, out=out: kernel.run(inputs, out)
    medians = interleaved(calls, args.rounds)
    rows = json.loads(OUT.read_text()) if OUT.exists() else []
    cpu, head = cpu_model(), commit()
    for text, seconds in medians.items():
        print(f"{text:24} {seconds * 1e3:8.4f} ms")
        rows = [r for r in rows if (r["case"], r["cpu"], r["commit"]) != (text, cpu, head)]
        rows.append({"case": text, "ms": round(seconds * 1e3, 4), "rounds": args.rounds, "cpu": cpu, "commit": head})
    write_rows(OUT, rows)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
