"""PyTorch front-end and torch.compile backend: small modules against eager PyTorch, batch norm
folding, the errors that name the culprit, and the backend's fallback with a warning.

Without torch the whole file skips.
"""

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from rewriter import evaluate  # noqa: E402
from rewriter.frontends import torch as torch_frontend  # noqa: E402
from rewriter.frontends.torch import SUPPORTED_OPS, TorchImportError, from_torch, register, rewriter_backend

# torch.export's own deprecation noise
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo's caches would hide a second compilation."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def randomise_batch_norms(module):
    """Non-trivial statistics and affine parameters, so folding errors show."""
    with torch.no_grad():
        for bn in (m for m in module.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            if bn.affine:
                bn.weight.uniform_(0.5, 2)
                bn.bias.uniform_(-1, 1)
    return module.eval()


def flat(outputs):
    return [o.detach().numpy() for o in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]


def close(got, expected):
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(e).max())))


def check(module, *inputs):
    """The imported program, evaluated on the inputs and the weights, equals eager PyTorch."""
    module = randomise_batch_norms(module)
    model = from_torch(module, inputs)
    got = evaluate(model.program, model.feeds({name: x.numpy() for name, x in zip(model.inputs, inputs)}))
    with torch.no_grad():
        close(got if isinstance(got, tuple) else (got,), flat(module(*inputs)))
    return model


class Lambda(nn.Module):
    def __init__(self, fn, **children):
        super().__init__()
        self.fn = fn
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, *xs):
        return self.fn(self, *xs)


class ResidualBlock(nn.Module):
    """ResNet's basic block with a projection shortcut."""

    def __init__(self, channels=4, out=6, stride=2):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out)
        self.conv2, self.bn2 = nn.Conv2d(out, out, 3, 1, 1, bias=False), nn.BatchNorm2d(out)
        self.down = nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 5), nn.Softmax(-1))


def generator():
    """A DCGAN generator layer: transposed convolution, batch norm, ReLU, then tanh."""
    return nn.Sequential(
        nn.ConvTranspose2d(6, 4, 4, 2, 1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.ConvTranspose2d(4, 3, 3, 1, 1),
        nn.Tanh(),
    )


def pooling(s, x):
    return (
        F.max_pool2d(x, 3, 2, 1),
        F.avg_pool2d(x, 2),
        F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
        F.max_pool2d(x, 3, 2, ceil_mode=True),
        F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
        F.avg_pool2d(x, 3, 3, ceil_mode=True, count_include_pad=False),
        F.adaptive_avg_pool2d(x, 1).flatten(1),
        F.adaptive_avg_pool2d(x, 2),
    )


def cat_slice_pad(s, x):
    joined = torch.cat([x[:, 1:3], x[:, ::2, 1:-1:3]], 2)
    return F.pad(joined, (1, 2, 0, 1), value=0.5)[:, :, 0]


def layout(s, x):
    moved = x.permute(0, 2, 3, 1).reshape(2, 64, 4).transpose(1, 2).unsqueeze(1).squeeze(1)
    norms = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True), torch.linalg.vector_norm(x, 1, dim=-1)
    return moved, x.mean((2, 3)), x.sum(-1, keepdim=True), x.sum(), *norms


def elementwise(s, x, y):
    return (
        1 - x * 2 / y + 0.5,
        torch.sigmoid(x) - F.leaky_relu(y, 0.2),
        F.relu6(3 * x),
        torch.sub(x, y, alpha=2),
        1 / y + torch.exp(-x) * torch.tensor(2.0),
        torch.sqrt(y) + x.detach(),
        torch.sin(3 * x) * torch.cos(y),
    )


def transformer_ops(s, x, y):
    """What transformer blocks use: layer norm, GELU, masks through where, clamps, powers."""
    masks = sum(
        torch.where(mask, x, y)
        for mask in (
            x < y,
            x < 0.5,
            x <= y,
            x <= 0.5,
            x > y,
            x > 0.1,
            x >= y,
            x >= 0.1,
            x.floor() == y.floor(),
            x.floor() == 0,
        )
    )
    return (
        s.norm(x) + F.gelu(x) + F.gelu(y, approximate="tanh"),
        masks + torch.where(x > 0, x, torch.full_like(x, -2.0)),
        torch.clamp(x, -0.5, 0.5) + torch.rsqrt(y) + torch.log(y) + x.abs() + x.floor() + x.ceil() + torch.erf(x),
        x**2 + y**x + torch.minimum(x, y) + torch.maximum(x, y),
        # attention's guard for fully masked rows, as scaled dot-product attention decomposes
        torch.where(torch.logical_not(x > 0.2).any(-1, keepdim=True), x, y)
        + torch.where(x == float("-inf"), torch.full_like(x, 0.0), x)
        + torch.ops.aten.mul.Scalar(x, 0.5),
    )


