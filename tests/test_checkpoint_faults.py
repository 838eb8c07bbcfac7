"""Checkpoints under faults: a killed worker (in training and inside a save) under torchrun --max-restarts,
and damaged or mismatched checkpoints, each refused with the file or tensor and the iteration named.

The kills are SIGKILLs the trainer sends itself at a chosen point of the first attempt
(``OMNIBAL_FAULT=train:N`` before iteration N, ``save:N`` inside the save of iteration N after the shards are
written), so the test does not depend on timing.
"""
import shutil

import pytest

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


@pytest.mark.parametrize("fault", ["train:5", "save:4"], ids=["killed-in-training", "killed-inside-a-save"])
def test_killed_worker_restarts_from_the_last_complete_checkpoint(uninterrupted, fault):
    d, flags, want = uninterrupted
    ckpt = d / f"ckpt-{fault.replace(':', '')}"
    records, out = run_training(2, flags + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2"], d,
                                "restarted", torchrun_flags=("--max-restarts", "1"), env={"OMNIBAL_FAULT": fault})
    assert "no checkpoint in --load" in out  # the first attempt started from scratch
    resumed_from = 4 if fault == "train:5" else 2  # a save killed before its manifest does not count
    assert f"loaded checkpoint of iteration {resumed_from}" in out
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
    assert proc.returncode == 2, proc.stderr[-3000:]
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
