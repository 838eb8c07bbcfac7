"""Our Gated DeltaNet at TP 2 (two gloo ranks: the worker pool of 2), without and with sequence parallelism, against
TP 1 in this process: outputs, input gradients and every weight gradient (norm weight: summed over TP); the
bytes a rank saves against the closed form; the checkpoint's global tensors (sharded_state_dict) equal TP 1's."""
import pytest
import torch

import gdn_cases
import pool

pytestmark = pytest.mark.slow


def test_tp2_and_sequence_parallel_equal_tp1(megatron_world, tmp_path):
    from megatron.vlm.families.qwen3_5.gated_delta_net_hf import OUR_NAMES, ours_to_hf
    from omnibal_ext.model.linear_attention import LinearAttentionShape, linear_attention_act_bytes

    run = pool.run_case("gated_delta_net_tp2_worker:main", [str(tmp_path)], 2, tmp_path)
    assert run.returncode == 0, run.output[-6000:]
    tp2 = torch.load(tmp_path / "tp2.pt", weights_only=False)

    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(gdn_cases.hf_layer(seed=2)), chunk_size=5)
    x, cu, seed_w = gdn_cases.packed_input()
    x.requires_grad_()
    out, _ = layer(x, packed_seq_params=gdn_cases.thd_params(cu))
    (out * seed_w).sum().backward()
    grads = ours_to_hf([{n: p.grad for n, p in layer.named_parameters() if n in OUR_NAMES}], layer.dims)
    checkpoint = gdn_cases.assemble(gdn_cases.checkpoint_pieces(layer))
    assert sorted(checkpoint) == sorted(f"gdn.{n}" for n in (
        *(f"in_proj.weight.{p}" for p in "qkvzba"), *(f"conv1d.weight.{p}" for p in "qkv"), "A_log", "dt_bias",
        "out_norm.weight", "out_proj.weight"))
    for sp in (False, True):
        got = tp2[sp]
        assert got["checkpoint"].keys() == checkpoint.keys()
        for key, t in checkpoint.items():  # the same global tensors at TP 2: a checkpoint loads at either
            assert torch.equal(got["checkpoint"][key], t), key
        torch.testing.assert_close(got["out"], out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["x_grad"], x.grad, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-5, msg=f"sp={sp} {name}")
        for g in got["norm_grads"]:  # summed over TP on both ranks
            torch.testing.assert_close(g, grads["norm.weight"], rtol=1e-5, atol=1e-5)
        shape = LinearAttentionShape(gdn_cases.HIDDEN, gdn_cases.KEY_HEADS, gdn_cases.KEY_DIM, gdn_cases.VALUE_HEADS,
                                     gdn_cases.VALUE_DIM, gdn_cases.KERNEL)
        assert got["saved_bytes"] == linear_attention_act_bytes(shape, gdn_cases.LENGTHS, tp=2, sequence_parallel=sp,
                                                                dtype_bytes=4).total
