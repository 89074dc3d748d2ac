"""Test setup: import path and hypothesis profiles.

* The repository root is put first on ``sys.path`` so that ``rewriter`` imports from this checkout
  (not an installed copy) without installing. The hypothesis strategies are the package's own:
  ``from rewriter.testing.strategies import expressions, applicable, ...``.
* Tests marked ``slow`` are skipped unless ``RUN_SLOW=1`` (see below).
* Kernels and measurements go to a cache of the run's own (``REWRITER_CACHE``, unless it is set),
  shared by pytest-xdist's workers and removed at the end: tests run two at a time (README's
  ``-n 2``), and their timings, taken beside each other, must not reach the user's cache, where
  the optimizer would reuse them.
* Hypothesis profiles: ``default`` and ``ci`` (200 examples, no deadline), ``dev`` (30 examples);
  ``HYPOTHESIS_PROFILE=dev python3 -m pytest tests`` picks one.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", max_examples=200, **_COMMON)
settings.register_profile("ci", max_examples=200, **_COMMON)
settings.register_profile("dev", max_examples=30, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
    """The run's cache, made by the main process before xdist starts its workers (they inherit
    its environment)."""
    if not hasattr(config, "workerinput") and not os.environ.get("REWRITER_CACHE"):
        config._rewriter_cache = tempfile.mkdtemp(prefix="rewriter-tests-")
        os.environ["REWRITER_CACHE"] = config._rewriter_cache


def pytest_unconfigure(config):
    cache = getattr(config, "_rewriter_cache", None)
    if cache:
        del os.environ["REWRITER_CACHE"]
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """Kernels and measurements of one test module in a fresh cache (shared by its tests); a
    module opts in with ``pytestmark = pytest.mark.usefixtures("module_cache")``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("REWRITER_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def _gpu() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import cupy
    except ImportError:
        return "needs CuPy (pip install '.[gpu]')"
    try:
        return None if cupy.cuda.runtime.getDeviceCount() > 0 else "needs an NVIDIA GPU"
    except cupy.cuda.runtime.CUDARuntimeError as err:
        return f"needs an NVIDIA GPU ({err})"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (full-size searches, minutes each) run with ``RUN_SLOW=1`` or
    ``-m slow``; the default run skips them so it stays well under CI's budget. Tests marked
    ``gpu`` skip, saying why, where CuPy or the GPU is missing."""
    no_gpu = _gpu() if any("gpu" in item.keywords for item in items) else None
    run_slow = os.environ.get("RUN_SLOW") or "slow" in (config.getoption("markexpr") or "")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: set RUN_SLOW=1 or pass -m slow"))
        if "gpu" in item.keywords and no_gpu:
            item.add_marker(pytest.mark.skip(reason=no_gpu))
