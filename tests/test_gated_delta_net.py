"""Our Gated DeltaNet (megatron/vlm/layers/gated_delta_net.py, delta_rule.py) against transformers' Qwen3_5GatedDeltaNet
(fp32, its torch delta rule), sample by sample: transformers' torch path ignores cu_seqlens."""
import pytest
import torch

import gdn_cases
from gdn_cases import LENGTHS

TOL = dict(rtol=1e-5, atol=1e-5)


def _assert_grad_close(got, want, name):
    """fp32 weight gradients summed over tokens in another order: atol relative to the gradient's largest entry."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())), msg=name)


def _hf_grads(hf, lengths, x, seed_w):
    """transformers' outputs and input/weight gradients, running each sample of the packed row on its own."""
    outs, grads = [], {n: torch.zeros_like(p) for n, p in hf.named_parameters()}
    x_grads = []
    start = 0
    for n in lengths:
        hf.zero_grad()
        xs = x[start:start + n, 0].unsqueeze(0).clone().requires_grad_()
        out = hf(xs)
        (out[0] * seed_w[start:start + n, 0]).sum().backward()
        outs.append(out[0].detach())
        x_grads.append(xs.grad[0])
        for name, p in hf.named_parameters():
            grads[name] += p.grad
        start += n
    return torch.cat(outs), torch.cat(x_grads), grads


def _ours(layer, x, cu, seed_w):
    x = x.clone().requires_grad_()
    out, bias = layer(x, attention_mask=None, packed_seq_params=gdn_cases.thd_params(cu))
    assert bias is None and out.shape == x.shape
    (out * seed_w).sum().backward()
    return out.detach()[:, 0], x.grad[:, 0]


def _our_grads_as_hf(layer):
    from megatron.vlm.families.qwen3_5.gated_delta_net_hf import OUR_NAMES, ours_to_hf

    grads = {n: p.grad for n, p in layer.named_parameters()}
    return ours_to_hf([{n: grads[n] for n in OUR_NAMES}], layer.dims)


def test_one_sample_equals_transformers(megatron_world):
    hf = gdn_cases.hf_layer()
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(hf), chunk_size=64)
    x, cu, seed_w = gdn_cases.packed_input(lengths=(19,))
    want, want_dx, want_grads = _hf_grads(hf, (19,), x, seed_w)
    got, got_dx = _ours(layer, x, cu, seed_w)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_dx, want_dx, **TOL)
    for name, g in _our_grads_as_hf(layer).items():
        _assert_grad_close(g, want_grads[name], name)


@pytest.mark.parametrize("chunk", [3, 5, 64])  # chunks that divide no sample length (3: 12 and 6 are multiples)
def test_packed_row_equals_samples_one_by_one(megatron_world, chunk):
    hf = gdn_cases.hf_layer(seed=2)
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(hf), chunk_size=chunk)
    x, cu, seed_w = gdn_cases.packed_input()
    want, want_dx, want_grads = _hf_grads(hf, LENGTHS, x, seed_w)
    got, got_dx = _ours(layer, x, cu, seed_w)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_dx, want_dx, **TOL)
    for name, g in _our_grads_as_hf(layer).items():
        assert g.abs().max() > 0, name
        _assert_grad_close(g, want_grads[name], name)


def test_state_and_conv_reset_at_boundaries(megatron_world):
    """Changing one sample's tokens changes no other sample's outputs (the oracle alone cannot show a leak in
    a sample whose predecessor is short: a packed run without resets differs from the samples run apart)."""
    hf = gdn_cases.hf_layer(seed=3)
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(hf), chunk_size=4)
    x, cu, _ = gdn_cases.packed_input()
    params = gdn_cases.thd_params(cu)
    with torch.no_grad():
        base = layer(x, packed_seq_params=params)[0]
        y = x.clone()
        y[7:8] += 1.0  # the one-token sample
        moved = layer(y, packed_seq_params=params)[0]
        whole = layer(x, packed_seq_params=gdn_cases.thd_params(torch.tensor([0, 26], dtype=torch.int32)))[0]
    changed = (moved - base).abs().amax(dim=(1, 2)) > 0
    assert changed.tolist() == [i == 7 for i in range(26)]
    assert (whole[8:] - base[8:]).abs().max() > 1e-3  # one segment: the later samples see the earlier ones


