"""The trainer's profiler with MoE layers (megatron/training/profiling.py, routing_profile.py): ``--omnibal-partition
auto`` at PP2 profiles the dense and MoE layers as their own unit kinds, measures the expert load of iteration 1's
micro-batches and trains. Oracles: the routers' own counts of that iteration (``--log-expert-load``, written by the
training run's hooks) and the imbalance recounted from them in closed form at every EP size; the partition's
predicted stage times recomputed from the written profile; the cost model and the planner priced at the recount."""
import dataclasses
import json
import re

import numpy as np
import pytest

from launch import run_training

E = 4
FLAGS = ["--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
         "--lr", "2e-3", "--log-interval", "1", "--seed", "7", "--eval-interval", "0",
         "--num-experts", str(E), "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
         "--moe-layer-freq", "[0,1,1,1]", "--moe-aux-loss-coeff", "0.01"]


def recount(tokens_per_expert, ep):
    """The busiest EP rank's tokens over the mean rank's, rank r holding experts r*E/EP .. (r+1)*E/EP - 1."""
    per = E // ep
    loads = [sum(tokens_per_expert[r * per:(r + 1) * per]) for r in range(ep)]
    return max(loads) / (sum(loads) / ep)


def test_the_profiled_copy_keeps_a_layer_of_each_kind():
    """The profiler's few-layer copy (``Family.few_layers`` at ``llm_layers_of_every_kind``): the leading decoder
    layers up to the first of each kind, their MoE rule cut to them (a dense prefix: a dense decoder)."""
    from megatron.training.profiling import llm_layers_of_every_kind
    from omnibal_ext.model.families import family_of
    from omnibal_ext.model.moe import MoESpec
    from omnibal_ext.model.units import build_units, get_preset

    for name in ("tiny", "qwen3-vl-30b-a3b"):
        base = get_preset(name)
        n = base.language.num_layers
        for freq, want in (((1,) * n, 1), ((0, 1) + (1,) * (n - 2), 2), ((1, 1, 0) + (1,) * (n - 3), 3)):
            moe = MoESpec(4, 2, 32, freq)
            spec = base.replace(language=dataclasses.replace(base.language, moe=moe))
            assert llm_layers_of_every_kind(spec) == want
            mini = family_of(spec).few_layers(spec, 1, want)
            assert mini.language.num_layers == want and mini.language.moe.layer_freq == freq[:want]
            kinds = [u.kind for u in build_units(mini) if u.code == "t"]
            assert set(kinds) == {u.kind for u in build_units(spec) if u.code == "t"}
        late = MoESpec(4, 2, 32, (0,) + (1,) * (n - 1))
        dense_prefix = base.replace(language=dataclasses.replace(base.language, moe=late))
        assert family_of(base).few_layers(dense_prefix, 1, 1).language.moe is None


