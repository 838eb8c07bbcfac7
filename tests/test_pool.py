"""The test architecture itself: a worker pool runs the trainer as fresh processes do (identical losses and gradient
norms after a case that leaves everything dirty), puts every rank back between cases, reports a failed case and
restarts after a dead rank; the canonical runs' key and prefix rules (tests/canonical.py) against runs of the
flags they merge."""
from __future__ import annotations

import json

import pytest

import pool
from canonical import TINY, TINY_MOE, RunKey, Schedule, parse_flags
from launch import TRAINER, run_trainer


# ------------------------------------------------------------------------------------------------ the key (unit)
def test_run_key_ignores_order_and_neutral_flags_only():
    a = RunKey.of(1, TINY + ["--train-iters", "6", "--data-cache-dir", "/a", "--save", "/s"])
    b = RunKey.of(1, ["--train-iters", "6", "--log-activation-memory", *reversed_pairs(TINY)])
    assert a.same_steps(b) and a.iters == b.iters == 6
    assert not a.same_steps(RunKey.of(2, TINY + ["--train-iters", "6"]))  # another world size
    assert not a.same_steps(RunKey.of(1, TINY + ["--train-iters", "6", "--seed", "8"]))  # the last --seed counts
    assert RunKey.of(1, TINY + ["--train-iters", "6", "--exit-interval", "3"]).iters == 3
    assert parse_flags(["--recompute-plan=v4,t2|t2s", "--sequence-parallel", "--lr", "1"]) == [
        ("--recompute-plan", ("v4,t2|t2s",)), ("--sequence-parallel", ()), ("--lr", ("1",))]


def reversed_pairs(flags):
    return [t for name, values in reversed(parse_flags(flags)) for t in (name, *values)]


def test_schedule_merges_only_runs_with_the_same_steps():
    """Constant LR after the same warm-up: 6 and 8 iterations take the same first 6 steps; a warm-up that --train-
    iters cuts short (min(W, T - 1)) or a decaying rate (it spans --train-iters) do not merge."""
    def of(*flags):
        return Schedule.of(parse_flags(list(flags)))

    assert of("--train-iters", "6", "--lr-warmup-iters", "0") == of("--train-iters", "8", "--lr-warmup-iters", "0")
    assert of("--train-iters", "6", "--lr-warmup-iters", "2") == of("--train-iters", "30", "--lr-warmup-iters", "2")
    assert of("--train-iters", "3", "--lr-warmup-iters", "10") != of("--train-iters", "8", "--lr-warmup-iters", "10")
    assert of("--train-iters", "6", "--lr-decay-style", "cosine") != of("--train-iters", "8", "--lr-decay-style",
                                                                        "cosine")


# ------------------------------------------------------------------------------------------------- the rules (runs)
@pytest.mark.slow
def test_canonical_prefix_and_neutral_flags_give_the_same_numbers(canonical_runs, data_cache, tmp_path):
    """A 6-iteration run saving a checkpoint and logging its activation memory, in its own folder, gives the records
    the registry serves it from the 8-iteration canonical run (bit for bit)."""
    flags = TINY + ["--train-iters", "6", "--data-cache-dir", str(data_cache)]
    served = canonical_runs.records(1, flags)
    assert any(k.iters == 8 and k.same_steps(RunKey.of(1, flags)) for k in canonical_runs.launched)
    own = run_trainer(flags + ["--save", str(tmp_path / "ckpt"), "--log-activation-memory"], tmp_path, "own", nproc=1)
    assert own.memory is not None and (tmp_path / "ckpt" / "iter_0000006").is_dir()
    numbers = ("lm loss", "grad norm", "learning rate", "consumed samples", "answer acc")
    assert [[r[k] for k in numbers] for r in own.records] == [[r[k] for k in numbers] for r in served]