def matmuls(s, a, b):
    return (
        a @ b,
        torch.bmm(a, b),
        a[0] @ b[1],
        a @ torch.ones(4, 2),
        torch.addmm(b[0, 0], a[0], b[0], beta=0.5, alpha=2.0),
    )


def embedding_split(s, ids):
    """Token embeddings (ids known at run time: an opaque gather; a constant row: a view), the
    rows of a constant index list, and a split into parts of given sizes."""
    rows = s.embed(ids) + s.embed(torch.tensor(3)) + s.embed.weight[torch.tensor([4, 0, 7])].sum(0)
    q, k, v = rows.split([2, 2, 4], dim=-1)
    v3, v1 = v.split(3, dim=-1)
    return q * k, v1 + v3.sum(-1, keepdim=True), torch.cat([q[:, :0], q], 1)


def position_ids(s, ids):
    """RoBERTa's position ids from the token ids (padding 1): masks, cumsum and casts, then
    embeddings and a gather along the sequence by indices computed at run time."""
    mask = ids.ne(1).int()
    positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + 1
    rows = s.embed(positions) + s.embed(ids).flip(1).cumsum(1)
    picked = torch.gather(rows, 1, positions[:, :, None].expand(-1, -1, 8) % 3)
    casts = (rows > 0).to(torch.float32) + (rows * 3).to(torch.int32).float() + rows.bool().float()
    return picked, casts + (rows.floor() != rows.flip(2).floor()) + torch.remainder(rows, rows.abs() + 0.5)


def advanced_indexing(s, x, ids):
    """One index tensor (constant, or known only at run time), and joint indexing by constant
    tensors on adjacent axes (their broadcast shape stays in place) and on axes apart (it goes
    first, as numpy places it), by a constant and a run-time one (a decoder's sequence
    classification: ``logits[arange(b), argmax(..)]``), and by two run-time ones, one negative.
    Argmax with ties (on floors), along an axis and of the flattened tensor."""
    last = x.floor().sum((2, 3)).argmax(-1)
    return (
        x[:, torch.tensor([[2, 0], [1, -1]])],
        x[:, :, ids],
        x[:, torch.tensor([0, 2, 3]), torch.tensor([[1], [5]])],
        x[torch.tensor([1, 0]), :, torch.tensor([3, -4])],
        torch.index_select(x, 3, ids),
        torch.index_select(x, 1, torch.tensor([3, 1, 1])),
        x[torch.arange(x.shape[0]), last],
        x[:, :, ids, ids.flip(0) - 8],
        x.floor().argmax(1),
        x.floor().argmax(),
    )


def strided_views(s, x):
    """``as_strided`` of a contiguous tensor: overlapping windows (x's axes split back from flat
    positions), and the one adaptive pooling of a transposed tensor to one element decomposes into
    (Swin's classifier: the mean's result given the strides of its transposed input)."""
    return x.as_strided((3, 5, 4), (37, 9, 2), 3) * 2, F.adaptive_avg_pool1d(x.flatten(2).transpose(1, 2), 1)


def masks(s, x, y):
    """Bool tensors: logical and bitwise and, or, xor (logical ones of floats too: x != 0);
    comparisons with -inf (a masked fill's); isnan of a square root; and a softmax over rows
    masked everywhere (row 0 of each image), its NaNs zeroed as attention's safe softmax does."""
    a, b = x > 0, y < 0.5
    kept = a & (torch.arange(x.shape[-2])[:, None] > 0)
    scores = x.masked_fill(~kept, float("-inf"))
    p = torch.softmax(scores, -1)
    logic = (a | b).float() + (a ^ b).float() + torch.logical_xor(a, b).float() + torch.logical_and(a, b).float()
    logic = logic + torch.logical_or(a, b).float() + torch.logical_and(x, y - 0.5) + torch.logical_not(x.floor())
    infinite = (scores == float("-inf")).float() + (scores > float("-inf")).float() + (float("-inf") < scores).float()
    return logic, torch.where(p.isnan(), 0.0, p), torch.where(x.sqrt().isnan(), x, x.sqrt()), infinite


