"""Measured kernel costs: a timing harness and the persistent database that remembers its results.

The optimizer ranks candidates by what they cost on the machine at hand, and the same kernel (same
text, shapes, dtype and schedule) recurs across candidates, searches and runs. So each distinct
kernel *signature* is timed once per device and the result is kept in an sqlite database:

* ``time_callable(fn)`` warms ``fn`` up, batches calls until one sample is far above the timer's
  resolution, repeats samples until a minimum count and a minimum total time are reached (within
  ``max_seconds``), and reports the median per call with its spread; a noisy run is repeated once.
* ``race_in_turns(fns, baseline)`` runs callables in turns, round by round, until each one's
  time over the baseline's in the same round is known to lie above or below 1 (a
  distribution-free interval of its median, ``median_interval``) or within a resolution of it.
* ``MeasurementDB`` stores one ``Timing`` per ``(device, signature)``. It is in WAL mode with a
  busy timeout, so several processes may read and write it at once, and every write is a single
  committed transaction, so a process killed mid-write loses at most its uncommitted row.

``device_id()`` names the CPU the timings hold for; a GPU backend passes its own ``device=``.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import platform
import sqlite3
import statistics
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping, Sequence, TypeVar

import numpy as np

K = TypeVar("K")

#: A run whose interquartile range exceeds this fraction of its median is noisy.
NOISE_THRESHOLD = 0.1
#: Samples taken per run when the caller gives no ``repeats``.
DEFAULT_REPEATS = 5
#: One sample lasts at least this long: about 10^6 times perf_counter's resolution on Linux and
#: 10^4 times on Windows, and long enough that loop and timer-call overhead vanish.
SAMPLE_SECONDS = 1e-3
#: One turn of ``time_in_turns`` samples at least this long.
TURN_SECONDS = 0.02
#: How long a writer waits for another process's lock before sqlite gives up.
BUSY_TIMEOUT_SECONDS = 60.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS measurements (
    device    TEXT    NOT NULL,
    signature TEXT    NOT NULL,
    median    REAL    NOT NULL,
    spread    REAL    NOT NULL,
    repeats   INTEGER NOT NULL,
    noisy     INTEGER NOT NULL,
    created   REAL    NOT NULL,
    PRIMARY KEY (device, signature)
) WITHOUT ROWID
"""

_UPSERT = """
INSERT INTO measurements (device, signature, median, spread, repeats, noisy, created)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (device, signature) DO UPDATE SET
    median = excluded.median, spread = excluded.spread, repeats = excluded.repeats,
    noisy = excluded.noisy, created = excluded.created
"""

# Connections inherited across fork(). Closing one in the child would run sqlite's close logic
# (checkpoint, WAL cleanup) against locks that belong to the parent, so they are kept referenced
# and never touched again.
_INHERITED: list[sqlite3.Connection] = []


@dataclass(frozen=True)
class Timing:
    """One kernel's measured cost.

    ``median`` is seconds per call; ``spread`` the interquartile range over the median (0 for a
    single sample); ``repeats`` the number of samples; ``noisy`` whether the spread stayed above
    ``NOISE_THRESHOLD`` (after a second run, where ``max_seconds`` left time for one), so the
    median should be trusted less.
    """

    median: float
    spread: float
    repeats: int
    noisy: bool


# ---------------------------------------------------------------------------------------------
# Device and signatures


#: The native libraries' settings: the thread pools' idle policy (``rewriter/_threads.py`` sets
#: it: a pool left spinning slows the next library's calls) and the kernels OpenBLAS takes where
#: the environment names them (its AVX2 ones run float32 GEMMs at about half the speed of its
#: AVX-512 ones on a CPU that has both), so timings hold only under the settings they were taken
#: with.
LIBRARY_VARIABLES = ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_CORETYPE", "TVM_THREAD_POOL_SPIN_COUNT")


