"""Checkpoints under faults: killed workers (inside a save, then in training) under torchrun --max-restarts,
and damaged or mismatched checkpoints, each refused with the file or tensor and the iteration named.

The kills are SIGKILLs the trainer sends itself at a chosen point of a chosen attempt (``OMNIBAL_FAULT=save:4,train:5``:
inside the save of iteration 4 after the shards are written in the first attempt, before iteration 5 in the second),
so the test does not depend on timing.
"""
import re
import shutil

import pytest
import torch

from launch import run_single, run_training

pytestmark = pytest.mark.slow

BASE = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr-warmup-iters", "0",
        "--lr", "2e-3", "--seed", "5", "--eval-interval", "0"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def losses(records) -> dict:
    """Loss per iteration; a restarted attempt logs some iterations again: the last word counts."""
    return {r["iteration"]: r["lm loss"] for r in records}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
    d = tmp_path_factory.mktemp("faults")
    flags = BASE + PP2 + ["--data-cache-dir", str(data_cache)]
    records, _ = run_training(2, flags, d, "uninterrupted")
    return d, flags, losses(records)


def test_killed_workers_restart_from_the_last_complete_checkpoint(uninterrupted):
    """One torchrun job with two restarts: its first attempt is killed inside the save of iteration 4 (the shards
    written, not the manifest), the second before iteration 5; each restart resumes from the last complete
    checkpoint (2, then 4: a save killed before its manifest does not count), and the losses are the uninterrupted
    run's."""
    d, flags, want = uninterrupted
    ckpt = d / "ckpt"
    records, out = run_training(2, flags + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2"], d,
                                "restarted", torchrun_flags=("--max-restarts", "2"),
                                env={"OMNIBAL_FAULT": "save:4,train:5"})
    assert "no checkpoint in --load" in out  # the first attempt started from scratch
    loaded = re.findall(r"loaded checkpoint of iteration (\d+)", out)
    assert loaded == ["2", "4"], loaded  # rank 0's line, one per restart
    assert losses(records) == want  # exactly: same sizes, same data, same RNG
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                                      "latest_checkpointed_iteration.txt"]


