"""Where the e-graph relies on egglog-python beyond its documented API: one place, each use with
why no public API serves. ``tests/test_egraph.py`` checks each by name, so that an egglog upgrade
that moves one fails there, loudly, before it fails anywhere else.

Works with egglog 13.2 (the newest on Python 3.11) and 14.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from egglog import EGraph, bindings

__all__ = ["EgglogChanged", "INTERNALS", "bindings_egraph", "declare"]


class EgglogChanged(RuntimeError):
    """egglog-python no longer has an internal this package relies on."""

    def __init__(self, internal: str, why: str):
        super().__init__(f"egglog-python changed {internal}, which rewriter.egraph.adapter relies on ({why})")
        self.internal = internal


def bindings_egraph(egraph: EGraph) -> bindings.EGraph:
    """The ``egglog.bindings.EGraph`` behind ``egraph`` (private ``EGraph._egraph``).

    Why: rules are written over egglog-python classes and registered on the high-level ``EGraph``,
    while scopes go in as egglog text, lookups go node by node (``lookup_function``) and the whole
    e-graph is serialised for extraction, through the documented low-level bindings; both must
    work on one e-graph. egglog-python has no public way to build a high-level ``EGraph`` around a
    bindings one nor to get the bindings one out, no public serialisation of the whole e-graph,
    and its own term insertion is 2 to 4 times slower than text (bench/egraph_boundary.py)."""
    raw = getattr(egraph, "_egraph", None)
    if not isinstance(raw, bindings.EGraph):
        raise EgglogChanged("EGraph._egraph", "the low-level bindings e-graph behind a high-level EGraph")
    return raw


def declare(egraph: EGraph, constructors: Iterable[Any]) -> None:
    """Declare constructors (egglog-python classmethods) and their sorts in ``egraph``, so that
    egglog text can use them. Public API, used for a side effect: egglog-python declares a class
    only when something first uses it, and has no "declare" call; ``function_size`` is the
    cheapest use (it asks egglog for the constructor's row count)."""
    for constructor in constructors:
        egraph.function_size(constructor)


# Every internal above, with a check that raises EgglogChanged naming it (tests/test_egraph.py).
INTERNALS: dict[str, Callable[[], object]] = {
    "EGraph._egraph": lambda: bindings_egraph(EGraph()),
}
