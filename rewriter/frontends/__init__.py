"""Front-ends: models from the libraries people use, as ``Program``s of the IR.

``onnx`` (``load_onnx``), ``torch`` (``from_torch`` and the ``torch.compile`` backend), and
``zoo`` (OLLIE's evaluation models built in code as ONNX). onnx and torch are imported when
first needed, so the package imports without them.
"""

from . import zoo
from .common import FrontendError, Model
from .onnx import OnnxImportError, load_onnx
from .torch import TorchImportError, from_torch

__all__ = ["FrontendError", "Model", "OnnxImportError", "TorchImportError", "from_torch", "load_onnx", "zoo"]
