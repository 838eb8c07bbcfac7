import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron.vlm.families  # noqa: E402,F401  (registers the built-in families in omnibal_ext's registry)

# the published OmniBal stats (ai2d, chartqa, docvqa) shipped with the repository, gzip-compressed
STATS_DIR = ROOT / "data" / "omnibal_stats"
STATS_FILES = sorted(STATS_DIR.glob("*.json.gz"))


import canonical  # noqa: E402  (tests/ on the path first)
import frozen_heap  # noqa: E402
import pool  # noqa: E402
import tiers  # noqa: E402

CLOCK = pytest.StashKey[tiers.TierClock]()  # each tier's time in this run
POOL_STATS = pytest.StashKey[dict]()  # pool.stats() at the end of the session, before the pools stop


def pytest_configure(config):
    config.stash[CLOCK] = tiers.TierClock(pool.live_pids)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with item.config.stash[CLOCK].measure(tiers.tier_of(item), item.nodeid):
        yield
    if nextitem is None or nextitem.module is not item.module:
        frozen_heap.freeze_survivors()  # the module's own fixtures are torn down: what they made is collected first


frozen_heap.keep_frozen_through_energon()
frozen_heap.freeze_survivors()  # the imports above


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[POOL_STATS] = pool.stats()
    pool.shutdown()
    if os.environ.get("OMNIBAL_TEST_TIMES"):
        session.config.stash[CLOCK].write_json(os.environ["OMNIBAL_TEST_TIMES"])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.section("time per tier (tests/tiers.py)")
    for line in config.stash[CLOCK].lines():
        terminalreporter.write_line(line)
    stats = config.stash.get(POOL_STATS, {})
    if stats:
        terminalreporter.write_line("worker pools (ranks: starts, cases, most threads after a case): " + ", ".join(
            f"{n}: {starts}, {cases}, {threads}" for n, (starts, cases, threads) in stats.items()))


@pytest.fixture
def pooled_benchlib(monkeypatch):
    """benchlib (scripts/benchlib.py) with its trainer runs in the worker pools (``launch.run_trainer``): a benchmark's
    ``main`` called in this process trains in the pools instead of fresh processes. Returns the module."""
    import benchlib
    import launch

    monkeypatch.setattr(benchlib, "run_trainer", launch.run_trainer)
    return benchlib


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One folder for the built-in digits dataset, shared by every training run of the session."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def megatron_world():
    """A world of one (gloo) with megatron's model-parallel groups, inside the CPU patches, for building
    and running stages in-process; torn down (patches removed) after the module."""
    import os

    import torch.distributed as dist

    from megatron.training import cpu_compat
    from megatron.training.initialize import initialize_distributed, set_seeds

    with cpu_compat.patched():
        initialize_distributed(torch.device("cpu"), 1, 1)
        set_seeds(0)
        yield
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)


class SharedRuns:
    """Trainer launches shared by the tests of a session: ``run(nproc, flags)`` launches ``flags`` once (in
    ``folder``, named run0, run1, ...) and returns (iteration records, output, path of its JSON log) to every
    test asking for the same nproc and flags (in any order: ``canonical.parse_flags``): a launch is deterministic in
    them. Flags that write (--save) point under ``folder``, so the same flags mean the same run."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._runs: dict[tuple, tuple[list[dict], str, Path]] = {}

    def run(self, nproc: int, flags: list[str]) -> tuple[list[dict], str, Path]:
        from launch import run_training

        key = (nproc, *sorted(canonical.parse_flags(flags), key=lambda pair: pair[0]))
        if key not in self._runs:
            name = f"run{len(self._runs)}"
            records, out = run_training(nproc, list(flags), self.folder, name)
            self._runs[key] = (records, out, self.folder / f"{name}.jsonl")
        records, out, log = self._runs[key]
        return [dict(r) for r in records], out, log


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


@pytest.fixture(scope="session")
def canonical_runs(shared_runs):
    """``canonical_runs.records(nproc, flags)``: the iteration records of ``flags`` on ``nproc`` ranks, from the
    session's canonical runs (tests/canonical.py: neutral flags ignored, shorter runs served as prefixes)."""
    return canonical.CanonicalRuns(shared_runs)


@pytest.fixture(scope="session")
def serial_run(canonical_runs):
    """``serial_run(flags)``: the iteration records of the single-process run of ``flags``, from the session's
    canonical runs: the tests comparing parallel runs with the same serial flags share it."""
    return lambda flags: canonical_runs.records(1, flags)