def test_unpacked_batch_runs_each_sequence_alone(megatron_world):
    hf = gdn_cases.hf_layer(seed=4)
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(hf), chunk_size=4)
    x = torch.randn(9, 2, gdn_cases.HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = layer(x)[0]
        want = hf(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(got, want, **TOL)


def test_hf_mapping_round_trip_is_bit_exact():
    from omnibal_ext.model.linear_attention import LinearAttentionShape
    from megatron.vlm.families.qwen3_5.gated_delta_net_hf import hf_to_ours, ours_to_hf

    dims = LinearAttentionShape(gdn_cases.HIDDEN, 2, 8, 4, 6, 4)
    hf = gdn_cases.hf_tensors(gdn_cases.hf_layer())
    for tp in (1, 2):
        back = ours_to_hf([hf_to_ours(hf, dims, r, tp) for r in range(tp)], dims)
        assert back.keys() == hf.keys()
        for name in hf:
            assert torch.equal(back[name], hf[name]), (tp, name)
    rank1 = hf_to_ours(hf, dims, 1, 2)  # rank 1 holds key head 1 and value heads 2, 3
    assert torch.equal(rank1["in_proj.weight"][:8], hf["in_proj_qkv.weight"][8:16])
    assert torch.equal(rank1["A_log"], hf["A_log"][2:])


def test_tp_must_divide_key_heads(megatron_world):
    from omnibal_ext.model.linear_attention import LinearAttentionShape
    from omnibal_ext.errors import UserError

    with pytest.raises(UserError, match=r"\(4\) must divide linear_num_key_heads \(2\)"):
        LinearAttentionShape(24, 2, 8, 4, 6, 4).check_tp(4)
    with pytest.raises(UserError, match="multiple of linear_num_key_heads"):
        LinearAttentionShape(24, 2, 8, 3, 6, 4).check_tp(1)


def test_context_parallel_is_refused(megatron_world):
    from megatron.core.transformer.spec_utils import build_module

    from megatron.vlm.layers.gated_delta_net import gated_delta_net_spec
    from omnibal_ext.errors import UserError

    cfg = gdn_cases.our_config(context_parallel_size=2)
    with pytest.raises(UserError, match="context parallelism"):
        build_module(gated_delta_net_spec(), config=cfg, layer_number=1)


def test_checkpoint_parts_are_the_hf_blocks(megatron_world):
    hf = gdn_cases.hf_tensors(gdn_cases.hf_layer())
    checkpoint = gdn_cases.assemble(gdn_cases.checkpoint_pieces(gdn_cases.our_layer(hf)))
    q, k, v = torch.split(hf["in_proj_qkv.weight"], [16, 16, 24])
    cq, ck, cv = torch.split(hf["conv1d.weight"], [16, 16, 24])
    want = {"in_proj.weight.q": q, "in_proj.weight.k": k, "in_proj.weight.v": v,
            "in_proj.weight.z": hf["in_proj_z.weight"], "in_proj.weight.b": hf["in_proj_b.weight"],
            "in_proj.weight.a": hf["in_proj_a.weight"],
            "conv1d.weight.q": cq, "conv1d.weight.k": ck, "conv1d.weight.v": cv, "A_log": hf["A_log"],
            "dt_bias": hf["dt_bias"], "out_norm.weight": hf["norm.weight"], "out_proj.weight": hf["out_proj.weight"]}
    assert sorted(checkpoint) == sorted(f"gdn.{n}" for n in want)
    for name, t in want.items():
        assert torch.equal(checkpoint[f"gdn.{name}"], t), name
