"""The closed-form cost of a Gated DeltaNet layer (omnibal_ext/model/linear_attention.py) against the layer itself:
torch's FLOP counter on its forward (matmuls and the conv) and the bytes autograd saves (ActivationMeter)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import gdn_cases
from omnibal_ext.errors import UserError
from omnibal_ext.model.linear_attention import (
    LinearAttentionShape,
    linear_attention_act_bytes,
    linear_attention_flops,
    linear_attention_flops_per_token,
)

SHAPE = LinearAttentionShape(gdn_cases.HIDDEN, gdn_cases.KEY_HEADS, gdn_cases.KEY_DIM, gdn_cases.VALUE_HEADS,
                             gdn_cases.VALUE_DIM, gdn_cases.KERNEL)


def _measure(layer, lengths, dtype=torch.float32):
    from megatron.training.memory import ActivationMeter

    x, cu, _ = gdn_cases.packed_input(lengths)
    x = x.to(dtype).requires_grad_()
    meter = ActivationMeter(layer)
    with FlopCounterMode(display=False) as counter, meter.measure():
        out, _ = layer(x, packed_seq_params=gdn_cases.thd_params(cu))
    out.float().sum().backward()  # the saved tensors were used
    return counter.get_total_flops(), meter.per_microbatch[0]


@pytest.mark.parametrize("lengths,chunk", [((7, 1, 12, 6), 5), ((7, 1, 12, 6), 64), ((16,), 4), ((3, 9), 2)])
def test_flops_and_saved_bytes_match_the_layer(megatron_world, lengths, chunk):
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(gdn_cases.hf_layer()), chunk_size=chunk)
    flops, saved = _measure(layer, lengths)
    assert linear_attention_flops(SHAPE, lengths, chunk).matmul == flops
    assert linear_attention_act_bytes(SHAPE, lengths, dtype_bytes=4).total == saved


def test_saved_bytes_in_bf16(megatron_world):
    layer = gdn_cases.our_layer(gdn_cases.hf_tensors(gdn_cases.hf_layer()), chunk_size=5).to(torch.bfloat16)
    _, saved = _measure(layer, (7, 1, 12, 6), torch.bfloat16)
    assert linear_attention_act_bytes(SHAPE, (7, 1, 12, 6), dtype_bytes=2).total == saved


def test_per_token_flops_is_the_limit_of_long_segments():
    long = linear_attention_flops(SHAPE, (64 * 50,), 64)
    per_token = linear_attention_flops_per_token(SHAPE, 64)
    assert long.matmul / (64 * 50) == pytest.approx(per_token, rel=1e-3)
    # linear in tokens: twice the samples, twice the FLOPs and bytes
    one, two = (linear_attention_flops(SHAPE, lens, 8).total for lens in ((40, 24), (40, 24, 40, 24)))
    assert two == pytest.approx(2 * one, rel=1e-2)
    assert linear_attention_act_bytes(SHAPE, (40, 24, 40, 24)).total == pytest.approx(
        2 * linear_attention_act_bytes(SHAPE, (40, 24)).total, rel=1e-2)


def test_bad_sizes_are_refused():
    with pytest.raises(UserError, match="must divide linear_num_key_heads"):
        linear_attention_act_bytes(SHAPE, (8,), tp=4)
    with pytest.raises(UserError, match="chunk must be >= 1"):
        linear_attention_flops(SHAPE, (8,), 0)
    with pytest.raises(UserError, match="multiple of TP"):
        linear_attention_act_bytes(SHAPE, (7,), tp=2, sequence_parallel=True)