@lru_cache(maxsize=1)
def device_id() -> str:
    """Name the machine a CPU timing is valid for: CPU model, architecture, cores, numpy's BLAS,
    and the native libraries' settings (``LIBRARY_VARIABLES``: the thread pools' idle policy,
    OpenBLAS's kernels).

    Timings move when any of these change (OpenBLAS picks its kernels by CPU model), and none of
    them change between runs on the same machine, so the string keys the database across runs.
    """
    parts = [cpu_model(), platform.machine(), f"{os.cpu_count()} cores"]
    blas = _numpy_blas()
    if blas:
        parts.append(blas)
    parts.append(" ".join(f"{name}={os.environ.get(name, '')}" for name in LIBRARY_VARIABLES))
    return " | ".join(parts)


@lru_cache(maxsize=1)
def last_level_cache() -> int:
    """Bytes of the CPU's largest cache (Linux's sysfs), 32 MiB where the system does not say."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        sizes += [int(digits) * scale] if digits.isdigit() else []
    return max(sizes, default=32 << 20)


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo where there is one, with its family and model
    numbers (a virtual machine may name a Zen 4 and a Zen 5 alike, "AMD EPYC"), else what
    platform says."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = next((fields[k] for k in ("model name", "Model", "cpu model") if fields.get(k)), "")
    if not name:
        return platform.processor() or "unknown cpu"
    numbers = [f"{k} {fields[k]}" for k in ("cpu family", "model") if fields.get(k)]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def _numpy_blas() -> str:
    """numpy's BLAS as ``name version``, or '' when numpy does not say (it is informational)."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - an old numpy or an odd build must not stop measuring
        return ""


