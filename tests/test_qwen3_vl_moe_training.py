"""Training a tiny Hugging Face Qwen3-VL-MoE (``hf_tiny_qwen3_vl.make_tiny_moe``: top-2 of 6 experts, LLM layer 1 of 3
dense, DeepStack into layers 0 and 1; with ``hf_tiny_qwen``'s tokenizer) from --hf-checkpoint on ``messages`` JSONL
with small colour photos (slow): at EP2 the serial run's losses, gradient norms and aux loss within 1e-4 for three
iterations; a PP2 x EP2 fine-tune under ISF packing whose loss falls, exported by `omnibal hf export` and loaded by
transformers' ``Qwen3VLMoeForConditionalGeneration`` with the logits of our model on the exported folder."""
import pytest
import torch

from launch import run_training

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_tiny_qwen3_vl  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 1e-4
EP2 = ["--expert-model-parallel-size", "2"]


def make_moe_with_tokenizer(folder, seed):
    """``folder`` with the tiny tokenizer, image settings and a tiny perturbed Qwen3-VL-MoE pointing at its tokens;
    returns (the model (eval, fp32, eager), the special tokens' ids)."""
    import hf_tiny_qwen

    folder.mkdir()
    ids = hf_tiny_qwen.write_tokenizer(folder)
    hf_tiny_qwen3_vl.write_preprocessor(folder)
    model = hf_tiny_qwen3_vl.make_tiny_moe(folder, seed=seed)
    hf_tiny_qwen.set_token_ids(model, ids)
    model.save_pretrained(str(folder))
    return model, ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_vl_moe_training")
    model, ids = make_moe_with_tokenizer(folder / "hf", seed=3)
    return folder, model, ids, hf_tiny_qwen3_vl.write_messages_data(folder)


def test_ep2_equals_the_serial_run(checkpoint, data_cache, serial_run, shared_runs):
    folder, _, _, data = checkpoint
    flags = ["--hf-checkpoint", str(folder / "hf"), "--data-path", data, "--train-iters", "3", "--micro-batch-size",
             "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "0", "--eval-interval", "0",
             "--seq-length", "256", "--data-cache-dir", str(data_cache), "--seed", "5", "--moe-aux-loss-coeff", "0.01"]
    serial = serial_run(flags)
    records, out, _ = shared_runs.run(2, flags + EP2)
    assert "loaded weights from --hf-checkpoint" in out
    assert [r["iteration"] for r in records] == [r["iteration"] for r in serial] == [1, 2, 3]
    for got, want in zip(records, serial):
        for key in ("lm loss", "grad norm", "moe aux loss"):
            assert abs(got[key] - want[key]) <= TOL * abs(want[key]), (key, got, want)
        assert got["expert load imbalance"] == pytest.approx(want["expert load imbalance"], rel=1e-6)
    assert records[2]["lm loss"] < records[0]["lm loss"]


def test_pp2_ep2_isf_finetune_then_export_loads_in_transformers(checkpoint, data_cache, tmp_path):
    from transformers import Qwen3VLMoeForConditionalGeneration

    import hf_tiny
    from omnibal_cli import main as omnibal

    folder, model, ids, data = checkpoint
    flags = ["--hf-checkpoint", str(folder / "hf"), "--data-path", data, "--pipeline-model-parallel-size", "2",
             "--pipeline-layout", "Iv*2|v*2PEt*3L", "--omnibal-isf", "--train-iters", "12", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--eval-interval", "0",
             "--seq-length", "256", "--data-cache-dir", str(data_cache), "--save", str(tmp_path / "ckpt"),
             "--seed", "5", "--moe-aux-loss-coeff", "0.01"] + EP2
    records, out = run_training(4, flags, tmp_path, "qwen3_vl_moe_finetune")
    assert "loaded weights from --hf-checkpoint" in out and "> ISF:" in out
    losses = [r["lm loss"] for r in records]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses

    assert omnibal(["hf", "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    tuned = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    for name in ("model.language_model.layers.0.mlp.experts.gate_up_proj",
                 "model.language_model.layers.2.mlp.gate.weight", "model.visual.blocks.0.attn.qkv.weight"):
        assert not torch.equal(tuned.get_parameter(name), model.get_parameter(name)), name
    hf_tiny_qwen3_vl.eager(tuned)
    batch = hf_tiny_qwen3_vl.inputs_with_token_ids(ids)
    want = hf_tiny_qwen3_vl.hf_logits(tuned, batch)
    assert (hf_tiny.our_logits(tmp_path / "out", batch) - want).abs().max() <= 1e-5
