"""Real models at full size: the optimized program against onnxruntime, PyTorch eager and
torch.compile, end to end.

    python3 bench/models_vs_runtimes.py [--models bert,gpt2,vit,segformer,convnext,resnet,mobilenetv2]
                                        (or --models smollm: LLaMA's architecture, on request)
                                        [--max-depth 1] [--subprogram-time-limit 10] [--rounds 10]
                                        [--tokens 128] [--image-size 224] [--tune 0] [--blocks 1]

Each model is built from the ``transformers`` library's own definition with its default (full
size) configuration and random weights (no downloads), exported with ``torch.onnx.export``
(opset 17), imported with ``load_onnx`` and optimized with ``optimize_program`` (the path of
``rewriter optimize``), its kernels orchestrated both by Korch's BLP (the default: "optimized")
and by the greedy baseline ("greedy": the plan the BLP's was settled on) from one set of plans
(``vs_torch.greedy_and_orchestrated``). All five are checked against
onnxruntime's output, then timed in one process, interleaved round by round
(``vs_torch.interleaved``), in float32: onnxruntime with 2 intra-op threads and spinning off,
PyTorch under ``no_grad``. Adds (or replaces) one row per model, ``--tune`` (TVM schedules
raced per generated kernel, ``CpuBackend(tune=N)``), OpenBLAS kernel set (the environment's
``OPENBLAS_CORETYPE``, or "auto") and CPU (``codegen.measure.cpu_model``; rows from before
it was recorded are the Zen 5's, family 26) in bench/results/models_vs_runtimes.json,
with the time the optimizer took, the layout its tensors were kept in ("blocked": an NCHW
network's channels in blocks of the CPU's vector, where the stitched programs' whole runs,
``layouts_ms``, said so; both are derived), the BLP's figures (``blp_seconds_ms`` and
``blp_greedy_seconds_ms``: its plan and the greedy one in its own terms, after the plans' kernels
were timed again, ``blp_retimed``), the optimized program's kernel medians
summed (``vs_torch.kernel_sums``: as recorded, and timed in place) and a whole run's time over
them in the run after it (``whole_over_kernels``: what a run spends outside its kernels),
and the greedy program's and onnxruntime's time over ours taken a moment apart, round by round
(``vs_greedy_paired``, ``vs_onnxruntime_paired``: the median ratio and the interval that holds
the true one at 95%, ``vs_torch.paired``; ours is surely faster where the interval lies above 1),
with a copy of ours in the same rounds as their control (``vs_copy_paired``: what the rounds
cannot tell from nothing).
With ``--blocks N`` the interleaved and the paired rounds are taken N times in turn, each
block's figures kept (``blocks``; the row's columns are the first block's).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from vs_torch import greedy_and_orchestrated, interleaved, kernel_sums, orchestration_columns, paired, write_rows  # noqa: E402, I001  (first: it sets the thread pools' idle policy before they load)

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402

from codegen.backend import CpuBackend  # noqa: E402
from codegen.measure import cpu_model  # noqa: E402
from rewriter.frontends.onnx import load_onnx  # noqa: E402

# name -> the model with its default configuration; text models read token ids
MODELS = {
    "bert": lambda: T.BertModel(T.BertConfig(), add_pooling_layer=False),
    "gpt2": lambda: T.GPT2Model(T.GPT2Config()),
    "vit": lambda: T.ViTModel(T.ViTConfig(), add_pooling_layer=False),
    "segformer": lambda: T.SegformerModel(T.SegformerConfig()),
    "convnext": lambda: T.ConvNextModel(T.ConvNextConfig()),
    "resnet": lambda: T.ResNetModel(T.ResNetConfig()),
    "mobilenetv2": lambda: T.MobileNetV2Model(T.MobileNetV2Config()),
    # LLaMA's architecture (RMS norm, rotary positions, grouped KV heads, SiLU-gated MLP) at the
    # published sizes of SmolLM-135M; LlamaConfig's own default is 7B, too large for this machine
    "smollm": lambda: T.LlamaModel(
        T.LlamaConfig(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            attn_implementation="eager",  # SDPA with grouped KV heads does not export to ONNX
        )
    ),
}
TEXT = {"bert", "gpt2", "smollm"}
ON_REQUEST = {"smollm"}  # not in the default run: the seven of the README's table are


class FirstOutput(torch.nn.Module):
    """The model's last hidden state (transformers models return a dataclass of outputs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        return self.model(inputs)[0]


