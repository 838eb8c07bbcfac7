import hashlib
import json
import os
import sys
from pathlib import Path

import filelock
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

CLOCK = pytest.StashKey[tiers.TierClock]()  # each tier's time in this run (in the process that prints the summary)
SPAN = pytest.StashKey[tiers.Span]()  # the running test's clock, from its setup to its teardown
POOL_STATS = pytest.StashKey[dict]()  # pool.stats() of each process that ran tests, at its end


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")  # pytest-xdist's worker processes (-n N); the controller runs no test


def pytest_configure(config):
    config.stash[CLOCK] = tiers.TierClock()
    config.stash[POOL_STATS] = {}
    if not _is_xdist_worker(config):  # the tests' times arrive with their reports (from the workers under -n)
        config.pluginmanager.register(tiers.ReportedTimes(config.stash[CLOCK]), "omnibal-tier-times")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[SPAN] = tiers.Span.start(pool.live_pids())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and SPAN in item.stash:  # the test's time travels with its last report
        outcome.get_result().user_properties.append(
            (tiers.PROPERTY, item.stash[SPAN].stop(tiers.tier_of(item), item.nodeid, pool.live_pids())))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is None or nextitem.module is not item.module:
        frozen_heap.freeze_survivors()  # the module's own fixtures are torn down: what they made is collected first


frozen_heap.keep_frozen_through_energon()
frozen_heap.freeze_survivors()  # the imports above


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    stats = pool.stats()
    pool.shutdown()
    if _is_xdist_worker(config):
        config.workeroutput["pool_stats"] = json.dumps(stats)  # read by the controller (pytest_testnodedown)
        return
    tiers.merge_pool_stats(config.stash[POOL_STATS], stats)
    if os.environ.get("OMNIBAL_TEST_TIMES"):
        config.stash[CLOCK].write_json(os.environ["OMNIBAL_TEST_TIMES"])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist: a worker's pool counts, added to the controller's."""
    stats = json.loads(getattr(node, "workeroutput", {}).get("pool_stats", "{}"))
    tiers.merge_pool_stats(node.config.stash[POOL_STATS], {int(k): v for k, v in stats.items()})


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.section("time per tier (tests/tiers.py)")
    for line in config.stash[CLOCK].lines():
        terminalreporter.write_line(line)
    stats = config.stash[POOL_STATS]
    if stats:
        terminalreporter.write_line("worker pools (ranks: starts, cases, most threads after a case): " + ", ".join(
            f"{n}: {starts}, {cases}, {threads}" for n, (starts, cases, threads) in sorted(stats.items())))


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
    ``folder``, named by the run's key) and returns (iteration records, output, path of its JSON log) to every test
    asking for the same nproc and flags (in any order: ``canonical.parse_flags``): a launch is deterministic in them.
    Flags that write (--save) point under ``folder``, so the same flags mean the same run.

    ``folder`` is shared by the pytest-xdist workers of a session: a run is kept there as a JSON file, and the
    first worker to ask for it launches it while a file lock holds the others until it is there."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)

    def run(self, nproc: int, flags: list[str]) -> tuple[list[dict], str, Path]:
        from launch import run_training

        key = (nproc, *sorted(canonical.parse_flags(flags), key=lambda pair: pair[0]))
        name = "run-" + hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        kept = self.folder / f"{name}.json"
        with filelock.FileLock(str(self.folder / f"{name}.lock")):
            if not kept.exists():
                records, out = run_training(nproc, list(flags), self.folder, name)
                kept.with_suffix(".tmp").write_text(json.dumps({"records": records, "output": out}))
                kept.with_suffix(".tmp").rename(kept)
        run = json.loads(kept.read_text())
        return run["records"], run["output"], self.folder / f"{name}.jsonl"


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, worker_id):
    """The session's SharedRuns, in a folder every pytest-xdist worker of the session shares."""
    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if worker_id != "master" else base) / "shared_runs")


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
