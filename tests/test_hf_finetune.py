"""Fine-tune a tiny Hugging Face InternVL (with its own small tokenizer) from --hf-checkpoint at PP2 with ISF
packing on the built-in digits data; the loss falls; `omnibal hf export` of the result loads in transformers and
its logits equal our model's on the exported folder (slow)."""
import json

import pytest
import torch

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny  # noqa: E402

pytestmark = pytest.mark.slow

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB = 110  # 7 special + 96 characters = 103 ids; the model has a few rows more


def write_tokenizer(folder):
    """A character-level WordLevel tokenizer with InternVL's special tokens and a ChatML chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
        "eos_token": "<|im_end|>", "chat_template": template, "extra_special_tokens": {}}))
    return vocab["<IMG_CONTEXT>"]


def test_finetune_hf_model_pp2_isf_then_export(tmp_path, data_cache):
    from transformers import InternVLForConditionalGeneration

    from megatron.training import cpu_compat
    from megatron.training.initialize import destroy, initialize_distributed
    from megatron.vlm.hf.convert import HFSource
    from megatron.vlm.hf.logits import chained_logits
    from omnibal_cli import main as omnibal

    hf = tmp_path / "hf"
    hf.mkdir()
    image_id = write_tokenizer(hf)
    model = hf_tiny.make_tiny(hf, seed=3, vit="rms-qknorm", text="qwen2", vit_heads=3, vocab=VOCAB)
    model.config.image_token_id = image_id
    model.save_pretrained(str(hf))
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
    batch = hf_tiny.inputs(vocab=VOCAB, tiles=2)
    ids = batch["input_ids"]
    text = ids != VOCAB - 1
    ids[text & (ids == image_id)] = image_id + 1  # random text ids that happen to be the image token
    ids[~text] = image_id
    want = hf_tiny.hf_logits(tuned, batch)
    with cpu_compat.patched():
        try:
            initialize_distributed(torch.device("cpu"), 1, 1)
            got = chained_logits(HFSource.open(str(tmp_path / "out")), batch)
        finally:
            destroy()
    assert (got - want).abs().max() <= 1e-5