def attention(s, q, k, v):
    """``scaled_dot_product_attention``, kept whole: a boolean mask with a row masked everywhere
    (its output 0, as torch's safe softmax gives), a float mask with a scale, causal, and grouped
    heads (two of k's and v's for q's four)."""
    rows, keys = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    masked = (keys < 4) & (rows > 0)
    return (
        F.scaled_dot_product_attention(q, k, v, attn_mask=masked),
        F.scaled_dot_product_attention(q, k, v, attn_mask=k.sum(-1)[..., None, :] * 0.1, scale=0.3),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], enable_gqa=True),
    )


def slice_assignment(s, x):
    """``y[:, 1:3] = ...`` and a strided one: slice_scatter after export."""
    y, z = x.clone(), x.clone()
    y[:, 1:3] = x[:, :2] * 2
    z[..., ::3] = -x[..., 1::3]
    return y, z


def batch_statistics(s, x):
    """Batch norm with the batch's own statistics (BiT standardizes its weights so), with and
    without an affine part."""
    scale, shift = torch.linspace(0.5, 2.0, 4), torch.linspace(-1.0, 1.0, 4)
    return F.batch_norm(x, None, None, training=True, eps=1e-5), F.batch_norm(x, None, None, scale, shift, True)


def upsampling(s, x):
    """Nearest and bilinear, by factor and by size, corners aligned or not."""
    return (
        F.interpolate(x, scale_factor=2, mode="nearest"),
        F.interpolate(x, size=(5, 11), mode="nearest"),
        F.interpolate(x, scale_factor=(2, 1.5), mode="bilinear"),
        F.interpolate(x, size=(3, 13), mode="bilinear", align_corners=True),
    )


def batch_norm_read_twice(s, x):
    y = s.conv(x)
    return s.bn(y) + y


X = torch.randn(2, 4, 8, 8)

# name -> (module factory, example inputs...)
MODULES = {
    "conv_bn_relu": (lambda: nn.Sequential(nn.Conv2d(4, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU()), X),
    "conv_stride_dilation_groups": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), X),
    "residual_block": (ResidualBlock, X),
    "group_norm": (lambda: nn.Sequential(nn.Conv2d(4, 6, 1), nn.GroupNorm(3, 6), nn.GroupNorm(6, 6)), X),
    "upsampling": (lambda: Lambda(upsampling), X),
    "slice_assignment": (lambda: Lambda(slice_assignment), X),
    "strided_views": (lambda: Lambda(strided_views), X),
    "masks": (lambda: Lambda(masks), X, torch.rand(2, 4, 8, 8)),
    "attention": (lambda: Lambda(attention), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 3)),
    "batch_statistics": (lambda: Lambda(batch_statistics), X),
    "advanced_indexing": (lambda: Lambda(advanced_indexing), X, torch.tensor([7, 0, 3])),
    "position_ids": (
        lambda: Lambda(position_ids, embed=nn.Embedding(10, 8)),
        torch.tensor([[1, 4, 1, 9], [3, 3, 2, 1]]),
    ),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), torch.randn(2, 4, 11)),
    "generator": (generator, torch.randn(2, 6, 4, 4)),
    "mlp_softmax": (mlp, torch.randn(3, 3, 2, 2)),
    "pooling": (lambda: Lambda(pooling), X),
    "cat_slice_pad": (lambda: Lambda(cat_slice_pad), X),
    "layout": (lambda: Lambda(layout), X),
    "elementwise": (lambda: Lambda(elementwise), torch.randn(2, 3), torch.rand(2, 3) + 0.5),
    "matmuls": (lambda: Lambda(matmuls), torch.randn(2, 3, 4), torch.randn(2, 4, 5)),
    "transformer_ops": (
        lambda: Lambda(transformer_ops, norm=nn.LayerNorm(8)),
        torch.randn(2, 3, 8),
        torch.rand(2, 3, 8) + 0.5,
    ),
    "embedding_split": (
        lambda: Lambda(embedding_split, embed=nn.Embedding(10, 8)),
        torch.tensor([[1, 9, 0], [3, 3, 2]]),
    ),
    "batch_norm_read_twice": (lambda: Lambda(batch_norm_read_twice, conv=nn.Conv2d(4, 4, 1), bn=nn.BatchNorm2d(4)), X),
}


