"""--distributed-timeout-minutes: a rank that never joins a collective makes the others fail with gloo's timeout
error within the flag's time, instead of hanging the run; the flag is refused when not positive."""
import time

import pytest

from launch import run_single, run_training


@pytest.mark.slow
def test_a_stalled_rank_becomes_an_error_within_the_timeout(tmp_path, data_cache):
    # DP2: rank 1 sleeps 300 s before iteration 2; rank 0 waits for it in that iteration's first collective (the
    # gradients' all-reduce over megatron-core's data-parallel group)
    flags = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-interval", "0",
             "--lr-warmup-iters", "0", "--data-cache-dir", str(data_cache), "--distributed-timeout-minutes", "0.25"]
    t0 = time.perf_counter()
    records, out = run_training(2, flags, tmp_path, "stall", timeout=240, expect_ok=False,
                                env={"OMNIBAL_FAULT": "train:2", "OMNIBAL_FAULT_STALL": "300"})
    wall = time.perf_counter() - t0
    assert "> fault: rank 1 stalls 300 s at train:2" in out
    assert [r["iteration"] for r in records] == [1]
    assert "Timed out waiting 15000ms" in out, out[-3000:]  # gloo's error, after 0.25 minutes
    assert wall < 200  # the stalled rank's 300 s were not waited for


def test_timeout_must_be_positive(tmp_path):
    proc = run_single(["--distributed-timeout-minutes", "0", "--train-iters", "1"], tmp_path)
    assert proc.returncode == 1
    assert "--distributed-timeout-minutes 0.0: must be > 0" in proc.stderr