def signature(*parts: object) -> str:
    """A fixed-length key for a kernel: sha256 hex over the parts (text, shapes, dtype, schedule).

    Each part is length-prefixed, so ("ab", "c") and ("a", "bc") get different signatures.
    """
    h = hashlib.sha256()
    for part in parts:
        data = str(part).encode("utf-8")
        h.update(f"{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Timing


def time_callable(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    repeats: int | None = None,
    min_seconds: float = 0.05,
    max_seconds: float = 2.0,
) -> Timing:
    """Time ``fn()``: the median seconds per call over repeated samples.

    ``warmup`` calls come first (one-off costs: allocation, page faults, lazy compilation). Each
    sample then runs ``fn`` enough times in a row to last ``SAMPLE_SECONDS``, so microsecond
    kernels are not lost in timer resolution. Samples continue until there are at least
    ``repeats`` (default ``DEFAULT_REPEATS``) and together they took ``min_seconds``. If the run is
    noisy it is repeated once and the steadier run kept. ``max_seconds`` bounds the whole call
    loosely: once it has passed, no new warm-up, batch or sample starts, but at least one sample
    is always taken; a first warm-up call that alone took ``max_seconds`` is that sample.
    """
    if warmup < 0 or (repeats is not None and repeats < 1) or max_seconds <= 0:
        raise ValueError("need warmup >= 0, repeats >= 1 and max_seconds > 0")
    deadline = time.perf_counter() + max_seconds
    first_call = _warm_up(fn, warmup, deadline)
    if first_call is not None and first_call >= max_seconds:
        return summarise([first_call])  # one call outlasted the budget: one-off costs are noise next to it
    number = _calls_per_sample(fn, deadline)
    count = DEFAULT_REPEATS if repeats is None else repeats
    first = _run(fn, number, count, min_seconds, deadline)
    if not first.noisy or time.perf_counter() >= deadline:
        return first
    second = _run(fn, number, count, min_seconds, deadline)
    return min(first, second, key=lambda t: t.spread)


def time_in_turns(fns: dict[K, Callable[[], object]], rounds: int = 3, **timing_kwargs: object) -> dict[K, Timing]:
    """Time several callables in turns (A B C, A B C, ...): each one's median over ``rounds``
    ``time_callable`` runs. Timings taken minutes apart are not comparable on a shared machine
    (another process or a throttled core can slow a whole measurement twofold for seconds);
    taken in turns, a slow spell slows every contender alike. Each turn samples for
    ``TURN_SECONDS`` at least (unless ``min_seconds`` says otherwise): three turns then sample
    longer than one ``time_callable`` does, and the search's races (every form of an
    orchestration, three turns each) take a third of the time they took at 50 ms a turn."""
    timing_kwargs.setdefault("min_seconds", TURN_SECONDS)
    runs: dict[K, list[Timing]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            runs[key].append(time_callable(fn, **timing_kwargs))
    return {key: _combined(timings) for key, timings in runs.items()}


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of ``samples`` and an interval that holds the true median with probability
    ``confidence`` whatever the distribution (a machine's slow spells make it skewed, with
    outliers): the j-th smallest and j-th largest samples, j the largest with 2 P(B <= j - 1)
    <= 1 - ``confidence``, B binomial(n, 1/2). With too few samples for any j (5 or fewer at
    95%), the interval is unbounded."""
    ordered = sorted(samples)
    n = len(ordered)
    if not n:
        raise ValueError("no samples")
    trimmed, below = 0, 0.0  # below: P(B <= trimmed - 1)
    while trimmed < (n + 1) // 2:
        upto = below + math.comb(n, trimmed) / 2**n
        if 2 * upto > 1 - confidence:
            break
        trimmed, below = trimmed + 1, upto
    median = statistics.median(ordered)
    if not trimmed:
        return -math.inf, median, math.inf
    return ordered[trimmed - 1], median, ordered[n - trimmed]


@dataclass(frozen=True)
class Race:
    """Callables timed in turns (``race_in_turns``): each one's median seconds per call, and
    its time over the baseline's in the same round, as ``(low, median, high)``: the median of
    those ratios and the interval that holds the true one at ``confidence``."""

    baseline: str
    seconds: dict[str, float]
    ratios: dict[str, tuple[float, float, float]]
    rounds: int
    confidence: float
    # each one's time over the baseline's, round by round: what a later race of the same
    # programs pools with its own (``codegen.orchestrate.faster_end_to_end``)
    samples: dict[str, tuple[float, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def fastest(self) -> str:
        """Of those whose whole interval lies below 1 (faster than the baseline, at
        ``confidence``), the one of the least median ratio; the baseline where none is."""
        faster = [name for name, (_, _, high) in self.ratios.items() if high < 1]
        return min(faster, key=lambda name: self.ratios[name][1]) if faster else self.baseline


def race_in_turns(
    fns: Mapping[str, Callable[[], object]],
    baseline: str,
    *,
    min_rounds: int = 8,
    max_rounds: int = 1000,
    max_seconds: float = 20.0,
    resolution: float = 0.005,
    confidence: float = 0.95,
    warm_calls: int = 0,
    decide: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> Race:
    """Call ``fns`` in turns, one timed call each a round, each round in another order
    (``balanced_orders``: each takes each place alike, and follows each other alike), and
    compare each with ``baseline`` by its time
    over the baseline's in the same round: a slow spell of the machine (seconds long, a third
    slower here) slows both sides of a ratio alike, where it moves each one's own median.
    Rounds go on until every ratio's interval (``median_interval``) lies wholly above or
    below 1 or spans less than ``resolution`` on either side of its median, looked at after
    ``min_rounds`` and each doubling (few looks keep the chance of a lucky stop small), or
    until ``max_rounds``, or ``max_seconds`` after ``min_rounds``. ``warm_calls``: calls made
    untimed before each timed one (a library whose threads must wake after another's ran);
    ``decide``: False, the intervals are not looked at, and the rounds run to ``max_rounds``
    or ``max_seconds`` (a benchmark's budget: a race that stops where its intervals first
    decide makes a difference of nothing come out beyond doubt more often than its confidence
    says); ``clock``: seconds, as ``time.perf_counter`` counts them."""
    if baseline not in fns:
        raise ValueError(f"the baseline {baseline!r} is not raced")
    names = list(fns)
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    deadline, look = clock() + max_seconds, min_rounds
    orders = balanced_orders(len(names))
    for turn in range(max_rounds):
        for name in (names[k] for k in orders[turn % len(orders)]):
            for _ in range(warm_calls):
                fns[name]()
            start = clock()
            fns[name]()
            samples[name].append(clock() - start)
        rounds = turn + 1
        if rounds < min_rounds:
            continue
        if decide and rounds == look:
            look *= 2
            if all(_decided(_ratios(samples, name, baseline, confidence), resolution) for name in names):
                break
        if clock() > deadline:
            break
    return Race(
        baseline,
        {name: statistics.median(s) for name, s in samples.items()},
        {name: _ratios(samples, name, baseline, confidence) for name in names},
        len(samples[baseline]),
        confidence,
        {name: _per_round(samples, name, baseline) for name in names},
    )


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` callables for rounds in turn (a Williams design): over these ``n`` rounds
    (``2n`` where ``n`` is odd) each takes each place, and follows each other within a round,
    equally often. Rotated orders kept each one's place balanced but put it after the same one
    every round, which leaves its mark on the caches, the branch predictors and the thread
    pools: a small zoo program (SRCNN small, 64 us a run, a Zen 3, 88th stop), raced with
    the greedy program, a copy of itself and torch.compile in rotated orders, had its copy
    run 0.78x (0.776-0.785) its time: the copy always followed the greedy program, the
    program always torch.compile."""
    first, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each difference once, mod n
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(k + shift) % n for k in first] for shift in range(n)]
    return rows if n % 2 == 0 or n == 1 else rows + [row[::-1] for row in rows]


