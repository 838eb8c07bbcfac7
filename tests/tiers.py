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


@dataclass
class TierTime:
    tests: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0


class TierClock:
    """Wall and CPU time per tier over a run."""

    def __init__(self, live_pids):
        self.live_pids = live_pids  # () -> the pids of the live pool ranks
        self.times = {tier: TierTime() for tier in TIERS}
        self.per_test: list[dict] = []  # {"test", "tier", "wall_s", "cpu_s"} in the order run

    def measure(self, tier: str, test: str):
        """A context manager adding its block's wall and CPU time to ``tier`` (and to ``per_test`` as ``test``)."""
        clock = self

        class _Span:
            def __enter__(self):
                self.wall, self.cpu = time.perf_counter(), cpu_s(clock.live_pids())

            def __exit__(self, *exc):
                # a rank reaped meanwhile moved its time into the children's; one started meanwhile is live now
                wall, cpu = time.perf_counter() - self.wall, cpu_s(clock.live_pids()) - self.cpu
                t = clock.times[tier]
                t.tests += 1
                t.wall_s += wall
                t.cpu_s += cpu
                clock.per_test.append({"test": test, "tier": tier, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})

        return _Span()

    def write_json(self, path: str) -> None:
        """Each test's wall and CPU seconds, slowest first (``OMNIBAL_TEST_TIMES=<path>``: where a run's time went)."""
        with open(path, "w") as f:
            json.dump(sorted(self.per_test, key=lambda t: -t["wall_s"]), f, indent=0)

    def lines(self) -> list[str]:
        """The summary table: each tier's tests, wall and CPU seconds against its budget."""
        out = [f"{'tier':6} {'tests':>6} {'wall s':>8} {'cpu s':>8} {'budget s':>9}"]
        for tier in TIERS:
            t = self.times[tier]
            over = "  OVER BUDGET" if t.wall_s > BUDGET_S[tier] else ""
            out.append(f"{tier:6} {t.tests:6d} {t.wall_s:8.1f} {t.cpu_s:8.1f} {BUDGET_S[tier]:9d}{over}")
        total = TierTime(sum(t.tests for t in self.times.values()), sum(t.wall_s for t in self.times.values()),
                         sum(t.cpu_s for t in self.times.values()))
        out.append(f"{'all':6} {total.tests:6d} {total.wall_s:8.1f} {total.cpu_s:8.1f} {sum(BUDGET_S.values()):9d}")
        return out
