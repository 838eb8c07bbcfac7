"""The THD attention path against the dense-mask one (--attention-backend unfused) in the trainer,
under tensor and pipeline parallelism, with random (padded) and ISF (packed) micro-batches: the same
weights and data give the same losses (one torchrun launch per backend and configuration)."""
import pytest

from launch import run_training

pytestmark = pytest.mark.slow

BASE = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "0",
        "--lr", "2e-3", "--log-interval", "1", "--seed", "7", "--eval-interval", "0"]


@pytest.mark.parametrize("parallel,batching", [(["--tensor-model-parallel-size", "2"], []),
                                              (["--pipeline-model-parallel-size", "2"], ["--omnibal-isf"])],
                         ids=["random-tp2", "isf-pp2"])  # each parallelism and each batching once
def test_thd_equals_dense_mask_in_the_trainer(tmp_path, data_cache, parallel, batching):
    flags = BASE + parallel + batching + ["--data-cache-dir", str(data_cache)]
    thd, _ = run_training(2, flags, tmp_path, "thd")
    dense, _ = run_training(2, flags + ["--attention-backend", "unfused"], tmp_path, "dense")
    assert [r["iteration"] for r in thd] == [r["iteration"] for r in dense] == [1, 2, 3]
    # iteration 1 runs the same weights: the mean of per-token losses agrees to fp32 rounding; later
    # iterations carry the gradients' rounding differences through the updates
    assert abs(thd[0]["lm loss"] - dense[0]["lm loss"]) <= 1e-6 * abs(dense[0]["lm loss"]), (thd, dense)
    for a, b in zip(thd, dense):
        assert abs(a["lm loss"] - b["lm loss"]) <= 1e-5 * abs(b["lm loss"]), (thd, dense)
    if batching:  # packed: no padding inside a micro-batch
        assert all(r["pad ratio"] == 0.0 for r in thd)
