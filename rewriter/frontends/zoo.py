"""Model zoo: OLLIE's seven evaluation models (paper section 6.1) as ONNX graphs built in code.

    from rewriter import zoo
    model = zoo.build("resnet18")              # onnx.ModelProto, seeded random weights
    zoo.save("srcnn", "srcnn.onnx", small=True)

No downloads and no torch: every graph is written with ``onnx.helper`` and its weights drawn from
``numpy.random.default_rng(seed)`` (He-normal convolutions, so activations keep their scale through
deep stacks; BatchNormalization statistics near the identity). The sizes are the papers' where they
give them (OLLIE Table 3 fixes the batch of the GANs and SRCNN at 16 and Longformer's attention
band); ``small=True`` keeps each architecture's structure with few channels and small images, for
tests. Every model has one float32 input named ``input`` and one output named ``output``, opset 17.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import numpy as np

__all__ = ["NAMES", "build", "describe", "save"]

OPSET = 17
IR_VERSION = 8  # the IR version of opset 17: older runtimes refuse newer ones


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ImportError("the model zoo needs the onnx package: pip install 'rewriter[onnx]'") from None
    return onnx


class _Graph:
    """Accumulates nodes and seeded random initializers; every layer method returns its output name."""

    def __init__(self, seed: int):
        self.onnx = _onnx()
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.initializers: list = []
        self.counts: dict[str, int] = {}

    def fresh(self, prefix: str) -> str:
        self.counts[prefix] = self.counts.get(prefix, 0) + 1
        return f"{prefix}{self.counts[prefix]}"

    def constant(self, name: str, value) -> str:
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def param(self, name: str, shape: Sequence[int], fan_in: int) -> str:
        """He-normal weights (std sqrt(2 / fan_in))."""
        return self.constant(name, (self.rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32))

    def small_param(self, name: str, shape: Sequence[int], spread: float = 0.1, centre: float = 0.0) -> str:
        return self.constant(name, (centre + spread * self.rng.standard_normal(shape)).astype(np.float32))

    def node(self, op: str, inputs: Sequence[str], name: str | None = None, **attributes) -> str:
        name = name or self.fresh(op.lower())
        self.nodes.append(self.onnx.helper.make_node(op, list(inputs), [name], name=name, **attributes))
        return name

    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        kernel: Sequence[int],
        stride: int = 1,
        pads: Sequence[int] | None = None,
        dilation: int = 1,
        bias: bool = True,
        bn: bool = False,
        act: str | None = None,
    ) -> str:
        """Conv (+ BatchNormalization) (+ activation); ``pads`` defaults to 'same' for stride 1."""
        name = self.fresh("conv")
        kh, kw = kernel
        pads = pads if pads is not None else [dilation * (kh - 1) // 2, dilation * (kw - 1) // 2] * 2
        inputs = [x, self.param(f"{name}.weight", (cout, cin, kh, kw), cin * kh * kw)]
        if bias:
            inputs.append(self.small_param(f"{name}.bias", (cout,)))
        y = self.node(
            "Conv",
            inputs,
            name,
            kernel_shape=list(kernel),
            strides=[stride, stride],
            pads=list(pads),
            dilations=[dilation, dilation],
        )
        return self.activation(self.batch_norm(y, cout) if bn else y, act)

    def conv_transpose(
        self,
        x: str,
        cin: int,
        cout: int,
        kernel: int,
        stride: int,
        pad: int,
        output_padding: int = 0,
        bn: bool = False,
        act: str | None = None,
    ) -> str:
        name = self.fresh("deconv")
        weight = self.param(f"{name}.weight", (cin, cout, kernel, kernel), cin * kernel * kernel // (stride * stride))
        inputs = [x, weight] if bn else [x, weight, self.small_param(f"{name}.bias", (cout,))]
        y = self.node(
            "ConvTranspose",
            inputs,
            name,
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad] * 4,
            output_padding=[output_padding] * 2,
        )
        return self.activation(self.batch_norm(y, cout) if bn else y, act)

    def batch_norm(self, x: str, channels: int) -> str:
        name = self.fresh("bn")
        params = [
            self.small_param(f"{name}.scale", (channels,), centre=1.0),
            self.small_param(f"{name}.bias", (channels,)),
            self.small_param(f"{name}.mean", (channels,)),
            self.constant(f"{name}.var", self.rng.uniform(0.5, 1.5, channels).astype(np.float32)),
        ]
        return self.node("BatchNormalization", [x, *params], name, epsilon=1e-5)

    def activation(self, x: str, act: str | None) -> str:
        return x if act is None else self.node(act, [x])

    def gemm(self, x: str, fin: int, fout: int) -> str:
        name = self.fresh("fc")
        weight = self.param(f"{name}.weight", (fout, fin), fin)
        return self.node("Gemm", [x, weight, self.small_param(f"{name}.bias", (fout,))], name, transB=1)

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        name = self.fresh("reshape")
        return self.node("Reshape", [x, self.constant(f"{name}.shape", np.array(shape, np.int64))], name)

    def model(self, name: str, input_shape: Sequence[int], output: str):
        """The ModelProto, its shapes inferred and checked; the last node's result is "output"."""
        onnx = self.onnx
        helper = onnx.helper
        assert self.nodes[-1].output[0] == output, "a model function returns its last node's result"
        self.nodes[-1].output[0] = "output"
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, list(input_shape))],
            [helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, None)],
            self.initializers,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION, producer_name="rewriter.zoo"
        )
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        onnx.checker.check_model(model)
        return model