@pytest.mark.parametrize("name", MODULES)
def test_module_matches_eager(name):
    make, *inputs = MODULES[name]
    check(make(), *inputs)


def test_batch_norm_folds_into_the_convolution_it_alone_reads():
    model = check(nn.Sequential(nn.Conv2d(4, 5, 3), nn.BatchNorm2d(5), nn.ReLU()), X)
    assert [name for name, _ in model.program.definitions] == ["convolution", "relu_"]
    assert sorted(model.weights) == ["convolution_folded_bias", "convolution_folded_weight"]


def test_batch_norm_after_a_shared_convolution_is_a_per_channel_affine():
    make, x = MODULES["batch_norm_read_twice"]
    model = check(make(), x)
    assert any(name.endswith("_scale") for name in model.weights)


def test_names_and_shapes_of_the_model():
    model = check(mlp(), torch.randn(3, 3, 2, 2))
    assert model.inputs == {"input": (3, 3, 2, 2)}
    assert model.outputs == ("_softmax",)
    assert model.program.outputs == (model.names["_softmax"],)


def test_unsupported_ops_are_listed_together_before_anything_else():
    # the 3-D convolution is a supported operator its handler refuses: the listing comes first
    def forward(s, x):
        return torch.sort(x, -1)[0] + torch.cummax(x, -1)[0] + torch.sort(x, 0)[0], s.conv(x[None, None])

    module = Lambda(forward, conv=nn.Conv3d(1, 2, 3))
    with pytest.raises(TorchImportError) as err:
        from_torch(module.eval(), (torch.randn(4, 8, 8),))
    message = str(err.value)
    assert message.startswith("3 node(s) with unsupported operators (aten.cummax.default, aten.sort.default): ")
    assert "aten.sort.default node 'sort'" in message and "aten.sort.default node 'sort_1'" in message
    assert "aten.cummax.default node 'cummax'" in message and "convolution" not in message


def test_handler_errors_name_the_node():
    with pytest.raises(TorchImportError, match=r"aten.convolution.default node 'convolution': only 1-D and 2-D"):
        from_torch(nn.Conv3d(3, 2, 3), (torch.randn(1, 3, 4, 8, 8),))
    outside = Lambda(lambda s, x: x[:, torch.tensor([0, 4]), torch.tensor([1, 2])])  # axis 1 has 4
    with pytest.raises(TorchImportError, match=r"aten.index.Tensor node 'index': index 4 is out of range for axis 1"):
        from_torch(outside, (X,))
    storage = Lambda(lambda s, x: x.transpose(2, 3).as_strided((2, 4), (1, 2)))  # torch's storage, not x's values
    with pytest.raises(TorchImportError, match=r"aten.as_strided.default node 'as_strided': .* not contiguous"):
        from_torch(storage, (X,))


def test_bitwise_operations_on_integers_are_refused():
    integers = Lambda(lambda s, x: (x.long() & x.long().flip(0)).float())
    with pytest.raises(TorchImportError, match=r"bitwise_and.Tensor node 'bitwise_and': .* torch.int64 .* bool"):
        from_torch(integers, (X,))


def test_training_mode_is_refused():
    with pytest.raises(TorchImportError, match="_native_batch_norm_legit_functional"):
        from_torch(nn.BatchNorm2d(4).train(), (X,))


def test_every_supported_op_is_exercised():
    """Every operator the front-end handles appears in some test module's graph, except those
    the installed torch's decompositions take apart before the front-end sees them (its
    handler serves the torch versions that leave them whole)."""
    seen = set()
    for make, *inputs in MODULES.values():
        graph = torch_frontend._export(randomise_batch_norms(make()), inputs).graph
        seen |= {torch_frontend._op_key(node) for node in graph.nodes if node.op == "call_function"}
    decomposed = {str(op) for op in torch_frontend._decompositions()}
    assert set(SUPPORTED_OPS) - seen - decomposed == set()


