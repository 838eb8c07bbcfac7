"""Fine-tune a tiny Hugging Face Qwen3-VL (its own small tokenizer, chat template and ``preprocessor_config.json``)
from --hf-checkpoint at PP2 with DeepStack feature 0 crossing the stage boundary (``Iv*2|v*2PEt*3L``) under ISF
packing, on ``messages`` JSONL in transformers' structured content form (``{"type": "image", "image": PATH}``
parts) with small photo-like colour images of varied sizes (the answers name the colour); the loss falls;
`omnibal hf export` of the result loads in transformers and its logits equal our model's on the exported folder
(slow). (test_qwen3_vl_training's runs read the string form with ``<image>`` tags.)"""

import pytest
import torch

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny_qwen3_vl  # noqa: E402

pytestmark = pytest.mark.slow


def test_finetune_qwen3_vl_pp2_isf_messages_photos_then_export(tmp_path, data_cache):
    from transformers import Qwen3VLForConditionalGeneration

    import hf_tiny
    from omnibal_cli import main as omnibal

    hf = tmp_path / "hf"
    model, ids = hf_tiny_qwen3_vl.make_tiny_with_tokenizer(hf, seed=3)
    data = hf_tiny_qwen3_vl.write_messages_data(tmp_path, structured_content=True)
    flags = ["--hf-checkpoint", str(hf), "--data-path", data, "--pipeline-model-parallel-size", "2",
             "--pipeline-layout", "Iv*2|v*2PEt*3L", "--omnibal-isf", "--train-iters", "25", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "0",
             "--seq-length", "256", "--data-cache-dir", str(data_cache), "--save", str(tmp_path / "ckpt"),
             "--seed", "5"]
    records, out = run_training(2, flags, tmp_path, "qwen3_vl_finetune")
    assert "loaded weights from --hf-checkpoint" in out
    assert "conversations are rendered with the tokenizer's own chat template" in out
    assert "> ISF:" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 25
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, losses

    assert omnibal(["hf", "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    tuned = Qwen3VLForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    for name in ("model.language_model.embed_tokens.weight", "model.visual.deepstack_merger_list.0.linear_fc1.weight",
                 "model.visual.blocks.0.attn.qkv.weight"):
        assert not torch.equal(tuned.get_parameter(name), model.get_parameter(name)), name
    hf_tiny_qwen3_vl.eager(tuned)
    batch = hf_tiny_qwen3_vl.inputs_with_token_ids(ids)  # no text token is a special one
    want = hf_tiny_qwen3_vl.hf_logits(tuned, batch)
    assert (hf_tiny.our_logits(tmp_path / "out", batch) - want).abs().max() <= 1e-5
