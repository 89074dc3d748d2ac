"""Matrix products of the real models' shapes: each CPU implementation against onnxruntime's MLAS.

    python3 bench/products_vs_mlas.py [--shapes 32x3072x768,32x768x3072,32x768x768,197x3072x768]

For each ``M x K @ K x N`` product with a weight on the right (a transformer's linear layer),
every implementation the Matmul record lists for the CPU ("blas", "tvm", "packed") is timed as
the optimizer times it (``codegen.program._timing_call``: the weight cold, in turn over copies
that overflow the last-level cache) and onnxruntime (2 intra-op threads, spinning off) runs a
graph of MatMul nodes with one weight each, as many as the optimizer's copies, so that its
weights are cold too. Prints ms per product; writes bench/results/products_vs_mlas.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import interleaved, write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from codegen.program import _cold_copies, _step, _timing_call, implementations  # noqa: E402
from rewriter import parse  # noqa: E402
from rewriter.lower import instantiate, postprocess  # noqa: E402


def onnxruntime_products(m: int, k: int, n: int, copies: int, rng) -> tuple:
    """A session of ``copies`` MatMul nodes, each with a weight of its own, and its feed."""
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(copies)]
    weights = [numpy_helper.from_array(rng.uniform(-1, 1, (k, n)).astype(np.float32), f"w{i}") for i in range(copies)]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [m, n]) for i in range(copies)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])
    model = helper.make_model(
        helper.make_graph(nodes, "products", [x], outputs, weights), opset_imports=[helper.make_opsetid("", 17)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, {"x": rng.uniform(-1, 1, (m, k)).astype(np.float32)}


def run(m: int, k: int, n: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    expr = parse(f"L i:{m}, j:{n} ; S k:{k} ; A[i, k] * W[k, j]", {"A": (m, k), "W": (k, n)})
    (kernel,) = postprocess(instantiate(expr), weights=("W",)).kernels
    calls = {impl: _timing_call(_step(kernel, impl, "float32"), "float32", rng) for impl in implementations(kernel)}
    copies = _cold_copies(k * n * 4)
    session, feed = onnxruntime_products(m, k, n, copies, rng)
    functions = {
        **{impl: (lambda call=call: [call() for _ in range(copies)]) for impl, call in calls.items()},
        "onnxruntime": lambda: session.run(None, feed),
    }
    medians = interleaved(functions, rounds)
    return {"shape": f"{m}x{k}x{n}", **{f"{name}_ms": round(s / copies * 1e3, 3) for name, s in medians.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="32x3072x768,32x768x3072,32x768x768,197x3072x768,197x768x3072")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(d) for d in shape.split("x"))
        rows.append(run(m, k, n, args.rounds))
        print("  ".join(f"{key} {value}" for key, value in rows[-1].items()), flush=True)
    out = ROOT / "bench" / "results" / "products_vs_mlas.json"
    write_rows(out, rows)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
