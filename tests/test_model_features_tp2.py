"""TP 2 (two gloo ranks: the worker pool of 2) against TP 1 in this process: qk-norm over padded ViT heads
(3 heads -> 4), a Qwen3 decoder layer (per-head q/k norm: output, input and norm-weight gradients) and the
vocabulary-padded loss."""
import pytest
import torch

import pool
from test_model_features import copy_real_rows, digits_batch

pytestmark = pytest.mark.slow


def test_tp2_qk_norm_with_padded_heads_and_vocab_padding_equal_tp1(megatron_world, tmp_path):  # noqa: F811
    import tp2_cases

    from omnibal_ext.model.units import get_preset

    batch, real = digits_batch(tmp_path, get_preset("tiny"))
    torch.save(batch, tmp_path / "batch.pt")
    run = pool.run_case("tp2_features_worker:main", [str(tmp_path)], 2, tmp_path)
    assert run.returncode == 0, run.output[-6000:]
    tp2 = torch.load(tmp_path / "tp2.pt", weights_only=False)

    layer, x, seed, _ = tp2_cases.vit_layer_and_input(tp=1)
    out = tp2_cases.run_vit(layer, x, seed)
    torch.testing.assert_close(tp2["out"], out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2["x_grad"], x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2["q_grad"], layer.self_attention.q_layernorm.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2["k_grad"], layer.self_attention.k_layernorm.weight.grad, rtol=1e-5, atol=1e-5)

    layer, rope, x, seed = tp2_cases.qwen3_layer_and_input(tp=1)  # Qwen3: per-head q/k norm gradients summed over TP
    out = tp2_cases.run_qwen3(layer, rope, x, seed)
    attn = layer.self_attention
    for key, want in (("out", out.detach()), ("x_grad", x.grad), ("q_grad", attn.q_layernorm.weight.grad),
                      ("k_grad", attn.k_layernorm.weight.grad)):
        torch.testing.assert_close(tp2["qwen3"][key], want, rtol=1e-5, atol=1e-5, msg=key)

    padded = tp2_cases.tiny_model(tp=1, real_vocab=True)
    unpadded = tp2_cases.tiny_model(tp=1, real_vocab=False, vocab_size=real)
    copy_real_rows(padded, unpadded)
    with torch.no_grad():
        want, want_correct = unpadded.eval()(batch)
    answer = batch.text.labels != -100
    torch.testing.assert_close(tp2["loss"][answer], want[answer], rtol=1e-5, atol=1e-5)
    assert torch.equal(tp2["correct"][answer], want_correct[answer])
