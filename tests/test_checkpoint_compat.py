"""A checkpoint written by an earlier release (tests/data/ckpt_before_families, see tests/data/README.md)
loads and resumes to the losses that release logged for its uninterrupted run."""
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
    records, _ = run_training(2, FLAGS + ["--data-cache-dir", str(data_cache), "--load", str(ckpt)], tmp_path, "compat")
    got = {r["iteration"]: r["lm loss"] for r in records}
    assert sorted(got) == [5, 6]
    assert [got[5], got[6]] == pytest.approx(RELEASE_LOSSES, rel=1e-6)
