"""Our Gated DeltaNet at TP 2 (two gloo ranks under torchrun), without and with sequence parallelism, against
TP 1 in this process: outputs, input gradients and every weight gradient (norm weight: summed over TP); the
bytes a rank saves against the closed form; the checkpoint's global tensors (sharded_state_dict) equal TP 1's."""
import os
import subprocess
import sys

import pytest
import torch

import gdn_cases
from launch import benchlib

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


def test_tp2_and_sequence_parallel_equal_tp1(megatron_world, tmp_path):
    from megatron.vlm.gated_delta_net_hf import OUR_NAMES, ours_to_hf
    from omnibal_ext.model.linear_attention import LinearAttentionShape, linear_attention_act_bytes

    env = benchlib.trainer_env()
    env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(benchlib.free_port()), os.path.join(HERE, "gated_delta_net_tp2_worker.py"),
           str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
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