def _per_round(samples: dict[str, list[float]], name: str, baseline: str) -> tuple[float, ...]:
    return tuple(a / b for a, b in zip(samples[name], samples[baseline]))


def _ratios(samples: dict[str, list[float]], name: str, baseline: str, confidence: float):
    return median_interval(_per_round(samples, name, baseline), confidence)


def _decided(interval: tuple[float, float, float], resolution: float) -> bool:
    """Whether a ratio's interval says which side of 1 it lies, or that it lies within
    ``resolution`` of its median (a difference smaller than that is not worth more rounds)."""
    low, median, high = interval
    return low > 1 or high < 1 or (high - low) <= 2 * resolution * median


def _combined(timings: list[Timing]) -> Timing:
    """One timing from several runs of the same callable: the median of their medians."""
    medians = [t.median for t in timings]
    spread = summarise(medians).spread if len(medians) > 1 else timings[0].spread
    return Timing(statistics.median(medians), spread, sum(t.repeats for t in timings), spread > NOISE_THRESHOLD)


def _warm_up(fn: Callable[[], object], calls: int, deadline: float) -> float | None:
    """Call ``fn`` up to ``calls`` times; the first always runs, the rest only before the
    deadline. Returns the seconds of the first call (None when ``calls`` is 0)."""
    first = None
    for i in range(calls):
        if i and time.perf_counter() >= deadline:
            break
        start = time.perf_counter()
        fn()
        first = time.perf_counter() - start if first is None else first
    return first


def _calls_per_sample(fn: Callable[[], object], deadline: float) -> int:
    """How many calls make one sample last ``SAMPLE_SECONDS``: double a batch until it does."""
    number = 1
    while _batch(fn, number) < SAMPLE_SECONDS and time.perf_counter() < deadline:
        number *= 2
    return number


def _run(fn: Callable[[], object], number: int, count: int, min_seconds: float, deadline: float) -> Timing:
    """Take samples until ``count`` of them and ``min_seconds`` in all, or the deadline."""
    samples: list[float] = []
    total = 0.0
    while len(samples) < count or total < min_seconds:
        elapsed = _batch(fn, number)
        samples.append(elapsed / number)
        total += elapsed
        if time.perf_counter() >= deadline:
            break
    return summarise(samples)


