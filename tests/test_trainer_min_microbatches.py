"""The smallest micro-batch count each pipeline schedule accepts, against the serial run of the same batches:

* plain 1F1B at PP2 with one micro-batch per iteration (no steady state: a forward, then a backward);
* the interleaved schedule at PP2, V = 2 (``Iv*2|v*2PE|t*2|t*2L``) with PP = 2 micro-batches per iteration, where
  rank 0 runs all its forwards in megatron-core's warm-up and all its backwards in its cool-down (this case hung
  before the shape exchange of megatron/training/interleaved.py stopped waiting for its sends before its
  tensors), on the built-in model and on a tiny Hugging Face Qwen2.5-VL (``Iv*2|v*2PE|t|tL``).

Losses within 1e-5 (relative) and gradient norms within 1e-4 of the single-process run.
"""
import pytest

from launch import run_training

pytestmark = pytest.mark.slow

BASE = ["--train-iters", "3", "--micro-batch-size", "2", "--lr-warmup-iters", "0", "--lr", "2e-3",
        "--log-interval", "1", "--seed", "7", "--eval-interval", "0"]
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PE|t*2|t*2L"]


def assert_same_run(got, want):
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert abs(g["lm loss"] - w["lm loss"]) <= 1e-5 * abs(w["lm loss"]), (g, w)
        assert abs(g["grad norm"] - w["grad norm"]) <= 1e-4 * abs(w["grad norm"]), (g, w)


def test_one_f_one_b_with_one_micro_batch_equals_serial(tmp_path, data_cache, serial_run):
    flags = BASE + ["--global-batch-size", "2", "--data-cache-dir", str(data_cache)]
    records, out = run_training(2, flags + ["--pipeline-model-parallel-size", "2"], tmp_path, "pp2-m1")
    assert "1 micro-batches per iteration" in out
    assert_same_run(records, serial_run(flags))


def test_interleaved_with_pp_micro_batches_equals_serial(tmp_path, data_cache, serial_run):
    flags = BASE + ["--global-batch-size", "4", "--data-cache-dir", str(data_cache)]
    records, out = run_training(2, flags + INTERLEAVED, tmp_path, "v2-m2", timeout=180)
    assert "interleaved: 2 model chunks per rank, 2 micro-batches per iteration" in out
    assert_same_run(records, serial_run(flags))


def test_qwen_interleaved_with_pp_micro_batches_equals_serial(tmp_path, data_cache):
    pytest.importorskip("transformers")
    pytest.importorskip("sklearn")
    import hf_tiny_qwen

    flags = hf_tiny_qwen.training_flags(tmp_path, data_cache) + [
        "--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--seed", "5"]
    serial, _ = run_training(1, flags, tmp_path, "serial")
    layout = ["--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PE|t|tL"]  # its 2 LLM layers
    records, out = run_training(2, flags + layout, tmp_path, "v2-m2", timeout=180)
    assert "interleaved: 2 model chunks per rank, 2 micro-batches per iteration" in out
    assert_same_run(records, serial)
