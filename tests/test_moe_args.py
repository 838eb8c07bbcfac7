"""MoE flags of the built-in models: parsed into the model's MoESpec and the run's MoERun, refused at parse time
naming the flag (the expert grid by brute force over its definition), and the router options against top-k
routing written out in torch (HF's norm_topk_prob both ways)."""
import pytest
import torch

from megatron.training.arguments import parse_flags
from megatron.training.flags import ArgumentError
from megatron.training.specs import model_spec_of, moe_run_of
from omnibal_ext.model.units import build_units

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "96"]


def test_flags_make_the_spec_and_the_run():
    args = parse_flags(MOE + ["--moe-layer-freq", "[1,0,1,1]", "--expert-model-parallel-size", "2",
                             "--moe-aux-loss-coeff", "0.01"], world_size=2)
    moe = model_spec_of(args).language.moe
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.layer_freq) == (4, 2, 96, (1, 0, 1, 1))
    assert moe.norm_topk_prob and moe.score_function == "softmax"
    kinds = [u.kind for u in build_units(model_spec_of(args)) if u.code == "t"]
    assert kinds == ["llm_moe_layer", "llm_layer", "llm_moe_layer", "llm_moe_layer"]
    run = moe_run_of(args)
    assert (run.ep, run.etp, run.aux_loss_coeff, run.dispatcher) == (2, 1, 0.01, "alltoall")
    every_other = model_spec_of(parse_flags(MOE + ["--moe-layer-freq", "2"])).language.moe.layer_freq
    assert every_other == (1, 0, 1, 0)  # megatron-core's integer form: layer i when i % N == 0
    assert model_spec_of(parse_flags([])).language.moe is None and moe_run_of(parse_flags([])) is None


@pytest.mark.parametrize("argv,world,flag", [
    (["--moe-router-topk", "3"], 1, "--moe-router-topk"),  # an MoE flag without --num-experts
    (MOE + ["--moe-router-topk", "5"], 1, "--moe-router-topk"),
    (MOE + ["--moe-layer-freq", "[1,0]"], 1, "--moe-layer-freq"),
    (MOE + ["--moe-layer-freq", "[0,0,0,0]"], 1, "--moe-layer-freq"),
    (MOE + ["--moe-router-enable-expert-bias"], 1, "--moe-router-enable-expert-bias"),  # needs sigmoid
    (MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"], 1, "--moe-router-pre-softmax"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2, "--sequence-parallel"),
    (MOE + ["--lora-rank", "4"], 1, "--lora-targets"),  # the default targets adapt the MLP: experts take none
    (["--num-experts", "4", "--model", "qwen2.5-vl-tiny"], 1, "--num-experts"),  # a family without MoE layers
])
def test_refused_naming_the_flag(argv, world, flag):
    with pytest.raises(ArgumentError, match=flag):
        parse_flags(argv, world_size=world)


@pytest.mark.parametrize("argv,world,ep", [
    (MOE + ["--context-parallel-size", "2"], 2, 1),
    (MOE + ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"], 2, 2),  # EP from DP x CP
    (MOE + ["--context-parallel-size", "2", "--expert-model-parallel-size", "4"], 4, 4),
])
def test_context_parallel_accepted(argv, world, ep):
    assert moe_run_of(parse_flags(argv, world_size=world)).ep == ep


@pytest.mark.parametrize("world,tp,pp,experts", [(2, 1, 1, 4), (4, 1, 2, 4), (4, 2, 1, 4), (8, 1, 1, 6), (4, 1, 1, 6)])
def test_expert_grid_against_its_definition(world, tp, pp, experts):
    """Every (EP, ETP) up to the world: accepted exactly when EP divides the experts and ETP x EP divides
    world / PP (expert DP = world / (ETP x EP x PP) whole), and ETP the expert FFN width; the flag is named."""
    for ep in range(1, world + 1):
        for etp in range(1, world + 1):
            ok = experts % ep == 0 and (world // pp) % (ep * etp) == 0 and 96 % etp == 0
            argv = ["--num-experts", str(experts), "--moe-ffn-hidden-size", "96", "--expert-model-parallel-size",
                    str(ep), "--expert-tensor-parallel-size", str(etp), "--tensor-model-parallel-size", str(tp),
                    "--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(4 * 4 * world)]
            argv += ["--sequence-parallel"] if tp > 1 else []
            if ok:
                parse_flags(argv, world_size=world)
            else:
                with pytest.raises(ArgumentError, match="--expert-(model|tensor)-parallel-size"):
                    parse_flags(argv, world_size=world)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_options_route_as_written_out(norm_topk_prob):
    """megatron-core's top-k routing under the options our config maps norm_topk_prob to: softmax over all experts,
    the top k, renormalised over them exactly when norm_topk_prob (transformers' Qwen3-MoE router, written out)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from megatron.vlm.layers.moe import MoERun, config_fields
    from omnibal_ext.model.moe import MoESpec

    moe = MoESpec(num_experts=6, topk=2, ffn_hidden_size=8, layer_freq=(1,), norm_topk_prob=norm_topk_prob)
    f = config_fields(moe, MoERun(), 1)
    logits = torch.randn(11, 6, generator=torch.Generator().manual_seed(3))
    probs, routing_map = topk_routing_with_score_function(
        logits, 2, use_pre_softmax=f["moe_router_pre_softmax"], scaling_factor=f["moe_router_topk_scaling_factor"],
        score_function=f["moe_router_score_function"])
    p = torch.softmax(logits, dim=-1)
    top, idx = p.topk(2, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    want = torch.zeros_like(p).scatter(1, idx, top)
    assert torch.equal(routing_map, want > 0)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-7)
