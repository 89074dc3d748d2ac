"""The measurement harness and database (codegen/measure.py).

Timings are asserted only loosely (orderings and generous bounds): the machine is shared.
The database is tested for what a cache shared by concurrent searches needs: many writers at
once, and a writer killed mid-write leaving every committed row readable.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import pickle
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codegen.measure import (
    NOISE_THRESHOLD,
    MeasurementDB,
    Race,
    Timing,
    balanced_orders,
    default_path,
    device_id,
    median_interval,
    race_in_turns,
    signature,
    summarise,
    time_callable,
    time_in_turns,
)

ROOT = Path(__file__).resolve().parent.parent
T = Timing(median=1e-3, spread=0.02, repeats=7, noisy=False)


class Counter:
    """A callable that counts its calls, optionally sleeping ``delays[call % len(delays)]``."""

    def __init__(self, *delays: float) -> None:
        self.calls = 0
        self.delays = delays

    def __call__(self) -> None:
        if self.delays:
            time.sleep(self.delays[self.calls % len(self.delays)])
        self.calls += 1


# --- timing -------------------------------------------------------------------------------------


def test_ten_times_the_work_measures_larger():
    small = time_callable(lambda: sum(range(20_000)), min_seconds=0.02)
    large = time_callable(lambda: sum(range(200_000)), min_seconds=0.02)
    assert large.median > 3 * small.median


def test_sleep_measures_in_a_plausible_range():
    t = time_callable(lambda: time.sleep(0.005), min_seconds=0.03)
    assert 0.004 < t.median < 0.1
    assert t.repeats >= 5


def test_microsecond_calls_are_batched():
    fn = Counter()
    t = time_callable(fn, min_seconds=0.01)
    assert fn.calls > 10 * t.repeats
    assert 0 < t.median < 1e-4


def test_max_seconds_bounds_the_call_loosely():
    fn = Counter(0.02)
    start = time.perf_counter()
    t = time_callable(fn, min_seconds=60, max_seconds=0.3)
    assert time.perf_counter() - start < 1.5
    assert t.repeats >= 1


def test_a_call_longer_than_the_budget_is_timed_once():
    fn = Counter(0.2)
    t = time_callable(fn, max_seconds=0.1)
    assert fn.calls == 1 and t.repeats == 1 and 0.15 < t.median < 1.0


def test_noisy_run_is_repeated_and_flagged():
    fn = Counter(0.001, 0.004)
    t = time_callable(fn, warmup=2, repeats=6, min_seconds=0)
    assert t.noisy and t.spread > NOISE_THRESHOLD
    assert fn.calls >= 2 + 2 * 6  # warm-ups, then two runs of six samples


def test_callables_timed_in_turns_alternate_and_each_get_their_own_timing():
    order = []
    slow = lambda: (order.append("slow"), time.sleep(0.002))  # noqa: E731
    fast = lambda: order.append("fast")  # noqa: E731
    timings = time_in_turns({"slow": slow, "fast": fast}, rounds=3, min_seconds=0.01)
    assert list(timings) == ["slow", "fast"]
    assert timings["slow"].median > 10 * timings["fast"].median
    blocks = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    assert blocks == ["slow", "fast"] * 3  # round by round, not all of one then all of the other
    assert timings["slow"].repeats >= 3 * 5


@pytest.mark.parametrize(
    "n, ranks",
    # the order statistics of the usual tables for the median's 95% interval (1-based)
    [(6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (100, (40, 61))],
)
def test_the_median_interval_is_the_order_statistics_of_the_binomial_tail(n, ranks):
    samples = [float(k) for k in range(1, n + 1)][::-1]  # order does not matter
    low, median, high = median_interval(samples)
    assert (low, high) == ranks and median == (n + 1) / 2


def test_too_few_samples_bound_no_interval_and_none_is_an_error():
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (float("-inf"), 3.0, float("inf"))
    assert median_interval(range(1, 11), confidence=0.99)[::2] == (1, 10)  # 99% needs wider ranks
    with pytest.raises(ValueError):
        median_interval([])


def test_a_race_keeps_the_baseline_unless_another_is_faster_across_its_whole_interval():
    def race(**ratios):
        return Race("base", {}, {"base": (1.0, 1.0, 1.0)} | ratios, rounds=8, confidence=0.95)

    assert race(a=(0.9, 0.95, 1.01)).fastest == "base"  # faster by its median, not surely
    assert race(a=(0.9, 0.95, 0.99)).fastest == "a"
    assert race(a=(0.9, 0.95, 0.99), b=(0.5, 0.7, 0.9)).fastest == "b"
    assert race(a=(1.01, 1.1, 1.2)).fastest == "base"


def test_a_race_takes_turns_in_balanced_orders_and_stops_once_every_ratio_is_decided():
    """Callables of 3, 1 and 6 ticks of a clock that only they advance: every ratio is decided
    at the first look, so the race stops after ``min_rounds``; each callable took each place in
    the rounds alike and followed each other one alike (``balanced_orders``); the warm calls
    come before each timed one."""
    order, now = [], [0.0]

    def call(name, ticks):
        return lambda: (order.append(name), now.__setitem__(0, now[0] + ticks))

    raced = race_in_turns(
        {"base": call("base", 3), "fast": call("fast", 1), "slow": call("slow", 6)},
        "base",
        min_rounds=12,
        warm_calls=1,
        clock=lambda: now[0],
    )
    assert raced.rounds == 12 and raced.fastest == "fast"
    assert raced.ratios["base"] == (1.0, 1.0, 1.0)
    assert raced.ratios["fast"] == (1 / 3, 1 / 3, 1 / 3) and raced.ratios["slow"] == (2.0, 2.0, 2.0)
    assert raced.seconds == {"base": 3.0, "fast": 1.0, "slow": 6.0}
    assert raced.samples["fast"] == (1 / 3,) * 12 and raced.samples["slow"] == (2.0,) * 12  # round by round
    timed = order[3:][1::2]  # after one call each to start; each timed call follows a warm one of its own
    assert order[3:][0::2] == timed
    rounds = [timed[k : k + 3] for k in range(0, len(timed), 3)]
    assert rounds[:2] == [["base", "fast", "slow"], ["fast", "slow", "base"]]
    names = ("base", "fast", "slow")
    assert all(sum(r.index(name) == place for r in rounds) == 4 for name in names for place in range(3))
    follows = collections.Counter(pair for r in rounds for pair in zip(r, r[1:]))
    assert set(follows) == set(itertools.permutations(names, 2)) and set(follows.values()) == {4}
    # told not to decide (a benchmark's budget), the same race runs on to its seconds
    now[0] = 0.0
    fns = {"base": call("base", 3), "fast": call("fast", 1), "slow": call("slow", 6)}
    budgeted = race_in_turns(fns, "base", min_rounds=12, max_seconds=200.0, decide=False, clock=lambda: now[0])
    assert budgeted.rounds == 21 and budgeted.ratios["fast"] == (1 / 3, 1 / 3, 1 / 3)  # 10 ticks a round, past 200


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_balanced_orders_put_each_callable_in_each_place_and_after_each_other_alike(n):
    rows = balanced_orders(n)
    assert len(rows) == (n if n % 2 == 0 or n == 1 else 2 * n) and all(sorted(r) == list(range(n)) for r in rows)
    places = collections.Counter((k, place) for r in rows for place, k in enumerate(r))
    follows = collections.Counter(pair for r in rows for pair in zip(r, r[1:]))
    assert len(places) == n * n and len(set(places.values())) == 1
    assert set(follows) == set(itertools.permutations(range(n), 2)) and len(set(follows.values())) <= 1


def test_a_race_that_cannot_decide_stops_at_its_limits():
    """Two callables alike, on a clock that ticks by uneven steps: no ratio's interval leaves
    1 behind or narrows within the resolution, so the race runs to ``max_rounds``, or to
    ``max_seconds`` on that clock once ``min_rounds`` are run, and keeps the baseline."""

    def ticking():
        steps, now = itertools.cycle([1.0, 3.0, 2.0, 5.0, 1.0, 4.0, 2.0]), [0.0]
        return lambda: now.__setitem__(0, now[0] + next(steps)) or now[0]

    runs = {"a": lambda: None, "b": lambda: None}
    raced = race_in_turns(runs, "a", max_rounds=40, max_seconds=1e9, clock=ticking())
    low, _, high = raced.ratios["b"]
    assert raced.rounds == 40 and low < 1 < high and raced.fastest == "a"
    assert race_in_turns(runs, "a", max_seconds=100.0, clock=ticking()).rounds in range(8, 20)


def test_summarise_uses_median_and_interquartile_range():
    t = summarise([1.0, 2.0, 3.0, 4.0, 100.0])
    assert t == Timing(median=3.0, spread=(4.0 - 2.0) / 3.0, repeats=5, noisy=True)
    assert summarise([0.5]) == Timing(median=0.5, spread=0.0, repeats=1, noisy=False)
    with pytest.raises(ValueError):
        summarise([])


@pytest.mark.parametrize("kwargs", [{"warmup": -1}, {"repeats": 0}, {"max_seconds": 0}])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        time_callable(lambda: None, **kwargs)


# --- keys ---------------------------------------------------------------------------------------


def test_signature_is_stable_and_unambiguous():
    s = signature("kernel text", (4, 8), "float32")
    assert s == signature("kernel text", (4, 8), "float32")
    assert len(s) == 64 and int(s, 16) >= 0
    assert signature("ab", "c") != signature("a", "bc")


def test_device_id_is_a_stable_description():
    assert device_id() == device_id()
    assert f"{os.cpu_count()} cores" in device_id()
    assert "OPENBLAS_CORETYPE=" in device_id()  # the environment may pick OpenBLAS's kernels: they set its speed


# --- the database -------------------------------------------------------------------------------


def test_put_get_round_trip(tmp_path):
    with MeasurementDB(tmp_path / "m.sqlite") as db:
        assert db.get("k") is None and len(db) == 0
        db.put("k", T)
        assert db.get("k") == T
        assert db.get("k", device="some gpu") is None
        db.put("k", Timing(2e-3, 0.5, 3, True))
        assert db.get("k") == Timing(2e-3, 0.5, 3, True) and len(db) == 1
    with MeasurementDB(tmp_path / "m.sqlite") as db:
        assert db.get("k") == Timing(2e-3, 0.5, 3, True)


def test_database_is_in_wal_mode(tmp_path):
    with MeasurementDB(tmp_path / "m.sqlite") as db:
        assert db._connection().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_measure_times_only_on_a_miss(tmp_path):
    fn = Counter()
    with MeasurementDB(tmp_path / "m.sqlite") as db:
        first = db.measure("k", fn, device="dev", min_seconds=0.005)
        calls = fn.calls
        assert calls > 0
        assert db.measure("k", fn, device="dev") == first
        assert fn.calls == calls
    with MeasurementDB(tmp_path / "m.sqlite") as db:
        assert db.measure("k", fn, device="dev") == first
        assert fn.calls == calls


def test_default_path_honours_rewriter_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("REWRITER_CACHE", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "measurements.sqlite"
    with MeasurementDB() as db:
        db.put("k", T)
    assert (tmp_path / "cache" / "measurements.sqlite").exists()


def test_default_path_falls_back_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("REWRITER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_path() == tmp_path / "xdg" / "rewriter" / "measurements.sqlite"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_path() == tmp_path / ".cache" / "rewriter" / "measurements.sqlite"


def test_pickled_database_reopens_the_same_file(tmp_path):
    with MeasurementDB(tmp_path / "m.sqlite") as db:
        db.put("k", T)
        copy = pickle.loads(pickle.dumps(db))
    assert copy.get("k") == T
    copy.close()


def _write_rows(db: MeasurementDB, worker: int) -> None:
    """One writer's share: 50 rows of its own."""
    for i in range(50):
        db.put(f"w{worker}-{i}", Timing(float(i), 0.0, 1, False), device="dev")


