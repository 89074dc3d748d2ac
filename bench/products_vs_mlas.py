"""Products of the real models' shapes: each CPU implementation against onnxruntime's MLAS.

    python3 bench/products_vs_mlas.py [--shapes 32x3072x768,3x32x768x768,...] [--convs 64x56,...] [--strided 3x224x64k7s2,...]
                                      [--blocked] [--epilogue]

For each ``M x K @ K x N`` product with a weight on the right (a transformer's linear layer;
``BxMxKxN``: one M x K operand against a stack of B such weights, as the optimizer merges
parallel products, attention's Q, K and V of one input, and as one MatMul node broadcasts it),
every implementation the Matmul record lists for the CPU that applies ("blas", "tvm", "packed"), and for
each ``C x H`` 3x3 convolution (C -> C channels, H x H, padding 1, NCHW: ResNet-50's), every
implementation the Conv2d record lists ("im2col", "tvm", "panels"), and for each
``CxHxF kK sS [gG]`` convolution (C -> F channels, H x H, a K x K window of stride S, padding
K/2, G groups: ResNet-50's stem and stride-2 convolutions, MobileNetV2's depthwise ones) the
same (with ``--blocked``, the strided ones as the optimizer's blocked layout writes them, NCHWc
with c the vector's lanes: ``L n, fo, h, w, fi ; S co, ci, r, s ; X[n, co, S*h+r-K/2, S*w+s-K/2,
ci] * W[fi+c*fo, ci+c*co, r, s]``, one eOperator, its output channels' axes fo and fi), is timed
as the optimizer
times it (``codegen.program._timing_call``: the weight cold, in turn over copies that overflow
the last-level cache) and onnxruntime (2 intra-op threads, spinning off) runs a graph of MatMul
(Conv) nodes with one weight each, as many as the optimizer's copies, so that its weights are
cold too. With ``--epilogue`` each product has a bias along its output channels and a ReLU
around it, one eOperator (``relu({product}[..] + B[f])``, as the optimizer fuses a model's), its
implementations those the eOperator races ("tvm", "packed", and with the epilogue computed where
the product is laid out, "transposed", "panels"), against onnxruntime's node with its bias and
a Relu (which onnxruntime fuses into it). Prints ms per product; writes
bench/results/products_vs_mlas.json, each row naming its CPU (``codegen.measure.cpu_model``;
rows of other shapes or CPUs kept).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import interleaved, write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy)

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from codegen.measure import cpu_model  # noqa: E402
from codegen.tvm_kernel import vector_lanes  # noqa: E402
from codegen.program import LIBRARY_CALLS, _cold_copies, _step, _timing_call, implementations  # noqa: E402
from rewriter import conv2d, parse  # noqa: E402
from rewriter.ir import Scope, Tensor, accesses, index_vars, tensor_shapes  # noqa: E402
from rewriter.lower import Kernel, instantiate, postprocess  # noqa: E402


def onnxruntime_products(
    op: str, x_shape, w_shape, y_shape, copies: int, rng, epilogue: int | None = None, **attributes
) -> tuple:
    """A session of ``copies`` ``op`` nodes (MatMul, Conv), each with a weight of its own, and its
    feed; with an ``epilogue`` (the output channels' axis), each with a bias along it and a Relu."""
    nodes, weights = [], []
    for i in range(copies):
        weights.append(numpy_helper.from_array(rng.uniform(-1, 1, w_shape).astype(np.float32), f"w{i}"))
        if epilogue is None:
            nodes.append(helper.make_node(op, ["x", f"w{i}"], [f"y{i}"], **attributes))
            continue
        bias = rng.uniform(-1, 1, y_shape[epilogue]).astype(np.float32)
        along = bias if op == "Conv" else bias.reshape([-1] + [1] * (len(y_shape) - 1 - epilogue))  # (Conv's: 1-d)
        weights.append(numpy_helper.from_array(along, f"b{i}"))
        if op == "Conv":
            nodes.append(helper.make_node(op, ["x", f"w{i}", f"b{i}"], [f"p{i}"], **attributes))
        else:
            nodes.append(helper.make_node(op, ["x", f"w{i}"], [f"m{i}"], **attributes))
            nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"p{i}"]))
        nodes.append(helper.make_node("Relu", [f"p{i}"], [f"y{i}"]))
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, list(y_shape)) for i in range(copies)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    model = helper.make_model(
        helper.make_graph(nodes, "products", [x], outputs, weights), opset_imports=[helper.make_opsetid("", 17)]
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, {"x": rng.uniform(-1, 1, x_shape).astype(np.float32)}


def product(m: int, k: int, n: int, rounds: int, epilogue: bool) -> dict:
    expr = parse(f"L i:{m}, j:{n} ; S k:{k} ; A[i, k] * W[k, j]", {"A": (m, k), "W": (k, n)})
    return run(f"{m}x{k}x{n}", expr, ("MatMul", (m, k), (k, n), (m, n)), {}, rounds, epilogue)


def batched_product(b: int, m: int, k: int, n: int, rounds: int) -> dict:
    """One M x K operand against ``b`` stacked K x N weights (a merge of parallel products)."""
    expr = parse(f"L b:{b}, i:{m}, j:{n} ; S k:{k} ; A[i, k] * W[b, k, j]", {"A": (m, k), "W": (b, k, n)})
    return run(f"{b}x{m}x{k}x{n}", expr, ("MatMul", (m, k), (b, k, n), (b, m, n)), {}, rounds)


def convolution(c: int, h: int, rounds: int, epilogue: bool) -> dict:
    shapes = {"X": (1, c, h, h), "W": (c, c, 3, 3)}
    expr = parse(f"L n:1, f:{c}, h:{h}, w:{h} ; S c:{c}, r:3, s:3 ; X[n, c, h+r-1, w+s-1] * W[f, c, r, s]", shapes)
    node = ("Conv", shapes["X"], shapes["W"], (1, c, h, h))
    return run(f"conv3x3 {c}x{h}x{h}", expr, node, {"pads": [1] * 4}, rounds, epilogue)


def strided_convolution(spec: str, rounds: int, epilogue: bool, blocked: bool = False) -> dict:
    """``CxHxFkKsS`` or ``CxHxFkKsSgG``: C -> F channels over H x H, a K x K window of stride S,
    padding K/2, G groups."""
    c, h, f, k, stride, groups = (
        int(d) for d in re.fullmatch(r"(\d+)x(\d+)x(\d+)k(\d+)s(\d+)(?:g(\d+))?", spec).groups("1")
    )
    x, w = Tensor("X", (1, c, h, h)), Tensor("W", (f, c // groups, k, k))
    expr = conv2d(x, w, stride=stride, padding=k // 2, groups=groups)
    attributes = {"pads": [k // 2] * 4, "strides": [stride] * 2, "group": groups}
    node = ("Conv", x.shape, w.shape, expr.shape)
    if blocked:
        if groups > 1:
            raise SystemExit(f"--blocked: {spec} has groups; only full convolutions are written blocked")
        return run(
            f"conv {spec} NCHW{vector_lanes()}c",
            blocked_convolution(c, h, f, k, stride),
            node,
            attributes,
            rounds,
            epilogue,
        )
    return run(f"conv {spec}", expr, node, attributes, rounds, epilogue)


def blocked_convolution(c: int, h: int, f: int, k: int, stride: int) -> Scope:
    """C -> F channels over H x H as the blocked layout writes it: NCHWc in and out, c the
    vector's lanes; W as given (the optimizer lays it out in panels, ``packed``)."""
    lanes, pad, out = vector_lanes(), k // 2, (h + 2 * (k // 2) - k) // stride + 1
    text = (
        f"L n:1, fo:{f // lanes}, h:{out}, w:{out}, fi:{lanes} ; S co:{c // lanes}, ci:{lanes}, r:{k}, s:{k} ; "
        f"X[n, co, {stride}*h+r-{pad}, {stride}*w+s-{pad}, ci] * W[fi+{lanes}*fo, ci+{lanes}*co, r, s]"
    )
    return parse(text, {"X": (1, c // lanes, h, h, lanes), "W": (f, c, k, k)})


def with_epilogue(expr: Scope) -> tuple[Kernel, int]:
    """The eOperator ``relu({expr}[..] + B[f])``, f the product's output channels (W's index
    over traversal iterators: ``fi+c*fo`` in a blocked layout), and their first axis in the
    output."""
    (weight,) = [a for a in accesses(expr.body) if a.source.name == "W"]
    sizes = {it.name: it.size for it in expr.traversal}
    channel = next(ix for ix in weight.indices if index_vars(ix) & sizes.keys())
    axis = next(d for d, it in enumerate(expr.traversal) if it.name in index_vars(channel))
    names = ", ".join(sizes)
    fused = parse(
        f"L {', '.join(map(str, expr.traversal))} ; relu({{{expr}}}[{names}] + B[{channel}])",
        {**tensor_shapes(expr), "B": (math.prod(sizes[n] for n in index_vars(channel)),)},
    )
    return Kernel("eop", "out", fused, None, weights=frozenset({"W", "B"})), axis


def run(label: str, expr, onnx_node: tuple, attributes: dict, rounds: int, epilogue: bool = False) -> dict:
    """Every implementation of ``expr``'s one kernel (its weight W; with its ``epilogue``)
    against onnxruntime's node."""
    rng = np.random.default_rng(0)
    if epilogue:
        (kernel, axis), label = with_epilogue(expr), f"{label} +bias+relu"
    else:
        ((kernel,), axis) = postprocess(instantiate(expr), weights=("W",)).kernels, None
    applies = [i for i in implementations(kernel) if i == "tvm" or LIBRARY_CALLS[i](kernel, "float32") is not None]
    calls = {impl: _timing_call(_step(kernel, impl, "float32"), "float32", rng) for impl in applies}
    copies = _cold_copies(math.prod(onnx_node[2]) * 4)
    session, feed = onnxruntime_products(*onnx_node, copies, rng, axis, **attributes)
    functions = {
        **{impl: (lambda call=call: [call() for _ in range(copies)]) for impl, call in calls.items()},
        "onnxruntime": lambda: session.run(None, feed),
    }
    medians = interleaved(functions, rounds)
    return {
        "shape": label,
        "cpu": cpu_model(),
        **{f"{name}_ms": round(s / copies * 1e3, 3) for name, s in medians.items()},
    }


def _key(row: dict) -> tuple[str, str]:
    return row["cpu"], row["shape"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="32x3072x768,32x768x3072,32x768x768,197x3072x768,197x768x3072,3136x96x384")
    parser.add_argument("--convs", default="64x56,128x28,256x14,512x7")
    parser.add_argument("--strided", default="3x224x64k7s2,128x56x128k3s2,96x112x96k3s2g96,144x56x144k3s2g144")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epilogue", action="store_true", help="each with a bias and a ReLU around it")
    parser.add_argument(
        "--blocked", action="store_true", help="the strided convolutions in NCHWc, as the model runs them"
    )
    args = parser.parse_args()
    rows = []
    for shape in filter(None, args.shapes.split(",")):
        sizes = [int(d) for d in shape.split("x")]
        if len(sizes) == 4 and args.epilogue:
            raise SystemExit(f"--epilogue: {shape} is a batched product; only single ones take an epilogue")
        rows.append(
            batched_product(*sizes, args.rounds) if len(sizes) == 4 else product(*sizes, args.rounds, args.epilogue)
        )
        print("  ".join(f"{key} {value}" for key, value in rows[-1].items()), flush=True)
    for shape in filter(None, args.convs.split(",")):
        c, h = (int(d) for d in shape.split("x"))
        rows.append(convolution(c, h, args.rounds, args.epilogue))
        print("  ".join(f"{key} {value}" for key, value in rows[-1].items()), flush=True)
    for spec in filter(None, args.strided.split(",")):
        rows.append(strided_convolution(spec, args.rounds, args.epilogue, args.blocked))
        print("  ".join(f"{key} {value}" for key, value in rows[-1].items()), flush=True)
    out = ROOT / "bench" / "results" / "products_vs_mlas.json"
    done = {_key(row) for row in rows}  # a row replaces an earlier one of its shape on this CPU
    earlier = json.loads(out.read_text()) if out.exists() else []
    write_rows(out, [row for row in earlier if _key(row) not in done] + rows)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
