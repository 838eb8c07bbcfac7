"""Fine-tune a tiny Hugging Face InternVL (with its own small tokenizer) from --hf-checkpoint at PP2 with ISF
packing on the built-in digits data; the loss falls; `omnibal hf export` of the result loads in transformers and
its logits equal our model's on the exported folder (slow)."""
import pytest
import torch

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny  # noqa: E402

pytestmark = pytest.mark.slow

def test_finetune_hf_model_pp2_isf_then_export(tmp_path, data_cache):
    from transformers import InternVLForConditionalGeneration

    from omnibal_cli import main as omnibal

    hf = tmp_path / "hf"
    model, image_id = hf_tiny.make_tiny_with_tokenizer(hf, seed=3, vit="rms-qknorm", text="qwen2", vit_heads=3)
    flags = ["--hf-checkpoint", str(hf), "--pipeline-model-parallel-size", "2", "--omnibal-isf",
             "--train-iters", "30", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "2e-3",
             "--lr-warmup-iters", "2", "--eval-interval", "0", "--seq-length", "256", "--max-num-tiles", "2",
             "--data-cache-dir", str(data_cache), "--save", str(tmp_path / "ckpt"), "--seed", "5"]
    records, out = run_training(2, flags, tmp_path, "finetune")
    assert "loaded weights from --hf-checkpoint" in out
    assert "conversations are rendered with the tokenizer's own chat template" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses

    # the offline import is a weights-only checkpoint that loads at another parallel layout: its first
    # iteration at TP2 trains the same weights on the same data as the run above
    assert omnibal(["hf", "import", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "imported")]) == 0
    tp2 = ["--hf-checkpoint", str(hf), "--omnibal-isf", "--tensor-model-parallel-size", "2", "--train-iters", "1",
           "--load", str(tmp_path / "imported")]
    for flag in ("--micro-batch-size", "--global-batch-size", "--lr", "--lr-warmup-iters", "--eval-interval",
                 "--seq-length", "--max-num-tiles", "--data-cache-dir", "--seed"):
        tp2 += [flag, flags[flags.index(flag) + 1]]
    again, out = run_training(2, tp2, tmp_path, "imported")
    assert "loaded checkpoint of iteration 0" in out
    assert abs(again[0]["lm loss"] - records[0]["lm loss"]) <= 1e-5 * records[0]["lm loss"], (again, records[0])

    assert omnibal(["hf", "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").exists()
    tuned = InternVLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    assert not torch.equal(tuned.model.language_model.embed_tokens.weight, model.model.language_model.embed_tokens.weight)
    batch = hf_tiny.inputs_with_image_id(image_id)
    want = hf_tiny.hf_logits(tuned, batch)
    assert (hf_tiny.our_logits(tmp_path / "out", batch) - want).abs().max() <= 1e-5
