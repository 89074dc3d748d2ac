"""The e-graph of scopes (``ExpressionGraph``) and the native simplifications it runs by default
(``eager_rules``).

Scopes go in as egglog text written from the language table (``language.Fold``), through the
low-level bindings e-graph. Iterator lists and index lists are written once, each unioned with a
handle (``(ItRef N)``, ``(IxRef N)``, sent in the command that first uses it), and then as that
handle: egglog's cost grows with the nodes a command writes, even when it holds them already.

egglog runs on its own thread (``_serve``, one per process): its e-graph may be used, and
dropped, only on the thread that made it, and its commands release the GIL. Inserts are queued
and sent up to ``BATCH`` to a call while the search goes on, on the machine's other core (at most
``BACKLOG`` wait; a search runs its levels inside ``graph.alongside()``, which hands the GIL to
egglog's thread sooner); every query waits for the inserts queued before it. egglog-python objects stay on that thread: reach
them with ``graph.on_egglog(fn)``. Rules written in Python over the term classes
(``eager_rules``, pattern rules of ``rewriter.search.dsl``) are registered on the egglog-python
``EGraph`` there and run natively on the same e-graph (``adapter``).

``eager_rules``: cheap, always-safe simplifications (index constant folding, ``x+0``, ``1*x``,
``0*x``, ``x*1.0``, ``x+0.0``). Deliberately no associativity or commutativity: those blow the
e-graph up."""

from __future__ import annotations

import itertools
import json
import os
import queue
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Callable, Iterator, Union

from egglog import EGraph, Ruleset, Schedule, bindings, i64, rewrite, ruleset, vars_
from egglog import run as run_schedule

from rewriter.ir import ExpressionError, Scope

from . import adapter
from .language import (
    CONSTRUCTORS,
    SCOPE,
    SHARED,
    TERMS,
    Fold,
    IndexTerm,
    Primitive,
    ScalarTerm,
    read_termdag,
    text_app,
    text_lit,
)

__all__ = ["ExpressionGraph", "GraphStats", "eager_rules"]

# --------------------------------------------------------------------------------------------
# Eager native rules


def _eager_rules() -> Ruleset:
    a, b = vars_("a b", i64)
    x, y = vars_("x y", IndexTerm)
    (s,) = vars_("s", ScalarTerm)
    lit, num = IndexTerm.lit, ScalarTerm.num
    zero, one = lit(0), lit(1)
    # floor semantics for / and % (egglog's i64 / and % truncate); divisors are positive
    floor_mod = ((a % b) + b) % b
    return ruleset(
        # constant folding
        rewrite(IndexTerm.add(lit(a), lit(b))).to(lit(a + b)),
        rewrite(IndexTerm.sub(lit(a), lit(b))).to(lit(a - b)),
        rewrite(IndexTerm.mul(lit(a), lit(b))).to(lit(a * b)),
        rewrite(IndexTerm.neg(lit(a))).to(lit(i64(0) - a)),
        rewrite(IndexTerm.div(lit(a), lit(b))).to(lit((a - floor_mod) / b), b > i64(0)),
        rewrite(IndexTerm.mod(lit(a), lit(b))).to(lit(floor_mod), b > i64(0)),
        # identities
        rewrite(IndexTerm.add(x, zero)).to(x),
        rewrite(IndexTerm.add(zero, x)).to(x),
        rewrite(IndexTerm.sub(x, zero)).to(x),
        rewrite(IndexTerm.sub(x, x)).to(zero),
        rewrite(IndexTerm.mul(x, one)).to(x),
        rewrite(IndexTerm.mul(one, x)).to(x),
        rewrite(IndexTerm.mul(x, zero)).to(zero),
        rewrite(IndexTerm.mul(zero, x)).to(zero),
        rewrite(IndexTerm.div(x, one)).to(x),
        rewrite(IndexTerm.mod(x, one)).to(zero),
        rewrite(IndexTerm.neg(IndexTerm.neg(x))).to(x),
        rewrite(IndexTerm.sub(x, IndexTerm.neg(y))).to(IndexTerm.add(x, y)),
        # scalar identities (exact in floating point for finite values; x*0 is not: inf*0, -0.0)
        rewrite(ScalarTerm.binary("*", s, num(1.0))).to(s),
        rewrite(ScalarTerm.binary("*", num(1.0), s)).to(s),
        rewrite(ScalarTerm.binary("/", s, num(1.0))).to(s),
        rewrite(ScalarTerm.binary("+", s, num(0.0))).to(s),
        rewrite(ScalarTerm.binary("+", num(0.0), s)).to(s),
        rewrite(ScalarTerm.binary("-", s, num(0.0))).to(s),
        rewrite(ScalarTerm.unary("neg", ScalarTerm.unary("neg", s))).to(s),
        name="eager",
    )


