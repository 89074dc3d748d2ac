"""Test setup: import paths and hypothesis profiles.

* ``tests/`` is put on ``sys.path`` so test modules can ``from strategies import ...`` (there is
  no ``tests/__init__.py``), and the repository root so ``rewriter`` imports without installing.
* Hypothesis profiles: ``default`` and ``ci`` (200 examples, no deadline), ``dev`` (30 examples);
  ``HYPOTHESIS_PROFILE=dev python3 -m pytest tests`` picks one.
"""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _path in (_TESTS, _ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", max_examples=200, **_COMMON)
settings.register_profile("ci", max_examples=200, **_COMMON)
settings.register_profile("dev", max_examples=30, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
