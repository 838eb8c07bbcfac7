"""Fine-tune a tiny Hugging Face Qwen2.5-VL (its own small tokenizer and chat template) from --hf-checkpoint at PP2
(the ViT split over the stages: window and full-attention layers on each) with ISF packing on ``messages`` JSONL
data with photos (--max-pixels keeping them small); the loss falls; its first iteration at TP2 (padded ViT heads,
the micro-batch broadcast over TP) equals PP2's; `omnibal hf export` of the result loads in transformers and its logits equal our model's on the exported folder (slow)."""

import pytest
import torch

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")
import hf_tiny_qwen  # noqa: E402

pytestmark = pytest.mark.slow

def test_finetune_qwen_pp2_isf_messages_photos_then_export(tmp_path, data_cache):
    from transformers import Qwen2_5_VLForConditionalGeneration

    import hf_tiny
    from omnibal_cli import main as omnibal

    hf = tmp_path / "hf"
    model, ids = hf_tiny_qwen.make_tiny_with_tokenizer(hf, seed=3)
    data = hf_tiny_qwen.write_messages_data(tmp_path)
    flags = ["--hf-checkpoint", str(hf), "--data-path", data, "--max-pixels", str(28 * 28 * 12),
             "--pipeline-model-parallel-size", "2", "--pipeline-layout", "Iv*2|v*2PEt*2L", "--omnibal-isf",
             "--train-iters", "25", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "0",
             "--seq-length", "256", "--data-cache-dir", str(data_cache), "--save", str(tmp_path / "ckpt"),
             "--seed", "5"]
    records, out = run_training(2, flags, tmp_path, "qwen_finetune")
    assert "loaded weights from --hf-checkpoint" in out
    assert "conversations are rendered with the tokenizer's own chat template" in out
    assert "> ISF:" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 25
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, losses

    # TP2 (3 ViT heads padded to 4; TP rank 0 loads and broadcasts the micro-batch): the same first iteration
    tp2 = flags[:flags.index("--pipeline-model-parallel-size")]
    tp2 += ["--tensor-model-parallel-size", "2", "--omnibal-isf", "--train-iters", "1"]
    for flag in ("--micro-batch-size", "--global-batch-size", "--lr", "--lr-warmup-iters", "--eval-interval",
                 "--seq-length", "--data-cache-dir", "--seed"):
        tp2 += [flag, flags[flags.index(flag) + 1]]
    again, _ = run_training(2, tp2, tmp_path, "qwen_tp2")
    assert abs(again[0]["lm loss"] - records[0]["lm loss"]) <= 1e-5 * records[0]["lm loss"], (again, records[0])

    assert omnibal(["hf", "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    tuned = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    assert not torch.equal(tuned.model.language_model.embed_tokens.weight,
                           model.model.language_model.embed_tokens.weight)
    hf_tiny_qwen.eager(tuned)
    batch = hf_tiny_qwen.inputs_with_token_ids(ids)  # no text token is a special one
    want = hf_tiny_qwen.hf_logits(tuned, batch)
    assert (hf_tiny.our_logits(tmp_path / "out", batch) - want).abs().max() <= 1e-5
