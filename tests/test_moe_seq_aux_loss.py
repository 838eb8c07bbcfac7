"""seq_aux_loss per packed sample, padding excluded (megatron/vlm/layers/moe.py MaskedTopKRouter): the logged loss and its
gradient against the formula written out here per sample (DeepSeek-V2's sequence-wise balance loss, megatron-core's
per-sequence seq_aux_loss) from the routing probabilities, for a THD row of several samples and padding and for
padded rows; padding tokens change nothing."""
import pytest
import torch

E, K, H, COEFF = 6, 2, 8, 0.1


def make_router(score_function="softmax"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.vlm.layers.moe import MaskedTopKRouter

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                               moe_router_topk=K, moe_ffn_hidden_size=16, use_cpu_initialization=True,
                               moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=COEFF,
                               moe_router_score_function=score_function, moe_router_dtype="fp32",
                               moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    router = MaskedTopKRouter(config, ProcessGroupCollection.use_mpu_process_groups())
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(5)))
    router.set_layer_number(1)
    return router.train()


def closed_form(logits: torch.Tensor, segments: torch.Tensor, score_function: str) -> torch.Tensor:
    """Mean over the samples s of E / (K T_s^2) * sum_e (sum_{x in s} score(x, e)) (tokens of s routed to e), the
    top K by score, T_s the tokens of s; logits [tokens, E], segments [tokens] (-1 padding)."""
    losses = []
    for s in sorted(set(segments.tolist()) - {-1}):
        x = logits[segments == s]
        scores = torch.softmax(x, -1) if score_function == "softmax" else torch.sigmoid(x)
        if score_function == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True)
        routed = torch.zeros_like(scores).scatter(1, scores.topk(K, dim=-1).indices, 1.0)
        t = len(x)
        losses.append(E / (K * t * t) * (scores.sum(0) * routed.sum(0)).sum())
    return torch.stack(losses).mean()


def run(router, hidden: torch.Tensor, segment_ids: torch.Tensor):
    """The router on hidden [sequence, rows, H] with the token mask of segment_ids [rows, sequence] (as
    MoELayer hands it over: first two axes transposed): (logged seq aux loss, router weight gradient)."""
    from megatron.core.transformer.moe import moe_utils

    from megatron.vlm.layers.moe import token_mask

    moe_utils.clear_aux_losses_tracker()
    router.zero_grad()
    mask = token_mask(segment_ids).transpose(0, 1).bool()
    probs, _ = router(hidden, padding_mask=mask)
    (probs * 0).sum().backward()  # only the attached aux loss sends a gradient
    logged = moe_utils.get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"]["values"][0]
    return float(logged), router.weight.grad.clone()


def want(router, hidden, segment_ids, score_function):
    w = router.weight.detach().clone().requires_grad_()
    logits = hidden.transpose(0, 1).reshape(-1, H) @ w.t()  # rows first, as the segment ids
    loss = closed_form(logits, segment_ids.reshape(-1), score_function)
    (COEFF * loss).backward()
    return float(loss.detach()), w.grad


# one THD row: samples of 3, 5 and 2 tokens, then 2 padding; two padded rows of 4 and 6 tokens
LAYOUTS = {"thd": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, -1, -1]]),
           "rows": torch.tensor([[0, 0, 0, 0, -1, -1], [1, 1, 1, 1, 1, 1]])}


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_seq_aux_loss_per_packed_sample_equals_closed_form(megatron_world, layout, score_function):
    segment_ids = LAYOUTS[layout]
    rows, seq = segment_ids.shape
    router = make_router(score_function)
    hidden = torch.randn(seq, rows, H, generator=torch.Generator().manual_seed(1))
    got, grad = run(router, hidden, segment_ids)
    loss, grad_want = want(router, hidden, segment_ids, score_function)
    assert got == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(grad, grad_want, rtol=1e-5, atol=1e-7)
    # not megatron-core's seq_aux_loss (each row one sequence, its padding counted)
    whole_rows = torch.arange(rows).reshape(rows, 1).expand(rows, seq)
    assert abs(closed_form(hidden.transpose(0, 1).reshape(-1, H) @ router.weight.detach().t(),
                           whole_rows.reshape(-1), score_function) - loss) > 1e-3
    # padding tokens change nothing
    pad = (segment_ids < 0).transpose(0, 1)
    other = hidden.clone()
    other[pad] = torch.randn(int(pad.sum()), H)
    got_other, grad_other = run(router, other, segment_ids)
    assert got_other == pytest.approx(got, rel=1e-6)
    torch.testing.assert_close(grad_other, grad, rtol=1e-6, atol=1e-8)


def test_router_without_sample_membership_refuses_seq_aux_loss(megatron_world):
    router = make_router()
    with pytest.raises(ValueError, match="token_mask"):
        router(torch.randn(4, 1, H), padding_mask=torch.zeros(4, 1, dtype=torch.bool))
