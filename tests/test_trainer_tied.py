"""Tied input/output embeddings in training: PP 2 with E on stage 0 and L on stage 1 (two copies kept
equal by summing their gradients across the stages) equals the serial run (one shared weight)."""
import pytest

from launch import run_training
from test_trainer_parallel import BASE, assert_close, losses

pytestmark = pytest.mark.slow


def test_tied_embeddings_pp2_equals_serial(tmp_path, data_cache, serial_run):
    flags = BASE + ["--data-cache-dir", str(data_cache), "--tie-word-embeddings"]
    serial, _ = run_training(1, flags, tmp_path, "tied-serial")
    split, _ = run_training(2, flags + ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*4PEt*2|t*2L"],
                            tmp_path, "tied-pp2")
    assert_close(losses(split), losses(serial))
    assert_close([r["grad norm"] for r in split[:5]], [r["grad norm"] for r in serial[:5]], rel=1e-3)
    assert split[4]["lm loss"] < split[0]["lm loss"]
    untied = serial_run(BASE + ["--data-cache-dir", str(data_cache)])  # test_trainer_parallel's serial run
    assert abs(untied[1]["lm loss"] - serial[1]["lm loss"]) > 1e-4  # tying changes the model