# ------------------------------------------------------------------------------------------------ the pool (runs)
@pytest.mark.slow
def test_pool_after_a_dirty_case_trains_as_fresh_torchrun(data_cache, tmp_path):
    """The MoE model at EP2 with ISF: in the pool right after a case that left every kind of state behind, again after
    another run (PP2, MoE layers on one stage each), and under a fresh torchrun: identical losses, gradient norms and
    MoE auxiliary losses; the three runs leave no OS thread behind in the pool."""
    flags = TINY_MOE + ["--train-iters", "4", "--omnibal-isf", "--data-cache-dir", str(data_cache)]
    ep2 = ["--expert-model-parallel-size", "2"]
    dirty = pool.run_case("pool_probe:main", ["dirty"], 2, tmp_path)
    assert dirty.returncode == 0, dirty.output

    def gloo_threads(name: str) -> list[str]:
        assert pool.run_case("pool_probe:main", ["inspect", str(tmp_path / name)], 2, tmp_path).returncode == 0
        return [t for t in json.loads((tmp_path / name).read_text())["os_thread_names"] if "gloo" in t]

    before = gloo_threads("before.json")
    pooled = run_trainer(flags + ep2, tmp_path, "pooled", nproc=2)
    between = run_trainer(flags + ["--pipeline-model-parallel-size", "2"], tmp_path, "pp2", nproc=2)
    again = run_trainer(flags + ep2, tmp_path, "again", nproc=2)
    # megatron-core 0.16.1 leaves MoE runs' models alive (pool_worker.empty_leaked_modules): their groups' gloo
    # threads are gone all the same
    assert gloo_threads("after.json") == before
    fresh = run_trainer(flags + ep2, tmp_path, "fresh", nproc=2, torchrun_flags=("--max-restarts", "0"))
    numbers = ("lm loss", "grad norm", "moe aux loss", "learning rate")

    def table(run):
        return [[r.get(k) for k in numbers] for r in run.records]

    assert table(pooled) == table(again) == table(fresh)
    assert len(pooled.records) == 4 and pooled.records[0]["moe aux loss"] is not None
    assert len(between.records) == 4 and table(between) != table(pooled)


@pytest.mark.slow
def test_pool_puts_every_rank_back_reports_failures_and_restarts(tmp_path):
    p = pool.pool(2)
    # the threads the pool holds before the dirty case
    assert p.run("pool_probe:main", ["inspect", str(tmp_path / "before.json")], tmp_path).returncode == 0
    os_threads = json.loads((tmp_path / "before.json").read_text())["os_threads"]
    assert p.run("pool_probe:main", ["dirty"], tmp_path).returncode == 0
    clean = p.run("pool_probe:main", ["inspect", str(tmp_path / "state.json")], tmp_path)
    assert clean.returncode == 0, clean.output
    state = json.loads((tmp_path / "state.json").read_text())
    assert state.pop("os_threads") == os_threads  # the dirty case's groups and their gloo threads are gone
    state.pop("os_thread_names")
    assert state == {"env": None, "cwd": str(tmp_path), "dtype": "torch.float32", "threads": 1, "grad": True,
                     "families": ["internvl", "qwen2_5_vl", "qwen3_5", "qwen3_vl"], "toy_imported": False,
                     "model_parallel": False, "rng_states": [], "groups": 1}, state

    starts = p.starts
    user = p.run("pool_probe:main", ["user-error"], tmp_path)  # every rank refuses: the pool stays
    assert user.returncode == 1 and user.stderr == ["error: --probe 0: must be >= 1\n"] * 2
    assert p.starts == starts and p.alive

    bug = p.run("pool_probe:main", ["fail", "1"], tmp_path)  # rank 0 waits in a barrier: the pool goes down
    assert bug.returncode == 1
    assert "RuntimeError: a bug on rank 1" in bug.stderr[1] and "Traceback" in bug.stderr[1]
    assert not p.alive
    died = p.run("pool_probe:main", ["die", "0"], tmp_path)  # restarted for this case; rank 0 dies in it
    assert died.returncode == 3 and p.starts == starts + 1 and not p.alive
    after = p.run("pool_probe:main", ["inspect", str(tmp_path / "after.json")], tmp_path)  # and again
    assert after.returncode == 0 and p.starts == starts + 2
    fresh = json.loads((tmp_path / "after.json").read_text())
    assert fresh.pop("os_threads") <= os_threads  # a restarted pool holds no more than the old one did
    fresh.pop("os_thread_names")
    assert fresh == state


@pytest.mark.slow
def test_an_energon_run_leaves_no_gloo_thread_in_a_pool_of_one(tmp_path):
    """Energon's loader collects and freezes the heap at an iterator's start (``GcDataset``); in the suite's processes
    the freeze must not keep a run's objects: two Energon runs in the pool of one rank leave no gloo thread behind
    (each used to leave its ~16 groups' threads: tests/frozen_heap.py)."""
    from megatron.vlm.data.energon.convert import to_energon
    from test_energon_data import small_data

    to_energon(small_data(tmp_path / "media", 6), str(tmp_path / "en"), samples_per_shard=3)
    flags = ["--data-path", str(tmp_path / "en"), "--train-iters", "2", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--eval-interval", "0", "--seq-length", "512"]

    def gloo_threads(name: str) -> list[str]:
        assert pool.run_case("pool_probe:main", ["inspect", str(tmp_path / name)], 1, tmp_path).returncode == 0
        return [t for t in json.loads((tmp_path / name).read_text())["os_thread_names"] if "gloo" in t]

    before = gloo_threads("before.json")
    for _ in range(2):
        run = pool.run_case(TRAINER, flags, 1, tmp_path)
        assert run.returncode == 0, run.output
    assert gloo_threads("after.json") == before