# --------------------------------------------------------------------------------------------
# The models


def _infogan(g: _Graph, small: bool):
    """InfoGAN generator (Chen et al., "InfoGAN: Interpretable Representation Learning by
    Information Maximizing Generative Adversarial Nets", NeurIPS 2016, appendix C: the CelebA
    generator): FC to 2x2x448 + BN + ReLU, then four 4x4 stride-2 transposed convolutions to 256
    (+ BN), 128, 64 channels with ReLU and to 3 channels with Tanh.

    Input z (16, 228) (batch 16 as OLLIE Table 3); output (16, 3, 32, 32).
    small: z (2, 16), channels 16, 8, 8, 4, output (2, 3, 32, 32).
    """
    batch, z, widths = (2, 16, (16, 8, 8, 4)) if small else (16, 228, (448, 256, 128, 64))
    x = g.activation(g.batch_norm(g.gemm("input", z, widths[0] * 4), widths[0] * 4), "Relu")
    x = g.reshape(x, (batch, widths[0], 2, 2))
    x = g.conv_transpose(x, widths[0], widths[1], 4, 2, 1, bn=True, act="Relu")
    x = g.conv_transpose(x, widths[1], widths[2], 4, 2, 1, act="Relu")
    x = g.conv_transpose(x, widths[2], widths[3], 4, 2, 1, act="Relu")
    return (batch, z), g.conv_transpose(x, widths[3], 3, 4, 2, 1, act="Tanh")


def _dcgan(g: _Graph, small: bool):
    """DCGAN generator (Radford et al., "Unsupervised Representation Learning with Deep
    Convolutional Generative Adversarial Networks", ICLR 2016, figure 1): z projected and reshaped
    to 4x4x1024 (+ BN + ReLU), then four 5x5 stride-2 transposed convolutions (padding 2, output
    padding 1, so each doubles the image) to 512, 256, 128 channels with BN + ReLU and to 3
    channels with Tanh.

    Input z (16, 100) (batch 16 as OLLIE Table 3); output (16, 3, 64, 64).
    small: z (2, 16), channels 16, 8, 8, 4, output (2, 3, 64, 64).
    """
    batch, z, widths = (2, 16, (16, 8, 8, 4)) if small else (16, 100, (1024, 512, 256, 128))
    x = g.reshape(g.gemm("input", z, widths[0] * 16), (batch, widths[0], 4, 4))
    x = g.activation(g.batch_norm(x, widths[0]), "Relu")
    for cin, cout in zip(widths, widths[1:]):
        x = g.conv_transpose(x, cin, cout, 5, 2, 2, output_padding=1, bn=True, act="Relu")
    return (batch, z), g.conv_transpose(x, widths[-1], 3, 5, 2, 2, output_padding=1, act="Tanh")


def _srcnn(g: _Graph, small: bool):
    """SRCNN (Dong et al., "Image Super-Resolution Using Deep Convolutional Networks", TPAMI 2016,
    the 9-1-5 network): 9x9 conv to 64 channels + ReLU, 1x1 conv to 32 + ReLU, 5x5 conv to 1,
    padded to keep the image size (as OLLIE's Conv5x5 case, padding 2).

    Input (16, 1, 224, 224) (OLLIE Table 3); output (16, 1, 224, 224).
    small: input (2, 1, 12, 12), channels 8 and 4.
    """
    shape, (n1, n2) = ((2, 1, 12, 12), (8, 4)) if small else ((16, 1, 224, 224), (64, 32))
    x = g.conv("input", 1, n1, (9, 9), act="Relu")
    x = g.conv(x, n1, n2, (1, 1), act="Relu")
    return shape, g.conv(x, n2, 1, (5, 5))


