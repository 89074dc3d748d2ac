"""``python -m bundle``: measure or run bundles on this machine's GPU (numpy and CuPy only).

python -m bundle measure DIR [DIR ...] --out timings.json [--repeats 20]
python -m bundle run DIR --input NAME=FILE.npy ... --out y.npy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .format import BundleError, read

try:
    from . import cuda
except ImportError as err:  # the runtime needs CuPy (pip install ".[gpu]") and a CUDA driver
    cuda, _MISSING = None, err


def _write_json(path: Path, value: dict) -> None:
    """Atomically: a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bundle", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser("measure", help="verify and time every bundle under the directories")
    m.add_argument("directories", nargs="+", type=Path)
    m.add_argument("--out", type=Path, required=True, help="timings file (JSON) for `rewriter derive --timings`")
    m.add_argument("--repeats", type=int, default=20)
    r = commands.add_parser("run", help="run one bundle on inputs")
    r.add_argument("directory", type=Path)
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    r.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if cuda is None:
        print(f"error: python -m bundle runs bundles on an NVIDIA GPU with CuPy: {_MISSING}", file=sys.stderr)
        return 2
    try:
        if args.command == "measure":
            merged = {"device": cuda.device_name(), "bundles": {}}
            for directory in args.directories:
                merged["bundles"].update(cuda.measure_directory(directory, args.repeats)["bundles"])
            _write_json(args.out, merged)
            bad = [r["path"] for r in merged["bundles"].values() if not r["verified"]]
            print(f"{len(merged['bundles'])} bundle(s) on {merged['device']}: {len(bad)} failed verification {bad}")
            return 0
        inputs = {}
        for item in args.input:
            name, _, file = item.partition("=")
            inputs[name] = np.load(file)
        np.save(args.out, cuda.CudaProgram(read(args.directory)).run(inputs))
        return 0
    except BundleError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
