"""The suite's tiers, their time budgets and the time each took in a run (printed by conftest.py at the end).

* ``unit``: in-process tests (no marker);
* ``slow``: multi-process runs in the worker pools (``tests/pool.py``) and the few fresh launches that need their own
  processes (marker ``slow``);
* ``bench``: the benchmark scripts on small synthetic inputs (marker ``bench``).

Every tier runs by default (the README's ``python -m pytest``, CI's command). A tier's time is the sum of its tests'
(setup, call and teardown) wall time, and the CPU time of the pytest process, its finished children and the live
pool ranks over those tests. The budgets are for an idle 2-core machine: on a shared one the wall times grow, the
CPU times much less (compare those).
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass

TIERS = ("unit", "slow", "bench")
# seconds of wall time on an idle 2-core machine; the whole suite's budget is 15 minutes (900 s)
BUDGET_S = {"unit": 300, "slow": 480, "bench": 60}
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def tier_of(item) -> str:
    """The tier of a collected test (its markers)."""
    if item.get_closest_marker("bench"):
        return "bench"
    if item.get_closest_marker("slow"):
        return "slow"
    return "unit"


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat)


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


class TierClock:
    """Wall and CPU time of each test over a run, summed per tier."""

    def __init__(self, live_pids):
        self.live_pids = live_pids  # () -> the pids of the live pool ranks
        self.per_test: list[TestTime] = []  # in the order run

    def measure(self, tier: str, test: str):
        """A context manager recording its block's wall and CPU time as ``test``'s, in ``tier``."""
        clock = self

        class _Span:
            def __enter__(self):
                self.wall, self.cpu = time.perf_counter(), cpu_s(clock.live_pids())

            def __exit__(self, *exc):
                # a rank reaped meanwhile moved its time into the children's; one started meanwhile is live now
                clock.per_test.append(TestTime(test, tier, time.perf_counter() - self.wall,
                                               cpu_s(clock.live_pids()) - self.cpu))

        return _Span()

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
        return out