def _gcn(g: _Graph, small: bool):
    """Global Convolutional Network block (Peng et al., "Large Kernel Matters -- Improve Semantic
    Segmentation by Global Convolutional Network", CVPR 2017, figure 2): a k x 1 then 1 x k
    convolution in one branch, 1 x k then k x 1 in the other, summed; then the Boundary
    Refinement block (3x3 conv + ReLU + 3x3 conv, added back). k = 15, 21 classes, on the res-5
    features (2048 channels, 16 x 16) of a 512 x 512 image.

    Input (1, 2048, 16, 16); output (1, 21, 16, 16).
    small: input (1, 16, 8, 8), k = 5, 4 classes.
    """
    shape, k, classes = ((1, 16, 8, 8), 5, 4) if small else ((1, 2048, 16, 16), 15, 21)
    cin = shape[1]
    left = g.conv(g.conv("input", cin, classes, (k, 1)), classes, classes, (1, k))
    right = g.conv(g.conv("input", cin, classes, (1, k)), classes, classes, (k, 1))
    x = g.node("Add", [left, right])
    refined = g.conv(g.conv(x, classes, classes, (3, 3), act="Relu"), classes, classes, (3, 3))
    return shape, g.node("Add", [x, refined])


def _resnet18(g: _Graph, small: bool):
    """ResNet-18 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, table 1):
    7x7/2 conv + BN + ReLU, 3x3/2 max pool, four stages of two basic blocks (64, 128, 256, 512
    channels; 1x1/2 conv + BN shortcuts where the shape changes), global average pool, FC 1000.

    Input (1, 3, 224, 224) (batch 1); output (1, 1000).
    small: input (1, 3, 32, 32), channels 4, 8, 16, 32, 10 classes.
    """
    shape, widths, classes = (
        ((1, 3, 32, 32), (4, 8, 16, 32), 10) if small else ((1, 3, 224, 224), (64, 128, 256, 512), 1000)
    )
    x = g.conv("input", 3, widths[0], (7, 7), stride=2, pads=[3] * 4, bias=False, bn=True, act="Relu")
    x = g.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    cin = widths[0]
    for stage, cout in enumerate(widths):
        for block in range(2):
            stride = 2 if stage and not block else 1
            y = g.conv(x, cin, cout, (3, 3), stride=stride, pads=[1] * 4, bias=False, bn=True, act="Relu")
            y = g.conv(y, cout, cout, (3, 3), pads=[1] * 4, bias=False, bn=True)
            shortcut = (
                x
                if stride == 1 and cin == cout
                else g.conv(x, cin, cout, (1, 1), stride=stride, pads=[0] * 4, bias=False, bn=True)
            )
            x = g.node("Relu", [g.node("Add", [y, shortcut])])
            cin = cout
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x])], axis=1)
    return shape, g.gemm(x, cin, classes)


