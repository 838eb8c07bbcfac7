"""--sequence-parallel without launching: the flag's check, the collate's padding, the cost model and the plan."""
import pytest
import torch

from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.units import get_preset


@pytest.mark.parametrize("flags", [["--sequence-parallel"],
                                   ["--sequence-parallel", "--tensor-model-parallel-size", "2",
                                    "--attention-backend", "unfused"]], ids=["tp1", "unfused"])
def test_flag_needs_tp_and_the_torch_layers(flags):
    from megatron.training.arguments import parse_flags
    from megatron.training.flags import ArgumentError

    with pytest.raises(ArgumentError, match="--sequence-parallel needs --tensor-model-parallel-size > 1"):
        parse_flags(flags, 2)
    assert parse_flags(["--sequence-parallel", "--tensor-model-parallel-size", "2"], 2).sequence_parallel


def test_collate_pads_rows_to_a_multiple_of_tp():
    from megatron.vlm.data.collate import collate_packed, collate_padded

    samples = [{"input_ids": list(range(n)), "labels": [1] * n, "image_flags": torch.zeros(0, dtype=torch.long)}
               for n in (5, 8)]
    padded = collate_padded(samples, pad_id=0, pad_to_multiple=4)
    assert padded["tokens"].shape == (2, 8)
    assert padded["cu_seqlens"].tolist() == [0, 5, 8, 16]  # row 0's pads are a segment of their own
    assert (padded["labels"][0, 5:] == -100).all()
    packed = collate_packed(samples, pad_id=0, pad_to_multiple=2)
    assert packed["tokens"].shape == (1, 14) and packed["cu_seqlens"].tolist() == [0, 5, 13, 14]


def test_cost_model_splits_the_replicated_part_and_pads_tokens():
    spec = get_preset("internvl-6b-20b")
    shape = MicroBatchShape(vision_items=9, llm_tokens=4097, dtype_bytes=2)
    for tp in (2, 4):
        plain = {u.kind: u for u in analytic_costs(spec, shape, tp, attention="flash").units}
        sp = {u.kind: u for u in analytic_costs(spec, shape, tp, attention="flash", sequence_parallel=True).units}
        for kind in ("vit_layer", "llm_layer", "llm_head"):
            assert sp[kind].act_bytes < plain[kind].act_bytes
        # the ViT layer: 4 h D replicated bytes per token and its two RMSNorms' fp32 1/rms split by TP, each tile
        # padded 1025 -> a multiple of TP
        v, D = spec.vision, 2
        seq = -(-v.seq_per_tile // tp) * tp
        per_tok_plain = plain["vit_layer"].act_bytes / (9 * v.seq_per_tile)
        per_tok_sp = sp["vit_layer"].act_bytes / (9 * seq)
        assert per_tok_plain - per_tok_sp == pytest.approx((4 * v.hidden_size * D + 2 * 4) * (1 - 1 / tp))
        assert sp["vit_layer"].act_bytes_full == pytest.approx(9 * seq * v.hidden_size * D / tp)
        # at TP 1 the flag changes nothing
    one = analytic_costs(spec, shape, 1, sequence_parallel=True)
    assert one.units == analytic_costs(spec, shape, 1).units


def test_plan_emits_sequence_parallel_with_tp():
    from omnibal_ext.data.isf import ISFParams
    from omnibal_ext.plan.trainer_flags import plan_trainer_flags, trainer_argv

    for tp in (1, 2, 4):
        argv = trainer_argv(plan_trainer_flags("internvl-6b-20b", tp, 4, "x", "-", ISFParams(1, 1, 1, 1), 4, 64, True))
        assert ("--sequence-parallel" in argv) == (tp > 1)
