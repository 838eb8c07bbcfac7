"""Fine-tune a tiny Hugging Face Qwen3.5 (``hf_tiny_qwen3_5``: its own small tokenizer, chat template and
``preprocessor_config.json``) from --hf-checkpoint at PP2, the stage boundary between a linear and a full-attention
layer (``Iv*2PEt|t*4L``), under ISF packing on ``messages`` JSONL with photo crops of several sizes (the answers
name the photo): the loss falls (slow)."""
import pytest

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny_qwen3_5  # noqa: E402

pytestmark = pytest.mark.slow


def test_finetune_qwen3_5_pp2_isf(tmp_path, data_cache):
    flags = hf_tiny_qwen3_5.training_flags(tmp_path, data_cache, seed=3) + [
        "--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2PEt|t*4L", "--omnibal-isf",
        "--train-iters", "25", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--seed", "5"]
    records, out = run_training(2, flags, tmp_path, "qwen3_5_finetune")
    assert "loaded weights from --hf-checkpoint" in out
    assert "> ISF:" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 25
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, losses