def _put_rows(db: MeasurementDB, worker: int, barrier) -> None:
    """A writer given an open database: wait for the others, then write."""
    barrier.wait()
    _write_rows(db, worker)


def _open_and_put_rows(path: Path, worker: int, barrier) -> None:
    """A writer that opens the database itself, at the same moment as the others."""
    barrier.wait()
    with MeasurementDB(path) as db:
        _write_rows(db, worker)


def _run_writers(method: str, target, args) -> None:
    """Start four writers with ``method`` and check they all finished cleanly."""
    ctx = multiprocessing.get_context(method)
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=target, args=(args, w, barrier)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]


def test_concurrent_writers_on_a_fresh_file_lose_nothing(tmp_path):
    """Four spawned processes create the database and write to it at once."""
    path = tmp_path / "m.sqlite"
    _run_writers("spawn", _open_and_put_rows, path)
    with MeasurementDB(path) as db:
        assert len(db) == 200
        assert db.get("w3-49", device="dev") == Timing(49.0, 0.0, 1, False)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_forked_writers_share_an_open_database_object(tmp_path):
    """Forked children inherit the parent's open object; each must use a connection of its own."""
    db = MeasurementDB(tmp_path / "m.sqlite")
    db.put("parent", T)
    _run_writers("fork", _put_rows, db)
    assert len(db) == 201 and db.get("parent") == T
    db.close()


_WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from codegen.measure import MeasurementDB, Timing
db, n, i = MeasurementDB(sys.argv[2]), int(sys.argv[3]), 0
while True:
    db.put(f"row{i}", Timing(float(i), 0.0, 1, False), device="dev")
    i += 1
    if i == n:
        print(n, flush=True)
"""


def test_kill_mid_write_keeps_committed_rows(tmp_path):
    path, n = tmp_path / "m.sqlite", 100
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(ROOT), str(path), str(n)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == str(n)
        time.sleep(0.05)  # let it get well into the writes that follow
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    with MeasurementDB(path) as db:
        assert len(db) >= n
        assert all(db.get(f"row{i}", device="dev") == Timing(float(i), 0.0, 1, False) for i in range(n))
        db.put("after", T)
        assert db.get("after") == T
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
