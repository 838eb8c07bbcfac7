"""The recipes with MoE decoder layers (issue: "--freeze-llm freezes experts and router; the loss reductions and drop
path are unchanged"): which parameters train when the LLM is frozen, the optimizer's groups, the expert bias
refused with a frozen LLM, and (slow) a run with a per-sample loss reduction and ViT drop path at EP2 against the
single-process run."""
import dataclasses

import pytest
import torch

from megatron.training.arguments import parse_config, parse_flags
from megatron.training.flags import ArgumentError

from test_moe_training import BASE, assert_close, column

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "[1,0,1,1]"]


def test_freeze_llm_freezes_experts_and_router(megatron_world):
    from megatron.training import setup, training

    config = parse_config(MOE + ["--freeze-llm", "--train-iters", "2"])
    plan = setup.build_run_plan(config, config.model.spec, torch.device("cpu"))
    model = training.build_model(plan, 5, torch.device("cpu"))
    optimizer, _ = training.build_optimizer(plan, model)
    named = dict(model[0].module.named_parameters())
    experts = [n for n in named if ".mlp.experts." in n]
    routers = [n for n in named if ".mlp.router." in n]
    assert len(experts) == 3 * 4 * 2 and len(routers) == 3  # 3 MoE layers x 4 experts x (fc1, fc2); a router each
    assert not any(named[n].requires_grad for n in experts + routers)
    assert all(not p.requires_grad for n, p in named.items() if p.vlm_role in "EtL")
    trained = {id(p) for p in named.values() if p.requires_grad}
    assert trained and {p.vlm_role for p in named.values() if p.requires_grad} == set("IvP")
    groups = getattr(optimizer, "chained_optimizers", [optimizer])
    assert {id(p) for opt in groups for g in opt.param_groups for p in g["params"]} == trained


def test_expert_bias_with_a_frozen_llm_is_refused():
    with pytest.raises(ArgumentError, match="--moe-router-enable-expert-bias with --freeze-llm"):
        parse_flags(MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                          "--freeze-llm"])


@pytest.mark.slow
def test_sample_loss_and_drop_path_at_ep2_equal_serial(data_cache, serial_run, shared_runs):
    """--loss-reduction sample and --vision-drop-path-rate with MoE layers: EP2 (two DP ranks, experts split) gives
    the serial run's losses, gradient norms and aux loss (the drop path's masks are keyed per image, so every layout
    drops the same ones)."""
    flags = BASE + ["--data-cache-dir", str(data_cache), "--loss-reduction", "sample",
                    "--vision-drop-path-rate", "0.2"]
    serial = serial_run(flags)
    records, _, _ = shared_runs.run(2, flags + ["--expert-model-parallel-size", "2"])
    for key, rel in (("lm loss", 1e-4), ("grad norm", 1e-3), ("moe aux loss", 1e-4)):
        assert_close(column(records, key), column(serial, key), rel)
    assert records[-1]["lm loss"] < records[0]["lm loss"]
