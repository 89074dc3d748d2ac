"""Models written with ``torch.nn`` (not our zoo), exported by ``torch.onnx.export`` and by
``torch.export`` as users do, imported, optimized end to end and compared with onnxruntime and
with the module itself."""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from rewriter.frontends.onnx import load_onnx  # noqa: E402
from rewriter.frontends.torch import from_torch  # noqa: E402
from rewriter.pipeline import optimize_program  # noqa: E402


class MlpBlock(torch.nn.Module):
    """Linear -> GELU -> Linear -> LayerNorm, the transformer feed-forward block."""

    def __init__(self, width=32, hidden=64):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.down(torch.nn.functional.gelu(self.up(x))))


class GatedBlock(torch.nn.Module):
    """Masks, clamps and a tanh-approximated GELU: comparisons, where, clip, pow and rsqrt-style
    normalisation as exporters emit them."""

    def forward(self, x):
        mask = x > 0.25
        y = torch.where(mask, x, torch.zeros_like(x) - 1e4)
        y = torch.clamp(y, -3.0, 3.0)
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm
        return torch.nn.functional.gelu(y * scale, approximate="tanh") + torch.erf(x).abs().floor()


def exported(module, x, opset=17):
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), (x,), buffer, opset_version=opset, dynamo=False, input_names=["x"])
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("module", [MlpBlock(), GatedBlock()], ids=["mlp_gelu_layernorm", "masks_and_clamps"])
def test_a_torch_module_exported_to_onnx_optimizes_and_matches_onnxruntime_and_torch(module):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32)
    proto = exported(module, x)
    model = load_onnx(proto)
    optimized = optimize_program(model.program, model.weights, max_depth=1, subprogram_time_limit=10)
    got = optimized(**{model.names["x"]: x.numpy()})
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x.numpy()})
    with torch.no_grad():
        expected = module(x).numpy()
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 * scale)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("module", [MlpBlock(), GatedBlock()], ids=["mlp_gelu_layernorm", "masks_and_clamps"])
def test_the_same_modules_through_torch_export_optimize_and_match_torch(module):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32)
    model = from_torch(module.eval(), (x,))
    optimized = optimize_program(model.program, model.weights, max_depth=1, subprogram_time_limit=10)
    ((name, _),) = model.inputs.items()
    got = optimized(**{model.names[name]: x.numpy()})
    with torch.no_grad():
        expected = module(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(expected).max())))