def onnx_runtime(proto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run(name: str, args) -> dict:
    torch.manual_seed(0)
    module = FirstOutput(MODELS[name]().eval()).eval()
    if name in TEXT:
        example = torch.randint(0, module.model.config.vocab_size, (1, args.tokens))
    else:
        example = torch.randn(1, 3, args.image_size, args.image_size)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (example,), buffer, opset_version=17, dynamo=False, input_names=["inputs"])
    proto = onnx.load_from_string(buffer.getvalue())
    model = load_onnx(proto)
    programs, seconds = greedy_and_orchestrated(
        model.program,
        model.weights,
        max_depth=args.max_depth,
        subprogram_time_limit=args.subprogram_time_limit,
        backend=CpuBackend(tune=args.tune),
        on_subprogram=lambda sub, k, n: print(f"  [{k + 1}/{n}] {sub.name}: {sub.state}", file=sys.stderr, flush=True),
    )
    optimized, greedy, copy = programs["blp"], programs["greedy"], programs["copy"]
    session, x = onnx_runtime(proto), example.numpy()
    feeds = {model.names["inputs"]: x}
    compiled = torch.compile(module)
    functions = {
        "optimized": lambda: optimized(**feeds),
        "greedy": lambda: greedy(**feeds),
        "copy": lambda: copy(**feeds),
        "onnxruntime": lambda: session.run(None, {"inputs": x})[0],
        "torch_eager": lambda: module(example),
        "torch_compile": lambda: compiled(example),
    }
    with torch.no_grad():
        want = functions["onnxruntime"]()
        scale = max(1.0, float(np.abs(want).max()))
        for label, fn in functions.items():
            error = float(np.abs(np.asarray(fn()) - want).max()) / scale
            assert error < 1e-3, f"{name}: {label} disagrees with onnxruntime ({error:.2e})"
        blocks = [measured_block(functions, args.rounds, args.paired_seconds) for _ in range(args.blocks)]
    medians, ratios = blocks[0]  # the row's columns; with --blocks, every block's figures beside them
    if len(blocks) > 1:
        ratios = ratios | {"blocks": [{"ms": {k: round(v * 1e3, 3) for k, v in m.items()}, **r} for m, r in blocks]}
    kernels = kernel_sums(optimized.program)
    return {
        "model": name,
        "input": list(example.shape),
        "subprograms": len(optimized.subprograms),
        "max_depth": args.max_depth,
        "subprogram_time_limit": args.subprogram_time_limit,
        "tune": args.tune,
        "openblas_coretype": openblas_coretype(),
        "cpu": cpu_model(),
        **orchestration_columns(programs, seconds),
        **{f"{k}_ms": round(v * 1e3, 3) for k, v in medians.items()},
        **kernels,  # the kernels' own times, and a whole run's over them: what runs between them
        **{f"vs_{k}": round(medians[k] / medians["optimized"], 2) for k in medians if k != "optimized"},
        **ratios,  # each a moment apart from ours: what a slow spell of the machine does not move
    }


def measured_block(functions: dict, rounds: int, paired_seconds: float) -> tuple[dict, dict]:
    """Each function's median of ``rounds`` interleaved rounds, then the paired rounds'
    columns. Blocks in turn (``--blocks``) show whether the two agree in every state of the
    machine: in one that lasts tens of seconds, our ResNet-50 slows more than onnxruntime."""
    medians = interleaved({k: f for k, f in functions.items() if k != "copy"}, rounds)
    return medians, paired({k: functions[k] for k in ("optimized", "greedy", "copy", "onnxruntime")}, paired_seconds)


def _key(row: dict) -> tuple:
    """A row replaces an earlier one of the same model, tune, OpenBLAS kernels and CPU."""
    return (row["cpu"], row["openblas_coretype"], list(MODELS).index(row["model"]), row.get("tune", 0))


def openblas_coretype() -> str:
    """The kernels numpy's OpenBLAS runs: the environment's choice, or "auto" (its own pick for
    the CPU). A row's times hold only for the kernels it was measured with."""
    return os.environ.get("OPENBLAS_CORETYPE", "") or "auto"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(name for name in MODELS if name not in ON_REQUEST))
    parser.add_argument("--max-depth", type=int, default=1)
    parser.add_argument("--subprogram-time-limit", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--tune", type=int, default=0, help="TVM schedules raced per generated kernel")
    parser.add_argument(
        "--paired-seconds",
        type=float,
        default=30.0,
        help="the longest the paired rounds run (a 210 ms model: 24 rounds in 30 s)",
    )
    parser.add_argument(
        "--blocks", type=int, default=1, help="interleaved rounds then paired ones, this many times in turn"
    )
    args = parser.parse_args()
    columns = ("optimize_s", "optimized_ms", "greedy_ms", "onnxruntime_ms", "torch_eager_ms", "torch_compile_ms")
    ratios = ("vs_greedy", "vs_onnxruntime", "vs_torch_eager", "vs_torch_compile")
    print(f"{'model':<12}" + "".join(f"{c:>18}" for c in columns + ratios))
    out = ROOT / "bench" / "results" / "models_vs_runtimes.json"
    for name in args.models.split(","):
        row = run(name, args)
        print(f"{name:<12}" + "".join(f"{row[c]:>18}" for c in columns + ratios), flush=True)
        print(
            f"{'':<12}paired, {row['paired_rounds']} rounds (low, median, high): greedy / ours"
            f" {row['vs_greedy_paired']}, a copy of ours / ours {row['vs_copy_paired']},"
            f" onnxruntime / ours {row['vs_onnxruntime_paired']};"
            f" a whole run over its kernels summed {row['whole_over_kernels']}",
            flush=True,
        )
        # Rows of earlier runs (other models) are kept, so models can be measured one run at a time.
        rows = [r for r in (json.loads(out.read_text()) if out.exists() else []) if _key(r) != _key(row)]
        write_rows(out, sorted(rows + [row], key=_key))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