@pytest.mark.slow
def test_partition_auto_pp2_profiles_moe_units_and_measures_the_expert_load(data_cache, tmp_path):
    from omnibal_ext.cli import measured_profile_imbalance
    from omnibal_ext.data.stats import from_arrays
    from omnibal_ext.memory.memory_model import GIB
    from omnibal_ext.model.cost_model import DEVICES, calibrated_costs
    from omnibal_ext.model.costs import CostTable
    from omnibal_ext.model.layout import parse_layout
    from omnibal_ext.model.moe import ExpertGrid
    from omnibal_ext.model.moe_cost import ExpertRun
    from omnibal_ext.model.partition import evaluate_layout
    from omnibal_ext.model.shape import MicroBatchShape
    from omnibal_ext.errors import UserError
    from omnibal_ext.model.units import get_preset, spec_from_dict
    from omnibal_ext.plan import PlanConfig, make_plan

    profile_path, load_path = tmp_path / "profile.json", tmp_path / "expert_load.jsonl"
    records, out = run_training(2, FLAGS + ["--data-cache-dir", str(data_cache), "--pipeline-model-parallel-size",
                                            "2", "--omnibal-partition", "auto", "--omnibal-profile",
                                            str(profile_path), "--log-expert-load", str(load_path)], tmp_path, "prof")
    assert len(records) == 3 and records[2]["lm loss"] < records[0]["lm loss"]
    profile = CostTable.load(str(profile_path))

    # MoE layers are their own unit kind, measured once for the kind; the dense layer is measured apart
    layers = {u.name: u for u in profile.units if u.name.startswith("llm.layer.")}
    assert [u.kind for u in layers.values()] == ["llm_layer", "llm_moe_layer", "llm_moe_layer", "llm_moe_layer"]
    moe_times = {(u.fwd_s, u.bwd_s) for u in layers.values() if u.kind == "llm_moe_layer"}
    assert len(moe_times) == 1 and moe_times != {(layers["llm.layer.0"].fwd_s, layers["llm.layer.0"].bwd_s)}
    assert all(u.fwd_s > 0 and u.bwd_s > 0 and u.act_bytes > 0 for u in layers.values())
    # the partition searched those costs: its printed stage times are the written profile's for its layout
    found = re.search(r"omnibal partition: layout (\S+); predicted stage times \(ms/micro-batch\) \[([^\]]+)\]", out)
    spec = spec_from_dict(profile.meta["spec"])
    report = evaluate_layout(profile, parse_layout(found.group(1), spec, 2), 2)
    printed = [float(x) for x in found.group(2).split(",")]
    assert printed == pytest.approx([t * 1e3 for t in report.stage_times_s], abs=0.006)

    # the expert load: the routers' counts of iteration 1 in the training run, recounted at every EP size
    logged = json.loads(load_path.read_text().splitlines()[0])
    assert logged["iteration"] == 1
    load = profile.meta["expert_load"]
    assert load["tokens_per_expert"] == {k: [float(x) for x in v] for k, v in logged["tokens_per_expert"].items()}
    assert sorted(load["tokens_per_expert"]) == ["1", "2", "3"]
    assert sorted(load["ep_imbalance"]) == ["1", "2", "4"]
    for ep in (1, 2, 4):
        want = {k: recount(v, ep) for k, v in logged["tokens_per_expert"].items()}
        assert load["ep_imbalance"][str(ep)]["per_layer"] == pytest.approx(want, rel=1e-12)
        assert load["ep_imbalance"][str(ep)]["overall"] == pytest.approx(np.mean(list(want.values())), rel=1e-12)
    f2 = float(np.mean([recount(v, 2) for v in logged["tokens_per_expert"].values()]))
    assert f2 > 1.0

    # the cost model at EP2 prices the MoE layers at the measured load: as the flag would, the experts' extra time
    # (f - 1) x their time at the mean; the dense units unchanged
    shape, dev = MicroBatchShape(2, 256, 2), DEVICES["h100-80g"]

    def costs(imbalance):
        return calibrated_costs(spec, shape, profile, device=dev, experts=ExpertRun(ExpertGrid(2, 1), imbalance))

    measured, flagged, mean, double = costs(None), costs(f2), costs(1.0), costs(2.0)
    assert [u.fwd_s for u in measured.units] == pytest.approx([u.fwd_s for u in flagged.units], rel=1e-12)
    for m, a, d in zip(measured.units, mean.units, double.units):
        assert m.fwd_s - a.fwd_s == pytest.approx((f2 - 1.0) * (d.fwd_s - a.fwd_s), rel=1e-9, abs=1e-18)
        assert (d.fwd_s > a.fwd_s) == (m.kind == "llm_moe_layer")

    # omnibal plan --moe-profile: the measured load at each EP, the plan of the flag at that load
    measured_by_ep = measured_profile_imbalance(str(profile_path), spec)
    with pytest.raises(UserError, match="--moe-profile .*: measured 4 experts, model 'qwen3-vl-30b-a3b' has 128"):
        measured_profile_imbalance(str(profile_path), get_preset("qwen3-vl-30b-a3b"))
    assert measured_by_ep == tuple((ep, load["ep_imbalance"][str(ep)]["overall"]) for ep in (1, 2, 4))
    rng = np.random.default_rng(0)
    stats = from_arrays(rng.integers(1, 4, 60), rng.integers(40, 300, 60))
    config = PlanConfig(spec, 2, 8 * GIB, global_batch_size=8, sim_iterations=1, isf_max_candidates=2, max_vpp=1,
                        ep=2, tp=1)
    by_profile = make_plan(stats, dataclasses.replace(config, measured_imbalance=measured_by_ep))
    by_flag = make_plan(stats, dataclasses.replace(config, moe_imbalance=f2))
    at_mean = make_plan(stats, config)
    assert by_profile.rows[-1].iteration_s == by_flag.rows[-1].iteration_s
    assert by_profile.rows[-1].iteration_s > at_mean.rows[-1].iteration_s