def _csrnet(g: _Graph, small: bool):
    """CSRNet (Li et al., "CSRNet: Dilated Convolutional Neural Networks for Understanding the
    Highly Congested Scenes", CVPR 2018, configuration B): the first ten 3x3 convolutions of VGG-16
    (64, 64, M, 128, 128, M, 256, 256, 256, M, 512, 512, 512; M a 2x2 max pool) then six 3x3
    convolutions with dilation 2 (512, 512, 512, 256, 128, 64), all with ReLU, and a 1x1
    convolution to the density map.

    Input (1, 3, 224, 224) (batch 1); output (1, 1, 28, 28).
    small: input (1, 3, 32, 32), channels divided by 16; output (1, 1, 4, 4).
    """
    divisor, shape = (16, (1, 3, 32, 32)) if small else (1, (1, 3, 224, 224))
    front = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512]
    back = [512, 512, 512, 256, 128, 64]
    x, cin = "input", 3
    for width in front:
        if width == "M":
            x = g.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
            continue
        x, cin = g.conv(x, cin, width // divisor, (3, 3), act="Relu"), width // divisor
    for width in back:
        x, cin = g.conv(x, cin, width // divisor, (3, 3), dilation=2, act="Relu"), width // divisor
    return shape, g.conv(x, cin, 1, (1, 1))


def _longformer(g: _Graph, small: bool):
    """One Longformer self-attention layer (Beltagy et al., "Longformer: The Long-Document
    Transformer", 2020) with a dilated sliding window: Q/K/V projections (MatMul + Add), per head
    the band scores ``S[h, i, j] = Q[h, i] . K[h, i + d*(j - W)] / sqrt(D)`` for j in [0, 2W], the
    band outside the sequence masked, softmax over the band, ``ctx[h, i] = sum_j P[h, i, j] *
    V[h, i + d*(j - W)]``, and the output projection.

    ONNX has no band operator; the band is written with ops the front-end supports, exactly and
    with the band's work (no dense N x N scores): K and V are zero-padded by d*W along the
    sequence, 2W+1 Slices (one per band offset, step 1, start d*j) are concatenated into
    "unfolded" (H, N, 2W+1, D) tensors, and the two band products (OLLIE's G2BMM and GBMM) are
    each one batched MatMul against them. Out-of-sequence keys get score -1e9 before the softmax
    (Longformer's masking; G2BMM alone reads them as 0).

    Sizes as OLLIE's G2BMM case: sequence 10000, 8 heads of 64 (hidden 512), W = 32, dilation 4.
    Input (1, 10000, 512); output (1, 10000, 512).
    small: sequence 16, 2 heads of 4 (hidden 8), W = 2, dilation 2.
    """
    n, heads, dim, w, d = (16, 2, 4, 2, 2) if small else (10000, 8, 64, 32, 4)
    hidden, band = heads * dim, 2 * w + 1

    def project(x: str, role: str) -> str:
        weight = g.param(f"{role}.weight", (hidden, hidden), hidden)
        y = g.node("Add", [g.node("MatMul", [x, weight]), g.small_param(f"{role}.bias", (hidden,))], role)
        return g.node("Transpose", [g.reshape(y, (n, heads, dim))], perm=[1, 0, 2])  # (H, N, D)

    def unfold(x: str) -> str:
        """(H, N, D) -> (H, N, 2W+1, D): row i, band slot j holds row i + d*(j - W), 0 outside."""
        padded = g.node(
            "Pad",
            [
                g.reshape(x, (heads, n, 1, dim)),
                g.constant(g.fresh("pads"), np.array([0, d * w, 0, 0, 0, d * w, 0, 0], np.int64)),
            ],
        )
        offsets = [
            g.node(
                "Slice",
                [
                    padded,
                    g.constant(g.fresh("start"), np.array([d * j], np.int64)),
                    g.constant(g.fresh("end"), np.array([d * j + n], np.int64)),
                    g.constant(g.fresh("axis"), np.array([1], np.int64)),
                ],
            )
            for j in range(band)
        ]
        return g.node("Concat", offsets, axis=2)

    q, k, v = (project("input", role) for role in ("query", "key", "value"))
    q = g.node("Mul", [q, g.constant("scale", np.array(1.0 / math.sqrt(dim), np.float32))])
    scores = g.node("MatMul", [unfold(k), g.reshape(q, (heads, n, dim, 1))], "band_scores")  # G2BMM
    rows, slots = np.arange(n)[:, None], np.arange(band)[None, :]
    outside = (rows + d * (slots - w) < 0) | (rows + d * (slots - w) >= n)
    scores = g.node(
        "Add",
        [g.reshape(scores, (heads, n, band)), g.constant("band_mask", np.where(outside, -1e9, 0).astype(np.float32))],
    )
    probs = g.reshape(g.node("Softmax", [scores], axis=-1), (heads, n, 1, band))
    context = g.node("MatMul", [probs, unfold(v)], "band_context")  # GBMM
    context = g.node("Transpose", [g.reshape(context, (heads, n, dim))], perm=[1, 0, 2])
    out = g.node("MatMul", [g.reshape(context, (1, n, hidden)), g.param("output.weight", (hidden, hidden), hidden)])
    return (1, n, hidden), g.node("Add", [out, g.small_param("output.bias", (hidden,))])


_MODELS: dict[str, Callable] = {
    "infogan": _infogan,
    "dcgan": _dcgan,
    "srcnn": _srcnn,
    "gcn": _gcn,
    "resnet18": _resnet18,
    "csrnet": _csrnet,
    "longformer": _longformer,
}
NAMES: tuple[str, ...] = tuple(_MODELS)


def _check_name(name: str) -> None:
    if name not in _MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}")


def build(name: str, small: bool = False, seed: int = 0):
    """The zoo model ``name`` as an ``onnx.ModelProto`` (``describe(name)`` gives its shapes)."""
    _check_name(name)
    graph = _Graph(seed)
    input_shape, output = _MODELS[name](graph, small)
    return graph.model(name, input_shape, output)


def describe(name: str) -> str:
    """The docstring of zoo model ``name``: its source paper, structure and input/output shapes."""
    _check_name(name)
    return _MODELS[name].__doc__


def save(name: str, path: str | os.PathLike, small: bool = False, seed: int = 0) -> None:
    """Write the zoo model ``name`` to ``path`` as an .onnx file."""
    _onnx().save(build(name, small, seed), os.fspath(path))
