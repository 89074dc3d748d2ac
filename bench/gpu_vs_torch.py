"""The derived GPU programs against PyTorch (eager: cuDNN/cuBLAS, and torch.compile) on the GPU.

Two steps, on two machines if need be (the GPU machine needs numpy, CuPy and torch only):

    python3 bench/gpu_vs_torch.py prepare [--cases conv3x3,...] [--depth 3] [--time-limit 300] [--dir DIR]
    python3 bench/gpu_vs_torch.py run [--dir DIR] [--rounds 20]

``prepare`` derives every public case on the cuda backend and writes every compiled candidate
and the expression as written (one generated kernel) as bundles under ``DIR/CASE/``;
``DIR/CASE/case.json`` names the as-written one. Weights are inputs here, not bound (bound,
a full-size convolution's weights in every bundle would outgrow what can be carried to a GPU
machine): a kernel that transforms weights is timed per call, which OLLIE does not count. ``run`` verifies every bundle on the GPU against its check data and times it as one CUDA
graph; then, per case, the fastest verified bundle, the as-written one, PyTorch eager and
``torch.compile`` on the same computation in PyTorch's layouts are timed interleaved, round by
round, in float32 with TF32 off for PyTorch as for cuBLAS here, and cuDNN's autotuner on
(``cudnn.benchmark``). Writes
bench/results/gpu_vs_torch.json with the device name, beside OLLIE's A100 figures.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = "conv3x3,convtranspose,conv5x5,g2bmm"
# OLLIE (Table/Figure 11, A100): the operator as written -> OLLIE's program, ms
OLLIE_A100_MS = {
    "conv3x3": (0.126, 0.046),
    "convtranspose": (0.136, 0.032),
    "conv5x5": (0.854, 0.528),
    "g2bmm": (20.3, 2.59),
}


def prepare(args) -> None:
    from codegen.cuda import CudaBackend, to_bundle  # noqa: PLC0415  (TVM, egglog: not on the GPU machine)
    from rewriter import derive  # noqa: PLC0415
    from rewriter.cases import CASES as ALL  # noqa: PLC0415
    from rewriter.lower import Candidate, Kernel  # noqa: PLC0415

    for name in args.cases.split(","):
        case, directory = ALL[name], Path(args.dir) / name
        expr = case.expression()
        start = time.perf_counter()
        backend = CudaBackend(bundles=directory)
        derivation = derive(expr, max_depth=args.depth, time_limit=args.time_limit, backend=backend)
        derive_s = time.perf_counter() - start
        as_written = to_bundle(Candidate([Kernel("eop", "out", expr)]), case.shapes)
        as_written.write(directory / as_written.key)
        manifest = {"case": name, "expression": str(expr), "as_written": as_written.key, "derive_s": derive_s}
        (directory / "case.json").write_text(json.dumps(manifest, indent=1))
        print(f"{name}: {len(derivation.candidates)} candidates in {derive_s:.0f} s", flush=True)


def _timed(functions: dict, sync, rounds: int) -> dict:
    """Median seconds per call of each function, interleaved round by round (batches ≥ 2 ms)."""
    inner = {}
    for name, fn in functions.items():
        fn(), fn(), sync()
        start = time.perf_counter()
        fn()
        sync()
        inner[name] = max(1, min(1000, int(2e-3 / max(time.perf_counter() - start, 1e-6))))
    samples = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            sync()
            start = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / inner[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def run(args) -> None:
    import cupy as cp  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from torch_cases import to_case_layout, torch_version  # noqa: PLC0415

    from bundle import cuda as gpu  # noqa: PLC0415
    from bundle.format import check_inputs, read  # noqa: PLC0415

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm, as a tuned setup would
    rows = []
    for manifest_path in sorted(Path(args.dir).glob("*/case.json")):
        manifest = json.loads(manifest_path.read_text())
        name = manifest["case"]
        measured = gpu.measure_directory(manifest_path.parent, repeats=5)["bundles"]
        verified = {k: r for k, r in measured.items() if r["verified"]}
        failed = {
            r["path"]: r.get("failure", f"error {r['error']:.2e}") for r in measured.values() if not r["verified"]
        }
        best_key = min(verified, key=lambda k: verified[k]["graph"])
        timed = {"derived": best_key, "as_written": manifest["as_written"]}
        timed = {label: key for label, key in timed.items() if key in verified}
        programs = {
            label: gpu.CudaProgram(read(manifest_path.parent / measured[key]["path"])) for label, key in timed.items()
        }
        inputs = check_inputs(programs["derived"].bundle.inputs, 0, "float32")
        fn, fn_args = torch_version(name, inputs, device="cuda")
        ours = programs["derived"].run(inputs)
        with torch.no_grad():
            theirs = to_case_layout(name, fn(*fn_args).cpu().numpy())
        disagreement = float(np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max()))
        assert disagreement < 1e-3, f"{name}: the derived program and PyTorch disagree ({disagreement:.2e})"
        compiled = torch.compile(fn)
        functions = {label: program.launch for label, program in programs.items()}
        functions |= {"torch_eager": lambda: fn(*fn_args), "torch_compile": lambda: compiled(*fn_args)}

        def sync():
            cp.cuda.Device().synchronize()
            torch.cuda.synchronize()

        with torch.no_grad():
            medians = _timed(functions, sync, args.rounds)
        ms = {k: v * 1e3 for k, v in medians.items()}
        row = {
            "case": name,
            "device": gpu.device_name(),
            "bundles": len(measured),
            "failed_verification": failed,
            "derived_kernels": measured[best_key]["labels"],
            "vs_torch_disagreement": disagreement,
            **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
            "vs_as_written": round(ms["as_written"] / ms["derived"], 2) if "as_written" in ms else None,
            "vs_torch_eager": round(ms["torch_eager"] / ms["derived"], 2),
            "vs_torch_compile": round(ms["torch_compile"] / ms["derived"], 2),
            "ollie_a100_ms": OLLIE_A100_MS.get(name),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = ROOT / "bench" / "results" / "gpu_vs_torch.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("prepare", "run"))
    parser.add_argument("--dir", default=str(ROOT / "bench" / "gpu_bundles"))
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    (prepare if args.step == "prepare" else run)(args)


if __name__ == "__main__":
    main()