def _batch(fn: Callable[[], object], number: int) -> float:
    """Seconds for ``number`` back-to-back calls, with the garbage collector held off.

    A collection triggered by garbage the kernel did not make would land in one sample only and
    widen the spread, so it is postponed to between samples (as ``timeit`` does).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


def summarise(samples: list[float]) -> Timing:
    """Median, relative interquartile range and noise flag of per-call sample times.

    The median and quartiles ignore the few samples hit by interrupts or other processes, where a
    mean and standard deviation would absorb them.
    """
    if not samples:
        raise ValueError("no samples")
    median = statistics.median(samples)
    spread = 0.0
    if len(samples) > 1 and median > 0:
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        spread = (q3 - q1) / median
    return Timing(median=median, spread=spread, repeats=len(samples), noisy=spread > NOISE_THRESHOLD)


# ---------------------------------------------------------------------------------------------
# The database


def default_path() -> Path:
    """Where measurements live unless the caller says otherwise.

    ``$REWRITER_CACHE/measurements.sqlite`` lets tests and CI isolate the cache; otherwise the
    user cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``), so timings survive across runs.
    """
    if os.environ.get("REWRITER_CACHE"):
        return Path(os.environ["REWRITER_CACHE"]) / "measurements.sqlite"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "rewriter" / "measurements.sqlite"


class MeasurementDB:
    """Measured ``Timing``s keyed by ``(device, signature)``, shared by every process on a machine.

    Each process uses its own sqlite connection (opened on first use there, including after
    fork or when the object is pickled to a spawned process). WAL mode lets readers proceed
    while one process writes; the busy timeout makes concurrent writers queue instead of failing.
    ``synchronous=NORMAL`` keeps every committed transaction across a killed process (only a power
    loss may drop the last few), which is enough for a cache that can always be re-measured.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._connection()

    def __getstate__(self) -> dict[str, object]:
        """Pickle the location only: a connection cannot cross processes."""
        return {"path": self.path}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.path = Path(state["path"])
        self._conn = None
        self._pid = os.getpid()

    def _connection(self) -> sqlite3.Connection:
        """This process's connection, opened (and the schema created) on first use here."""
        if self._conn is not None and self._pid != os.getpid():
            _INHERITED.append(self._conn)
            self._conn = None
        if self._conn is None:
            self._conn = _open(self.path)
            self._pid = os.getpid()
        return self._conn

    def get(self, signature: str, device: str | None = None) -> Timing | None:
        """The stored timing of ``signature`` on ``device`` (default: this CPU), or None."""
        row = (
            self._connection()
            .execute(
                "SELECT median, spread, repeats, noisy FROM measurements WHERE device = ? AND signature = ?",
                (device or device_id(), signature),
            )
            .fetchone()
        )
        if row is None:
            return None
        median, spread, repeats, noisy = row
        return Timing(median=median, spread=spread, repeats=repeats, noisy=bool(noisy))

    def put(self, signature: str, timing: Timing, device: str | None = None) -> None:
        """Store (or replace) one timing in a single committed transaction."""
        self._connection().execute(
            _UPSERT,
            (
                device or device_id(),
                signature,
                timing.median,
                timing.spread,
                timing.repeats,
                int(timing.noisy),
                time.time(),
            ),
        )

    def measure(
        self, signature: str, fn: Callable[[], object], device: str | None = None, **timing_kwargs: object
    ) -> Timing:
        """The timing of ``signature``: the stored one, else ``time_callable(fn, ...)`` stored.

        Two processes that miss the same signature at once both time it and the later write
        wins; holding a lock while timing would stall every other writer for seconds.
        """
        stored = self.get(signature, device)
        if stored is not None:
            return stored
        timing = time_callable(fn, **timing_kwargs)
        self.put(signature, timing, device)
        return timing

    def __len__(self) -> int:
        return self._connection().execute("SELECT COUNT(*) FROM measurements").fetchone()[0]

    def close(self) -> None:
        """Close this process's connection; the next call opens a new one."""
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def __enter__(self) -> MeasurementDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(path: Path) -> sqlite3.Connection:
    """Open ``path`` in autocommit mode (each statement its own transaction), WAL, with the schema.

    ``timeout`` is sqlite's busy timeout: a locked database makes this process wait, not fail.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
    try:
        _enable_wal(conn)
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(_SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


def _enable_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL (a no-op once it is), retrying while another process holds a lock.

    sqlite does not call the busy handler for this pragma, so without the retry, processes that
    open a fresh database at the same moment fail with "database is locked".
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_SECONDS
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
