"""The Gated DeltaNet's choice of delta-rule kernel and its glue to fla's varlen kernel, on the CPU: ``pick_backend``'s
table; the layer with backend ``fla`` calling a stand-in for fla's ``chunk_gated_delta_rule`` (the gated delta rule
token by token over each ``cu_seqlens`` segment: an oracle independent of our chunked rule) gives the torch
backend's outputs and input gradients on a packed row; scripts/gpu_check.py's fla check skips with its reason
without CUDA or without fla (the GPU run compares the real kernel: its ``fla_delta_rule``)."""
import sys

import pytest
import torch

import gdn_cases
from launch import ROOT


def test_pick_backend():
    from megatron.vlm.layers.delta_rule import pick_backend

    assert pick_backend("auto", True, True) == "fla"  # the trainer's default on a GPU with fla installed
    assert pick_backend("auto", False, True) == "torch"  # CPU tensors
    assert pick_backend("auto", True, False) == "torch"  # fla not installed
    assert pick_backend("torch", True, True) == "torch"
    assert pick_backend("fla", False, True) == "fla"  # asked for: fla decides where it runs
    with pytest.raises(RuntimeError, match="flash-linear-attention does not import"):
        pick_backend("fla", True, False)
    with pytest.raises(ValueError, match="backend must be one of"):
        pick_backend("triton", True, True)


def _recurrent_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel):
    """fla's contract ([1, t, heads, dim] inputs, value heads a multiple of the query heads), token by token:
    S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T (scale q), the state zero at each segment's start."""
    assert q.shape[0] == 1 and initial_state is None and not output_final_state and not use_qk_l2norm_in_kernel
    assert cu_seqlens.dtype == torch.long and int(cu_seqlens[-1]) == q.shape[1] and g.dtype == torch.float32
    ratio = v.shape[2] // q.shape[2]
    q, k = q[0].repeat_interleave(ratio, 1).float(), k[0].repeat_interleave(ratio, 1).float()
    v, g, beta = v[0].float(), g[0], beta[0].float()
    out = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        state = q.new_zeros(v.shape[1], q.shape[2], v.shape[2])
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            write = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
            state = state + k[t][:, :, None] * write[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", state, scale * q[t]))
    return torch.stack(out)[None], None


def test_fla_backend_glue_equals_the_torch_rule(megatron_world, monkeypatch):
    from megatron.core.transformer.spec_utils import build_module

    from megatron.vlm.layers import delta_rule
    from megatron.vlm.layers.gated_delta_net import gated_delta_net_spec

    calls = []

    def stand_in(**kw):
        calls.append(kw["cu_seqlens"].tolist())
        return _recurrent_rule(**kw)

    monkeypatch.setattr(delta_rule, "_fla_chunk_gated_delta_rule", stand_in)
    ref = gdn_cases.our_layer(gdn_cases.hf_tensors(gdn_cases.hf_layer(seed=5)), chunk_size=4)  # backend torch
    fla = build_module(gated_delta_net_spec(chunk_size=4, backend="fla"), config=gdn_cases.our_config(),
                       layer_number=1)
    fla.load_state_dict(ref.state_dict())
    x, cu, seed_w = gdn_cases.packed_input()
    results = []
    for layer in (fla, ref):
        xs = x.clone().requires_grad_()
        out = layer(xs, packed_seq_params=gdn_cases.thd_params(cu))[0]
        (out * seed_w).sum().backward()
        results.append((out.detach(), xs.grad))
    assert calls == [cu.tolist()]  # the fla layer called the kernel once, over the row's segments; torch never
    assert results[1][0].abs().max() > 0.1
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gpu_check_fla_skips_with_its_reason(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    no_cuda = gpu_check.check_fla_delta_rule(tmp_path, False, 0.0)
    assert no_cuda["status"] == "skipped" and "no CUDA device" in no_cuda["reason"]
    if gpu_check.fla_import_error() is not None:  # this machine: no fla; a CUDA machine without it skips too
        no_fla = gpu_check.check_fla_delta_rule(tmp_path, True, 0.0)
        assert no_fla["status"] == "skipped" and "flash-linear-attention (fla) does not import" in no_fla["reason"]
    assert "fla_delta_rule" in gpu_check.CHECKS and "fla_delta_rule" in gpu_check.TIMEOUTS