def compiled_runs(monkeypatch):
    """Count the backend's program runs: a test that passes through the fallback would not."""
    runs = []
    original = torch_frontend._run_program
    monkeypatch.setattr(
        torch_frontend,
        "_run_program",
        lambda program, model, inputs: runs.append(model) or original(program, model, inputs),
    )
    return runs


def test_compiled_module_matches_eager_without_falling_back(monkeypatch):
    runs = compiled_runs(monkeypatch)
    module = randomise_batch_norms(ResidualBlock())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(module, backend=rewriter_backend)(X)
    assert not [w for w in caught if "rewriter" in str(w.message)]
    assert len(runs) == 1
    with torch.no_grad():
        close(flat(got), flat(module(X)))


def test_an_empty_parameter_dynamo_hands_over_is_never_read(monkeypatch):
    """Dynamo hands parameters over as graph inputs, an empty one too (YOLOS's middle position
    embeddings with one layer): the program leaves it out where a cat reads it, and takes it
    without reading it on every run."""
    runs = compiled_runs(monkeypatch)
    module = Lambda(lambda s, x: torch.cat([s.none[:, 1:], s.lin(x)], 0), lin=nn.Linear(3, 4)).eval()
    module.none = nn.Parameter(torch.zeros(0, 5))
    x = torch.randn(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(module, backend=rewriter_backend, options={"max_depth": 1})(x)
    assert not [w for w in caught if "rewriter" in str(w.message)]
    assert len(runs) == 1 and (0, 5) in runs[0].inputs.values()  # the empty one, taken
    with torch.no_grad():
        close(flat(got), flat(module(x)))


def test_unsupported_graph_falls_back_with_a_warning(monkeypatch):
    runs = compiled_runs(monkeypatch)
    module = Lambda(lambda s, x: torch.sort(s.lin(x), -1)[0], lin=nn.Linear(3, 4)).eval()
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match=r"rewriter backend runs the original graph: .*aten.sort.default node 'sort'"):
        got = torch.compile(module, backend=rewriter_backend)(x)
    assert runs == []
    with torch.no_grad():
        close(flat(got), flat(module(x)))


def test_a_fault_while_optimizing_falls_back_with_a_warning_that_names_it(monkeypatch):
    def fails(*args, **budget):
        raise RuntimeError("a fault of the optimizer's")

    monkeypatch.setattr(torch_frontend, "optimize_program", fails)
    module, x = mlp().eval(), torch.randn(3, 3, 2, 2)
    with pytest.warns(UserWarning, match=r"original graph: optimizing it failed: RuntimeError\(.a fault of"):
        got = torch.compile(module, backend=rewriter_backend)(x)
    with torch.no_grad():
        close(flat(got), flat(module(x)))


def test_dynamic_shapes_fall_back_with_a_warning():
    module = mlp().eval()
    with pytest.warns(UserWarning, match="dynamic shape"):
        got = torch.compile(module, backend=rewriter_backend, dynamic=True)(torch.randn(3, 3, 2, 2))
    assert got.shape == (3, 5)


def test_options_set_the_search_budget_and_a_misspelt_one_is_an_error(monkeypatch):
    budgets = []
    original = torch_frontend.optimize_program
    monkeypatch.setattr(
        torch_frontend, "optimize_program", lambda *args, **budget: budgets.append(budget) or original(*args, **budget)
    )
    module, x = mlp().eval(), torch.randn(3, 3, 2, 2)
    options = {"max_depth": 1, "subprogram_time_limit": 2.0, "orchestration": "greedy"}
    with torch.no_grad():
        close(flat(torch.compile(module, backend=rewriter_backend, options=options)(x)), flat(module(x)))
    assert budgets == [options]
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"\['max_dept'\] are not the rewriter backend's"):
        torch.compile(mlp().eval(), backend=rewriter_backend, options={"max_dept": 1})(x)


def test_register_is_idempotent_and_names_the_backend(monkeypatch):
    runs = compiled_runs(monkeypatch)
    register()
    register()
    module = mlp().eval()
    x = torch.randn(3, 3, 2, 2)
    with torch.no_grad():
        close(flat(torch.compile(module, backend="rewriter")(x)), flat(module(x)))
    assert len(runs) == 1


def test_importing_rewriter_does_not_import_torch():
    code = "import sys, rewriter, rewriter.frontends.torch; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
