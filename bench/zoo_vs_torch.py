"""Whole zoo models: the optimized program against PyTorch eager and torch.compile, end to end.

    python3 bench/zoo_vs_torch.py [--models srcnn,infogan,...] [--small] [--max-depth 2]
                                  [--subprogram-time-limit 20] [--rounds 10]

Each model is built by ``rewriter.frontends.zoo`` as ONNX, imported with ``load_onnx`` and optimized with
``optimize_program`` (the same path as ``rewriter optimize``). The PyTorch baseline runs the same
ONNX graph node by node with torch operators (``TorchGraph`` below: a small executor for the ops
the zoo uses, written for this benchmark; torch.compile traces it into one graph). Both are
checked against ``Model.original`` (onnxruntime) and timed in one process, interleaved,
with the idle settings of bench/vs_torch.py. Adds (or replaces) one row per model and CPU
(``codegen.measure.cpu_model``) in bench/results/zoo_vs_torch.json (zoo_vs_torch_small.json
with --small), with the optimized program's kernel medians summed (``vs_torch.kernel_sums``)
and a whole run's time over them in the run after it (``whole_over_kernels``), and the greedy
program's (the plan the BLP's was settled on, ``vs_torch.greedy_and_orchestrated``) and
torch.compile's time over ours taken a moment apart, round by round
(``vs_greedy_paired``, ``vs_torch_compile_paired``: the median ratio and the interval that
holds the true one at 95%, ``vs_torch.paired``), with a copy of ours in the same rounds as
their control (``vs_copy_paired``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import greedy_and_orchestrated, interleaved, kernel_sums, orchestration_columns, paired, write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy before they load)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from codegen.measure import cpu_model  # noqa: E402
from rewriter import zoo  # noqa: E402
from rewriter.frontends.onnx import load_onnx  # noqa: E402


def _attrs(node) -> dict:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _conv(x, w, b=None, **a):
    pads = a.get("pads", [0, 0, 0, 0])
    x = F.pad(x, (pads[1], pads[3], pads[0], pads[2]))
    return F.conv2d(x, w, b, stride=a.get("strides", 1), dilation=a.get("dilations", 1), groups=a.get("group", 1))


def _conv_transpose(x, w, b=None, **a):
    pads = a.get("pads", [0, 0, 0, 0])
    out = F.conv_transpose2d(x, w, b, stride=a.get("strides", 1), output_padding=a.get("output_padding", 0))
    return out[:, :, pads[0] : out.shape[2] - pads[2], pads[1] : out.shape[3] - pads[3]]


def _gemm(a_, b_, c=None, **a):
    a_ = a_.T if a.get("transA") else a_
    b_ = b_.T if a.get("transB") else b_
    out = a.get("alpha", 1.0) * a_ @ b_
    return out + a.get("beta", 1.0) * c if c is not None else out


def _ints(values) -> list[int]:
    """An integer constant (shape, starts, pads): a tuple of ints, so torch.compile sees it as static."""
    return [int(v) for v in values]


def _slice(x, starts, ends, axes=None, steps=None, **a):
    index = [slice(None)] * x.dim()
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(axes)
    for axis, s, e, st in zip(axes, _ints(starts), _ints(ends), steps):
        index[axis] = slice(s, e, st)
    return x[tuple(index)]


def _pad(x, pads, value=None, **a):
    pads = _ints(pads)
    half = len(pads) // 2
    torch_pads = [p for axis in reversed(range(half)) for p in (pads[axis], pads[axis + half])]
    return F.pad(x, torch_pads, value=float(value) if value is not None else 0.0)


def _maxpool(x, **a):
    pads = a.get("pads", [0, 0, 0, 0])
    x = F.pad(x, (pads[1], pads[3], pads[0], pads[2]), value=float("-inf"))
    return F.max_pool2d(x, a["kernel_shape"], a.get("strides", 1))


OPS = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Gemm": _gemm,
    "MatMul": torch.matmul,
    "Add": torch.add,
    "Mul": torch.mul,
    "Relu": lambda x, **a: F.relu(x),
    "Tanh": lambda x, **a: torch.tanh(x),
    "BatchNormalization": lambda x, s, b, m, v, **a: F.batch_norm(x, m, v, s, b, eps=a.get("epsilon", 1e-5)),
    "Reshape": lambda x, shape, **a: x.reshape(_ints(shape)),
    "Flatten": lambda x, **a: x.flatten(a.get("axis", 1)),
    "Transpose": lambda x, **a: x.permute(a["perm"]),
    "GlobalAveragePool": lambda x, **a: x.mean(dim=(2, 3), keepdim=True),
    "MaxPool": _maxpool,
    "Softmax": lambda x, **a: torch.softmax(x, dim=a.get("axis", -1)),
    "Concat": lambda *xs, **a: torch.cat(xs, dim=a["axis"]),
    "Slice": _slice,
    "Pad": _pad,
}


class TorchGraph:
    """The ONNX graph run node by node with torch operators (the baseline, not the engine)."""

    def __init__(self, model):
        self.nodes = [(n.op_type, list(n.input), list(n.output), _attrs(n)) for n in model.graph.node]
        arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        # integer constants (shapes, slice bounds, pads) as Python ints: static for torch.compile
        self.constants = {
            name: tuple(int(v) for v in a.ravel()) if a.dtype.kind in "iu" else torch.from_numpy(a.copy())
            for name, a in arrays.items()
        }
        self.inputs = [i.name for i in model.graph.input if i.name not in self.constants]
        self.outputs = [o.name for o in model.graph.output]

    def __call__(self, *args):
        values = dict(self.constants)
        values.update(zip(self.inputs, args))
        for op, inputs, outputs, attrs in self.nodes:
            values[outputs[0]] = OPS[op](*(values[n] if n else None for n in inputs), **attrs)
        return values[self.outputs[0]]


def run(name: str, small: bool, max_depth: int, subprogram_time_limit: float, rounds: int) -> dict:
    onnx_model = zoo.build(name, small=small)
    model = load_onnx(onnx_model)
    programs, seconds = greedy_and_orchestrated(
        model.program, model.weights, max_depth=max_depth, subprogram_time_limit=subprogram_time_limit
    )
    optimized, greedy, copy = programs["blp"], programs["greedy"], programs["copy"]
    ((input_name, shape),) = model.inputs.items()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = model.original({input_name: x})[model.outputs[0]]
    graph = TorchGraph(onnx_model)
    tx = torch.from_numpy(x)
    compiled = torch.compile(graph)
    functions = {
        "optimized": lambda: optimized(**{model.names[input_name]: x}),
        "greedy": lambda: greedy(**{model.names[input_name]: x}),
        "copy": lambda: copy(**{model.names[input_name]: x}),
        "torch_eager": lambda: graph(tx),
        "torch_compile": lambda: compiled(tx),
    }
    scale = max(1.0, float(np.abs(want).max()))
    with torch.no_grad():
        for label, fn in functions.items():
            got = np.asarray(fn())
            error = float(np.abs(got - want).max()) / scale
            assert error < 1e-3, f"{name}: {label} disagrees with the reference ({error:.2e})"
        medians = interleaved({k: f for k, f in functions.items() if k != "copy"}, rounds)
        ratios = paired({k: functions[k] for k in ("optimized", "greedy", "copy", "torch_compile")})
    kernels = kernel_sums(optimized.program)
    return {
        "model": name,
        "small": small,
        "cpu": cpu_model(),
        "subprograms": len(optimized.subprograms),
        **orchestration_columns(programs, seconds),
        **{f"{k}_ms": round(v * 1e3, 3) for k, v in medians.items()},
        "vs_greedy": round(medians["greedy"] / medians["optimized"], 2),
        "vs_torch_eager": round(medians["torch_eager"] / medians["optimized"], 2),
        "vs_torch_compile": round(medians["torch_compile"] / medians["optimized"], 2),
        **kernels,  # the kernels' own times, and a whole run's over them: what runs between them
        **ratios,  # each a moment apart from ours: what a slow spell of the machine does not move
    }


def _key(row: dict) -> tuple[str, int]:
    """A row replaces an earlier one of the same model and CPU."""
    return row["cpu"], zoo.NAMES.index(row["model"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(zoo.NAMES))
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--max-depth", type=int, default=2)
    parser.add_argument("--subprogram-time-limit", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(
        f"{'model':<12}{'subprograms':>12}{'kernels':>8}{'shared':>7}{'optimize s':>11}{'ours ms':>10}{'greedy ms':>10}"
        f"{'eager ms':>10}{'compile ms':>11}{'x greedy':>9}{'x eager':>9}{'x compile':>10}"
    )
    out = ROOT / "bench" / "results" / ("zoo_vs_torch_small.json" if args.small else "zoo_vs_torch.json")
    for name in args.models.split(","):
        row = run(name, args.small, args.max_depth, args.subprogram_time_limit, args.rounds)
        print(
            f"{name:<12}{row['subprograms']:>12}{row['kernels']:>8}{row['shared_kernels']:>7}{row['optimize_s']:>11}"
            f"{row['optimized_ms']:>10}{row['greedy_ms']:>10}{row['torch_eager_ms']:>10}"
            f"{row['torch_compile_ms']:>11}{row['vs_greedy']:>9}{row['vs_torch_eager']:>9}{row['vs_torch_compile']:>10}",
            flush=True,
        )
        print(
            f"{'':<12}paired, {row['paired_rounds']} rounds (low, median, high): greedy / ours"
            f" {row['vs_greedy_paired']}, a copy of ours / ours {row['vs_copy_paired']},"
            f" torch.compile / ours {row['vs_torch_compile_paired']};"
            f" a whole run over its kernels summed {row['whole_over_kernels']}",
            flush=True,
        )
        # Rows of earlier runs (other models, other CPUs) are kept, so models can be measured one run at a time.
        rows = [r for r in (json.loads(out.read_text()) if out.exists() else []) if _key(r) != _key(row)]
        write_rows(out, sorted(rows + [row], key=_key))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