eager_rules: Ruleset = _eager_rules()

# --------------------------------------------------------------------------------------------
# The graph

ScopeOrHandle = Union[Scope, int]
_SPAN = bindings.RustSpan("", 0, 0)


class _Missing(Exception):
    """A lookup met a node the e-graph does not hold."""


def _detached(err: BaseException) -> BaseException:
    """``err`` with the tracebacks of its chain dropped: their frames may hold egglog objects."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return err


class _Egglog:
    """What one ExpressionGraph holds on the egglog thread: egglog-python's ``EGraph``, its
    bindings e-graph ``raw``, and literals already made there."""

    def __init__(self) -> None:
        self.egraph = EGraph()
        self.raw = adapter.bindings_egraph(self.egraph)
        adapter.declare(self.egraph, (row.term for row in CONSTRUCTORS.values()))
        self.literals: dict[tuple[type, Any], bindings.Value] = {}


_CURRENT: list[_Egglog] = []  # the e-graph of the job running on the egglog thread (read there only)


def _current() -> _Egglog:
    return _CURRENT[0]


def _raw() -> bindings.EGraph:
    return _CURRENT[0].raw


BATCH = 8  # queued inserts sent in one call: each call takes the GIL; egglog's memory grows faster than the batch (64: 4x the peak)
BACKLOG = 512  # queued inserts at most: a search that stops on its time limit would wait for the rest (seconds on a large e-graph)
SWITCH_INTERVAL = 0.0005  # seconds between GIL hand-overs while a search runs beside egglog (``alongside``)
PAUSE = 0.002  # seconds the egglog thread waits for inserts to gather before sending fewer than BATCH


def _serve(jobs: queue.SimpleQueue) -> None:
    """The egglog thread. A job is ``(client, work, reply)``: ``work`` an egglog command to send
    (queued inserts, sent ``BATCH`` to a call), a function to run (its result goes to ``reply``),
    or None to release the client's e-graph, which is dropped here once nothing else holds it
    (egglog-python leaves reference cycles behind: whichever thread collects them must not be
    the one that drops the e-graph). Checked after every job."""
    graphs: dict[int, _Egglog] = {}
    released: list[bindings.EGraph] = []
    _CURRENT.append(None)  # type: ignore[arg-type]
    waiting = None
    while True:
        client, work, reply = waiting or jobs.get()
        waiting = None
        if work is None:
            released.append(graphs.pop(client.key).raw)
        else:
            commands = [work] if isinstance(work, str) else []
            if commands and 0 < jobs.qsize() < BATCH:
                time.sleep(PAUSE)  # let inserts gather: each call costs a hand-over of the GIL
            while commands and len(commands) < BATCH and not jobs.empty():
                waiting = jobs.get()
                if waiting[0] is not client or not isinstance(waiting[1], str):
                    break
                commands.append(waiting[1])
                waiting = None
            try:
                _CURRENT[0] = graphs[client.key] if client.key in graphs else graphs.setdefault(client.key, _Egglog())
                result = (True, _send(commands, client.stats) if commands else work())
            except BaseException as err:  # handed to the caller's thread
                result = (False, _detached(err))
            _CURRENT[0] = None  # type: ignore[call-overload]
            if reply is not None:
                reply.put(result)
            elif not result[0]:
                client.errors.append(result[1])
            del work, result
        # a released e-graph still referenced elsewhere (by a cycle not yet collected) waits
        released[:] = [raw for raw in released if sys.getrefcount(raw) > 3]


class _EgglogThread:
    """One e-graph's jobs on the egglog thread (one per process). egglog's e-graph may be used,
    and dropped, only on the thread that made it, and its commands release the GIL: so inserts
    are queued (``post``) and the search goes on while egglog adds them, on the other core. A
    query (``call``) runs after every job queued before it; an insert egglog refused is raised by
    the next call. When the ExpressionGraph is collected its e-graph is released."""

    _queues: dict[int, queue.SimpleQueue] = {}  # process id -> its egglog thread's jobs (a fork has none)
    _started = threading.Lock()
    _keys = itertools.count()

    def __init__(self, owner: object, stats: GraphStats) -> None:
        self._pid = os.getpid()
        with self._started:
            if self._pid not in self._queues:
                self._queues[self._pid] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._queues[self._pid],), daemon=True, name="egglog").start()
        self._jobs = self._queues[self._pid]
        self.key = next(self._keys)
        self.errors: list[BaseException] = []
        self.stats = stats
        weakref.finalize(owner, self._jobs.put, (_Client(self.key), None, None))
        self.call(lambda: None)  # makes the e-graph

    def post(self, command: str) -> None:
        self._here()
        while self._jobs.qsize() > BACKLOG:  # egglog is behind: the caller waits here, within its budget
            time.sleep(0.001)
        self._jobs.put((self, command, None))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._here()
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((self, partial(fn, *args), reply))
        ok, value = reply.get()
        if self.errors:
            raise self.errors.pop(0)
        if not ok:
            raise value
        return value

    def _here(self) -> None:
        if os.getpid() != self._pid:  # its egglog thread stayed in the parent
            raise ExpressionError(
                "an ExpressionGraph cannot be used in a process forked after it was made (egglog does not survive a fork: use the spawn start method)"
            )


@dataclass
class _Client:
    key: int  # what a release names: not the handle, which would keep the ExpressionGraph's parts alive


@dataclass
class GraphStats:
    """Time (seconds) and counts at the Python/egglog boundary."""

    insert_seconds: float = 0.0  # text building + queueing add/union commands (the caller's time)
    egglog_seconds: float = 0.0  # egglog adding them, on its own thread
    run_seconds: float = 0.0  # rule runs
    extract_seconds: float = 0.0  # extraction + conversion back to the IR
    check_seconds: float = 0.0  # lookups and size queries
    commands_sent: int = 0
    terms_added: int = 0  # distinct scopes added
    unions: int = 0  # unions of two e-classes asserted (a new scope put into another's class counts)

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ExpressionGraph:
    """An egglog e-graph of scopes.

    Handles: ``add(scope)`` returns N, and the scope's e-class is that of ``(Ref N)`` (``Ref`` is
    an unextractable ``i64 -> Scope`` constructor unioned with the scope; scopes unioned when
    added share one). A nested scope that has a handle is written as its handle, which keeps the
    text of a derivation state short.
    Handles are not egglog ``let`` bindings because every ``let`` creates an egglog function, and
    the cost of a command grows with the number of functions (measured on 48-node terms: 0.76 ms
    per term for the first 4,000 lets, 1.5 ms from 16,000 to 20,000; with ``Ref`` 0.6-1.0 ms).
    """

    def __init__(self) -> None:
        self._handles: dict[Scope, int] = {}  # scope -> handle of its e-class (scopes may share one)
        self._refs = 0  # handles given out: 0 .. _refs-1
        self._text = Fold(text_app, text_lit, self._handles, shared=SHARED)
        self._lookup = Fold(_node, _literal, self._handles, memo=False)  # IR -> e-class id, on the egglog thread
        self.stats = GraphStats()
        self._egglog = _EgglogThread(self, self.stats)

    # -- insertion
    def add(self, scope: Scope) -> int:
        """The handle of ``scope``'s e-class, adding the scope if it is new."""
        handle = self._handles.get(scope)
        return self._add(scope, self._refs) if handle is None else handle

    def _add(self, scope: Scope, handle: int) -> int:
        """Insert a new scope into the e-class of ``handle`` (a new one: ``self._refs``)."""
        if not isinstance(scope, Scope):
            raise ExpressionError(f"expected a Scope or a handle of this graph, got {scope!r}")
        start = time.perf_counter()
        text = self._text(SCOPE, scope)
        definitions = self._text.take_definitions()
        lists = "".join(f"(union {ref} {fold})" for _, _, ref, fold in definitions)
        self._insert(f"{lists}(union {self._text.ref(handle)} {text})", start)
        self._handles[scope] = handle
        self._refs = max(self._refs, handle + 1)
        self.stats.terms_added += 1
        return handle

    def handle(self, scope: Scope) -> int | None:
        """The handle of a scope already added, or None."""
        return self._handles.get(scope)

    def union(self, a: ScopeOrHandle, b: ScopeOrHandle) -> None:
        """Assert that ``a`` and ``b`` are equal; each is a Scope (added if new) or a handle. A new
        scope goes straight into the other's e-class: one egglog command instead of two (a
        derivation unions each new state with the state it came from)."""
        ha, hb = self._known(a), self._known(b)
        if ha is None and hb is None:
            ha, hb = self._add(a, self._refs), self._known(b)  # type: ignore[arg-type]
        if ha is None:
            a, b, ha, hb = b, a, hb, ha
        if hb is None:
            self.stats.unions += 1
            self._add(b, ha)  # type: ignore[arg-type]
        elif ha != hb:
            self.stats.unions += 1
            self._insert(f"(union {self._text.ref(ha)} {self._text.ref(hb)})", time.perf_counter())

    def _known(self, x: ScopeOrHandle) -> int | None:
        """The handle of x: a handle, a scope's handle, or None for a scope not added yet."""
        if isinstance(x, Scope):
            return self._handles.get(x)
        if isinstance(x, int) and 0 <= x < self._refs:
            return x
        raise ExpressionError(f"expected a Scope or a handle of this graph, got {x!r}")

    def _handle_of(self, x: ScopeOrHandle) -> int:
        handle = self._known(x)
        return self.add(x) if handle is None else handle  # type: ignore[arg-type]

    def _insert(self, command: str, start: float) -> None:
        self._egglog.post(command)
        self.stats.commands_sent += 1
        self.stats.insert_seconds += time.perf_counter() - start

    def on_egglog(self, fn: Callable[[EGraph], Any]) -> Any:
        """``fn(egraph)`` on the thread that owns the egglog-python ``EGraph``, after every insert
        queued before; returns what it returns. This is how to reach egglog directly: the
        ``EGraph``, and what holds it (egglog-python's run reports do), must not leave that thread."""
        return self._egglog.call(lambda: fn(_current().egraph))

    @contextmanager
    def alongside(self) -> Iterator[None]:
        """While the caller runs Python beside egglog's thread (a search inserting as it goes):
        the interpreter hands the GIL over every 0.5 ms instead of 5 ms. egglog's thread needs it
        back after every command it sends, and waited up to 5 ms each time (measured: 6 of 11 s
        on Conv3x3 at depth 7); the setting is restored on leaving."""
        previous = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            yield
        finally:
            sys.setswitchinterval(previous)

    def wait(self) -> None:
        """Wait until egglog has added everything sent so far (raising what it refused)."""
        self._egglog.call(lambda: None)

    # -- rules
    def register(self, *rules: Any) -> None:
        """Register egglog-python rules, rewrites or actions on the e-graph."""
        self.on_egglog(lambda egraph: egraph.register(*rules))

    def run(self, rules: Ruleset | Schedule | str | None = None, iterations: int = 1) -> bool:
        """Run native egglog rules ``iterations`` times: a Ruleset (default: ``eager_rules``), a
        Schedule (``eager_rules.saturate()``), or the egglog name of a ruleset (``""``: egglog's
        default ruleset, where ``register`` puts rules given without one). Returns whether the rules
        changed the e-graph (egglog's report stays on egglog's thread: it holds the e-graph)."""
        start = time.perf_counter()
        try:
            if rules is None or isinstance(rules, Ruleset):
                schedule = run_schedule(rules or eager_rules) * iterations
                return self.on_egglog(lambda egraph: egraph.run(schedule).updated)
            if isinstance(rules, Schedule):
                schedule = rules * iterations if iterations != 1 else rules
                return self.on_egglog(lambda egraph: egraph.run(schedule).updated)
            if isinstance(rules, str):
                (output,) = self._command(f"(run {rules} {iterations})" if rules else f"(run {iterations})")
                return output.report.updated
            raise TypeError(f"cannot run {rules!r}: expected a Ruleset, a Schedule or a ruleset name")
        finally:
            self.stats.run_seconds += time.perf_counter() - start

    def _command(self, text: str) -> list:
        return self._egglog.call(_run_text, text)

    # -- queries
    def size(self, classes: bool = True) -> tuple[int, int | None]:
        """``(e-nodes, e-classes)`` of the term language (the table's constructors, not ``Ref``).

        e-nodes come from egglog's ``print-size`` (cheap). egglog exposes no e-class count; with
        ``classes=True`` it is counted as the distinct outputs of those constructors' rows in a
        frozen copy of the e-graph (linear in its size); ``classes=False`` returns ``(nodes, None)``."""
        start = time.perf_counter()
        (output,) = self._command("(print-size)")
        nodes = sum(n for name, n in output.sizes if name in TERMS)
        eclasses = self._egglog.call(_count_classes) if classes else None
        self.stats.check_seconds += time.perf_counter() - start
        return nodes, eclasses

    def eclass(self, x: ScopeOrHandle) -> bindings.Value | None:
        """The canonical e-class id (an egglog Value) of a scope or a handle, or None when the
        scope is not in the e-graph. Never adds anything: a scope without a handle is looked up
        node by node (it may be there because a native rule built it)."""
        start = time.perf_counter()
        try:
            if isinstance(x, Scope):
                return self._egglog.call(self._lookup, SCOPE, x)
            return self._egglog.call(self._lookup.ref, self._handle_of(x))
        except _Missing:
            return None
        finally:
            self.stats.check_seconds += time.perf_counter() - start

    def lookup(self, scope: Scope) -> bindings.Value | None:
        """The e-class of ``scope`` if the e-graph holds it (with or without a handle), else None."""
        if not isinstance(scope, Scope):
            raise ExpressionError(f"lookup needs a Scope, got {type(scope).__name__}")
        return self.eclass(scope)

    def equivalent(self, a: ScopeOrHandle, b: ScopeOrHandle) -> bool:
        """Whether ``a`` and ``b`` are in one e-class (a scope not in the e-graph is equivalent to nothing)."""
        ea = self.eclass(a)
        return ea is not None and ea == self.eclass(b)

    def extract(self, x: ScopeOrHandle, include_cost: bool = False) -> Any:
        """The cheapest scope of ``x``'s e-class (adding ``x`` if it is a new scope) by egglog's
        default cost (1 per constructor and literal, over the tree); with ``include_cost``
        ``(scope, cost)``. Extraction by kernel costs is ``rewriter.egraph.extract``."""
        handle = self._handle_of(x)
        start = time.perf_counter()
        try:
            scope, cost = self._egglog.call(_extract_text, f"(extract {self._text.ref(handle)})")
        finally:
            self.stats.extract_seconds += time.perf_counter() - start
        return (scope, cost) if include_cost else scope

    def serialize(self) -> dict:
        """The whole e-graph as egglog serialises it: ``{"nodes": {id: {"op", "children",
        "eclass", ...}}, ...}`` (children are node ids; extraction works on their e-classes)."""
        return json.loads(self._egglog.call(lambda: _raw().serialize([]).to_json()))


