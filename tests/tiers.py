"""The suite's tiers, their time budgets and the time each took in a run (printed by conftest.py at the end).

* ``unit``: in-process tests (no marker);
* ``slow``: multi-process runs in the worker pools (``tests/pool.py``) and the few fresh launches that need their own
  processes (marker ``slow``);
* ``bench``: the benchmark scripts on small synthetic inputs (marker ``bench``).

Every tier runs by default (the README's ``python -m pytest``, CI's command), in two pytest-xdist workers
(``pytest.ini``). A tier's time is the sum of its tests' (setup, call and teardown) wall time, and the CPU time of
the worker that ran each, its finished children and its live pool ranks over the test; the two workers run at once,
so the tiers' sums exceed the run's own wall time, which the summary's last line gives against the suite's budget.
The budgets are for an idle 2-core machine: on a shared one the wall times grow, the CPU times much less (compare
those).
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass

TIERS = ("unit", "slow", "bench")
# the whole run's wall seconds on an idle 2-core machine (15 minutes; later work may take it to 20)
RUN_BUDGET_S = 900
# each tier's tests' wall seconds, summed over the two pytest-xdist workers (pytest.ini), on that machine: together
# the two workers' 2 x 900 s
BUDGET_S = {"unit": 300, "slow": 1380, "bench": 120}
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def tier_of(item) -> str:
    """The tier of a collected test (its markers)."""
    if item.get_closest_marker("bench"):
        return "bench"
    if item.get_closest_marker("slow"):
        return "slow"
    return "unit"


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process and of its children it has reaped (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(map(int, fields[11:15])) * _TICK_S  # utime, stime, cutime, cstime (fields 14 to 17 of stat)


def cpu_s(live_pids=()) -> float:
    """CPU seconds so far of this process, its reaped children and the live processes ``live_pids``."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + sum(map(_process_cpu_s, live_pids))


@dataclass(frozen=True)
class TestTime:
    """One test's wall and CPU seconds (setup, call and teardown)."""

    test: str
    tier: str
    wall_s: float
    cpu_s: float


PROPERTY = "omnibal_test_time"  # the user property of a test's last report that carries its TestTime fields


@dataclass(frozen=True)
class Span:
    """A running test's clock: the wall and CPU seconds at its start."""

    wall: float
    cpu: float

    @classmethod
    def start(cls, live_pids) -> "Span":
        return cls(time.perf_counter(), cpu_s(live_pids))

    def stop(self, tier: str, test: str, live_pids) -> tuple:
        """The test's TestTime fields (a tuple: it travels in a report from a pytest-xdist worker); a rank reaped
        meanwhile moved its time into the children's, one started meanwhile is live now."""
        return (test, tier, time.perf_counter() - self.wall, cpu_s(live_pids) - self.cpu)


class TierClock:
    """Wall and CPU time of each test over a run, summed per tier."""

    def __init__(self):
        self.per_test: list[TestTime] = []  # in the order reported
        self.started = time.perf_counter()  # the run's start (this process's configuration)

    def add(self, fields: tuple) -> None:
        self.per_test.append(TestTime(*fields))

    def write_json(self, path: str) -> None:
        """Each test's wall and CPU seconds, slowest first (``OMNIBAL_TEST_TIMES=<path>``: where a run's time went)."""
        rows = [{"test": t.test, "tier": t.tier, "wall_s": round(t.wall_s, 2), "cpu_s": round(t.cpu_s, 2)}
                for t in sorted(self.per_test, key=lambda t: -t.wall_s)]
        with open(path, "w") as f:
            json.dump(rows, f, indent=0)

    def lines(self) -> list[str]:
        """The summary table: each tier's tests, wall and CPU seconds against its budget."""
        def row(name: str, times: list[TestTime], budget_s: int, flag: bool) -> str:
            wall = sum(t.wall_s for t in times)
            over = "  OVER BUDGET" if flag and wall > budget_s else ""
            return f"{name:6} {len(times):6d} {wall:8.1f} {sum(t.cpu_s for t in times):8.1f} {budget_s:9d}{over}"

        out = [f"{'tier':6} {'tests':>6} {'wall s':>8} {'cpu s':>8} {'budget s':>9}"]
        out += [row(tier, [t for t in self.per_test if t.tier == tier], BUDGET_S[tier], True) for tier in TIERS]
        out.append(row("all", self.per_test, sum(BUDGET_S.values()), False))
        run_s = time.perf_counter() - self.started
        over = "  OVER BUDGET" if run_s > RUN_BUDGET_S else ""
        out.append(f"{'run':6} {'':6} {run_s:8.1f} {'':8} {RUN_BUDGET_S:9d}{over}   (the whole run's wall time)")
        return out


class ReportedTimes:
    """A pytest plugin: each test's time (``PROPERTY`` of its reports) into ``clock``."""

    def __init__(self, clock: TierClock):
        self.clock = clock

    def pytest_runtest_logreport(self, report):
        for name, value in report.user_properties:
            if name == PROPERTY:
                self.clock.add(value)


def merge_pool_stats(total: dict, stats: dict) -> None:
    """Add one process's ``pool.stats()`` ({ranks: (starts, cases, most threads)}) to ``total``."""
    for n, (starts, cases, threads) in stats.items():
        was = total.get(n, (0, 0, 0))
        total[n] = (was[0] + starts, was[1] + cases, max(was[2], threads))
