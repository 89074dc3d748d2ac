"""The public cases in PyTorch, in its own layouts (the baseline, written by hand, not by the
engine): used by bench/vs_torch.py on the CPU and bench/gpu_vs_torch.py on the GPU. Needs numpy
and torch only."""

import numpy as np
import torch
import torch.nn.functional as F


def torch_version(name: str, inputs: dict, device: str = "cpu"):
    """(function, its tensor arguments) computing the case in PyTorch's native layouts."""
    t = {n: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(device) for n, v in inputs.items()}
    if name == "conv3x3":  # NHWC / RSFC in the case: NCHW / FCRS for torch
        args = (t["A"].permute(0, 3, 1, 2).contiguous(), t["K"].permute(2, 3, 0, 1).contiguous())
        return (lambda a, k: F.conv2d(a, k, padding=1)), args
    if name == "convtranspose":
        args = (t["A"].permute(0, 3, 1, 2).contiguous(), t["K"].permute(3, 2, 0, 1).contiguous())
        return (lambda a, k: F.conv_transpose2d(a, k, stride=2, padding=1)), args
    if name == "conv5x5":
        return (lambda a, k: F.conv2d(a, k, padding=2)), (t["A"], t["K"])
    if name == "g2bmm":  # out[b, i, j] = sum_k Q[b, i, k] Kt[b, i + 4j - 128, k]: a padded strided view

        def g2bmm(q, kt):
            padded = F.pad(kt, (0, 0, 128, 128))
            b, n, d = q.shape
            s = padded.stride()
            window = padded.as_strided((b, n, 65, d), (s[0], s[1], 4 * s[1], s[2]))
            return torch.einsum("bik,bijk->bij", q, window)

        return g2bmm, (t["Q"], t["Kt"])
    raise KeyError(name)


def to_case_layout(name: str, value: np.ndarray) -> np.ndarray:
    """PyTorch's output of ``torch_version`` in the case's own layout (NCHW back to NHWC)."""
    return value.transpose(0, 2, 3, 1) if name in ("conv3x3", "convtranspose") else value
