"""--sequence-parallel for Qwen2.5-VL at TP 2 against the serial run: a tiny Hugging Face Qwen2.5-VL (3 ViT heads
padded to 4, window and full-attention layers sharing the region, the packed images' patches split over TP)
fine-tuned on messages JSONL with photos under --omnibal-isf; the losses equal the serial run's (slow)."""
import pytest

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")
import hf_tiny_qwen  # noqa: E402

pytestmark = pytest.mark.slow


def test_qwen_sequence_parallel_equals_serial(tmp_path, data_cache):
    flags = hf_tiny_qwen.training_flags(tmp_path, data_cache) + [
        "--omnibal-isf", "--train-iters", "4", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "0", "--seed", "5"]
    serial, _ = run_training(1, flags, tmp_path, "serial")
    sp, _ = run_training(2, flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path, "sp")
    assert [r["iteration"] for r in sp] == [1, 2, 3, 4]
    for got, want in zip(sp, serial):  # replicated parameters' gradients summed over TP: same updates
        assert abs(got["lm loss"] - want["lm loss"]) <= 1e-4 * abs(want["lm loss"]), (got, want)
        assert abs(got["grad norm"] - want["grad norm"]) <= 1e-3 * abs(want["grad norm"]), (got, want)