@pytest.fixture(scope="module")
def single_ckpt(tmp_path_factory, data_cache):
    """A world-of-one run saved at iterations 2 and 4."""
    d = tmp_path_factory.mktemp("damaged")
    flags = BASE + ["--data-cache-dir", str(data_cache), "--train-iters", "4"]
    proc = run_single(flags + ["--save", str(d / "good"), "--save-interval", "2"], d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d, flags


def damaged(single_ckpt, name, damage):
    d, flags = single_ckpt
    folder = d / name
    shutil.copytree(d / "good", folder)
    damage(folder / "iter_0000004")
    return run_single(flags + ["--load", str(folder)], d), folder


def assert_refused(proc, *words):
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    for w in words:
        assert w in line, (w, line)


def truncate(folder):
    f = folder / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_a_byte(folder):
    f = folder / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_damaged_checkpoints_are_named_with_the_older_complete_one(single_ckpt):
    proc, folder = damaged(single_ckpt, "cut", truncate)
    assert_refused(proc, "iteration 4", str(folder / "iter_0000004" / "__0_0.distcp"), "truncated",
                   "newest older complete checkpoint is iteration 2", "--ckpt-step 2")
    proc, folder = damaged(single_ckpt, "flipped", flip_a_byte)
    assert_refused(proc, "iteration 4", "__0_0.distcp", "corrupt (its XXH3 checksum differs")
    proc, folder = damaged(single_ckpt, "missing", lambda f: (f / "__0_0.distcp").unlink())
    assert_refused(proc, "iteration 4", "__0_0.distcp is missing")
    proc, folder = damaged(single_ckpt, "unfinished", lambda f: (f / "omnibal_manifest.json").unlink())
    assert_refused(proc, "iteration 4", "the save did not finish")
    # the named older checkpoint resumes
    d, flags = single_ckpt
    proc = run_single(flags + ["--load", str(d / "cut"), "--ckpt-step", "2"], d)
    assert proc.returncode == 0 and "loaded checkpoint of iteration 2" in proc.stdout, proc.stderr[-3000:]


def test_checkpoint_of_another_model_and_an_empty_load_folder(single_ckpt, tmp_path):
    d, flags = single_ckpt
    proc = run_single(flags + ["--num-layers", "6", "--load", str(d / "good")], d)
    assert_refused(proc, "iteration 4", "another model shape", "language.num_layers: 4 saved, 6 now")
    proc = run_single(flags + ["--train-iters", "1", "--load", str(tmp_path / "empty")], d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"no checkpoint in --load {tmp_path / 'empty'}: starting from scratch" in proc.stdout


def log_lines(out: str) -> dict:
    """{iteration: {field: value}} of a run's iteration log lines on stdout."""
    lines = {}
    for line in out.splitlines():
        head, *fields = line.split(" | ")
        match = re.match(r"^ \[[^]]+\] iteration +(\d+)/", head)
        if match:
            lines[int(match.group(1))] = dict(f.split(": ", 1) for f in fields)
    return lines


def test_a_rollback_keeps_its_own_checkpoints_and_the_next_run_continues_them(single_ckpt):
    """The issue's rollback at small scale: the saved run (2, 4) is rolled back to 2 with another LR (the override
    flag) into the same folder with --keep-checkpoints 2 and saves 3 and 4: the first run's 4 is moved aside (not
    deleted, not mixed with the new one), the folder keeps the new 3 and 4, and a resume continues from the new 4
    (a longer run keeping its schedule with --lr-decay-iters). The LR logged is the one each iteration applied."""
    from launch import checkpoint_tensors

    d, flags = single_ckpt
    folder = d / "rolled"
    shutil.copytree(d / "good", folder)
    proc = run_single(flags + ["--load", str(folder), "--ckpt-step", "2", "--save", str(folder), "--save-interval", "1",
                               "--keep-checkpoints", "2", "--lr", "1e-3", "--override-opt_param-scheduler"], d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = next((folder / "superseded").iterdir())
    assert (f"> --save {folder}: this run continues from its iteration 2, so its checkpoints of iterations 4 are "
            f"another lineage: moved with the tracker to {aside}") in proc.stdout
    assert "saved checkpoint of iteration 3" in proc.stdout and "saved checkpoint of iteration 4" in proc.stdout
    assert "learning rate 0.002 saved, 0.001 now (--lr)" in proc.stdout
    assert [float(f["learning rate"]) for f in log_lines(proc.stdout).values()] == [1e-3, 1e-3]
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000003", "iter_0000004",
                                                        "latest_checkpointed_iteration.txt", "superseded"]
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    first, moved, new = (checkpoint_tensors(f / "iter_0000004") for f in (d / "good", aside, folder))
    assert all(torch.equal(first[k], moved[k]) for k in first)
    assert any(not torch.equal(first[k], new[k]) for k in first)  # the rolled-back lineage's own

    proc = run_single(flags + ["--load", str(folder), "--train-iters", "5", "--lr-decay-iters", "4", "--lr", "1e-3"], d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loaded checkpoint of iteration 4 from {folder / 'iter_0000004'}" in proc.stdout
    assert list(log_lines(proc.stdout)) == [5]


def test_a_nan_stops_every_rank_before_the_step_and_keeps_finite_checkpoints(single_ckpt):
    """--lr 1e6: the run stops at the first iteration whose loss or gradients are not finite, with one line naming
    it and exit status 1; every checkpoint it saved (one per iteration before) holds finite tensors. The LR logged
    is the one each iteration applied: 0 at iteration 1 (warm-up from 0), then half the peak."""
    from launch import checkpoint_tensors

    d, flags = single_ckpt
    folder = d / "nan"
    proc = run_single(flags + ["--train-iters", "6", "--lr", "1e6", "--lr-warmup-iters", "2", "--save", str(folder),
                               "--save-interval", "1"], d)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    logged = log_lines(proc.stdout)
    stopped = max(logged) + 1
    assert error.startswith(f"error: iteration {stopped}: NaN or Inf in ") and "--no-check-for-nan-in-loss-and-grad" in \
        error
    assert [float(logged[i]["learning rate"]) for i in (1, 2)] == [0.0, 5e5]
    saved = sorted(p.name for p in folder.iterdir())
    assert saved == [f"iter_{i:07d}" for i in range(1, stopped)] + ["latest_checkpointed_iteration.txt"]
    for name in saved[:-1]:
        assert all(torch.isfinite(t).all() for t in checkpoint_tensors(folder / name).values()), name