# --------------------------------------------------------------------------------------------
# What runs on the egglog thread


def _run_text(text: str) -> list:
    raw = _raw()
    return raw.run_program(*raw.parse_program(text))


def _send(commands: list[str], stats: GraphStats) -> None:
    start = time.perf_counter()
    try:
        _run_text("".join(commands))
    except bindings.EggSmolError as err:
        raise ExpressionError(f"egglog refused one of {commands[0][:300]} ...: {err}") from None
    finally:
        stats.egglog_seconds += time.perf_counter() - start


def _count_classes() -> int:
    frozen = _raw().freeze()
    return len(
        {
            row.output
            for name, function in frozen.functions.items()
            if name in TERMS
            for row in function.rows
            if not row.subsumed
        }
    )


def _extract_text(text: str) -> tuple[Scope, int]:
    (output,) = _run_text(text)
    return read_termdag(output.termdag, output.term), output.cost


def _node(name: str, args: list) -> bindings.Value:
    value = _raw().lookup_function(name, args)
    if value is None:
        raise _Missing
    return value


def _literal(kind: Primitive, value: Any) -> bindings.Value:
    value = kind.encode(value)
    key = (kind.literal, value)
    literals = _current().literals
    cached = literals.get(key)
    if cached is None:
        cached = literals[key] = _raw().eval_expr(bindings.Lit(_SPAN, kind.literal(value)))[1]
    return cached
