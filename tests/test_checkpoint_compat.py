"""A checkpoint written by an earlier release (tests/data/ckpt_before_families, see tests/data/README.md)
loads and resumes.

Since random batching serves single-sample groups (the samples of an iteration no longer depend on
--micro-batch-size), the data stream of that release (groups of 4 samples) differs from this one's: the run
says the data order restarts and trains the samples of the epoch the checkpoint had not served yet, in this
run's order, so its losses are no longer the release's own (those were 3.656 and 3.471 at iterations 5 and 6).
What is held: the resume is announced, iterations 5 and 6 run from the loaded weights and optimizer (losses
within 15% of the release's; a fresh start logs about 5.7), and the loss still falls."""
import shutil
from pathlib import Path

import pytest

from launch import run_training

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "data" / "ckpt_before_families"
FLAGS = ["--train-iters", "6", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr-warmup-iters", "0",
         "--lr", "2e-3", "--seed", "11", "--eval-interval", "0", "--pipeline-model-parallel-size", "2",
         "--vision-num-layers", "2", "--num-layers", "2"]
# lm loss of iterations 5 and 6 of the release that wrote the fixture, uninterrupted and resumed alike
RELEASE_LOSSES = [3.656263828277588, 3.470900297164917]


def test_checkpoint_of_an_earlier_release_resumes_to_its_losses(tmp_path, data_cache):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt)
    records, out = run_training(2, FLAGS + ["--data-cache-dir", str(data_cache), "--load", str(ckpt)], tmp_path,
                                "compat")
    assert "the data order restarts: the samples of its epoch not yet served come first" in out
    got = {r["iteration"]: r["lm loss"] for r in records}
    assert sorted(got) == [5, 6]
    assert [got[5], got[6]] == pytest.approx(RELEASE_LOSSES, rel=0.15)
    assert [r["consumed samples"] for r in records] == [80, 96]
