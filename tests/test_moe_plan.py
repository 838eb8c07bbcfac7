"""MoE planning side: the MoE description (layer rules against the rules written out), the cost model's FLOPs
against a closed-form count and against torch's FLOP counter on megatron-core's MoELayer with the routing it chose,
the memory model's MoE activations against the tensors that layer saves, and the static bytes of experts split over
EP x ETP against a hand count."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from omnibal_ext.errors import UserError
from omnibal_ext.memory.memory_model import MIXED_BF16_ADAM, stage_memory
from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.moe import (ExpertGrid, MoESpec, expert_grid_problem, expert_grids, layer_freq_from_every,
                                   layer_freq_from_qwen, parse_layer_freq)
from omnibal_ext.model.moe_cost import ExpertRun, MoELayerCost, moe_act_bytes, moe_act_bytes_per_rank, moe_mlp_flops
from omnibal_ext.model.spec import LanguageSpec
from omnibal_ext.model.units import build_units, get_preset, unit_components, spec_from_dict


# --- the MoE description -------------------------------------------------------------------------------------
def test_qwen_rule_converter():
    # Qwen: layer i has experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    for n, step, dense in ((8, 1, ()), (8, 2, ()), (9, 3, (2,)), (6, 1, (0, 5)), (5, 4, ())):
        want = []
        for i in range(n):
            want.append(1 if (i + 1) % step == 0 and i not in dense else 0)
        assert list(layer_freq_from_qwen(n, step, dense)) == want
    assert layer_freq_from_qwen(4, 2, [1]) == (0, 0, 0, 1)
    with pytest.raises(UserError, match="mlp_only_layers"):
        layer_freq_from_qwen(4, 1, [4])
    with pytest.raises(UserError, match="decoder_sparse_step"):
        layer_freq_from_qwen(4, 0)


def test_megatron_integer_converter_and_both_flag_forms():
    # megatron-core's integer moe_layer_freq N: layer i has experts when i % N == 0
    for n, every in ((8, 1), (8, 2), (7, 3), (3, 5)):
        assert list(layer_freq_from_every(n, every)) == [1 if i % every == 0 else 0 for i in range(n)]
    assert parse_layer_freq("2", 4) == (1, 0, 1, 0)
    assert parse_layer_freq("[1,0,0,1]", 4) == (1, 0, 0, 1)
    assert parse_layer_freq(3, 4) == (1, 0, 0, 1)
    with pytest.raises(UserError, match="--moe-layer-freq .* 3 entries for 4"):
        parse_layer_freq("[1,0,1]", 4)
    with pytest.raises(UserError, match="--moe-layer-freq"):
        parse_layer_freq("[1,2,1,1]", 4)


@pytest.mark.parametrize("field,value,match", [
    ("num_experts", 0, "MoESpec.num_experts"), ("topk", 9, "MoESpec.topk 9 exceeds"),
    ("ffn_hidden_size", 1.5, "MoESpec.ffn_hidden_size"), ("score_function", "relu", "MoESpec.score_function"),
    ("load_balancing_type", "sinkhorn", "MoESpec.load_balancing_type"),
    ("capacity_factor", 0.0, "MoESpec.capacity_factor"), ("layer_freq", (0, 0), "no MoE layer"),
    ("layer_freq", (1, 2), "MoESpec.layer_freq"), ("shared_expert_gate", True, "shared_expert_gate"),
    ("shared_expert_ffn_hidden_size", -1, "shared_expert_ffn_hidden_size")])
def test_moe_spec_refuses_bad_fields_naming_them(field, value, match):
    good = dict(num_experts=8, topk=2, ffn_hidden_size=16, layer_freq=(1, 1))
    with pytest.raises(UserError, match=match):
        MoESpec(**{**good, field: value})


def test_language_spec_holds_moe_and_round_trips():
    moe = MoESpec(8, 2, 16, (1, 0, 1))
    with pytest.raises(UserError, match="layer_freq has 3 entries for the decoder's 4 layers"):
        LanguageSpec(4, 32, 4, 64, moe=moe)
    spec = tiny_moe_spec()
    assert spec_from_dict(spec.to_dict()) == spec  # the JSON form (a plan's, a profile's) reads back
    kinds = [u.kind for u in build_units(spec) if u.code == "t"]
    assert kinds == ["llm_moe_layer", "llm_layer", "llm_moe_layer", "llm_moe_layer"]


# --- a tiny MoE model and its closed-form FLOPs --------------------------------------------------------------
E, K, H, F, FS = 6, 2, 16, 24, 20  # experts, top-k, hidden, expert FFN, shared expert FFN (H != 2F)


def tiny_moe_spec(shared: int = 0, gate: bool = False, cf=None, freq=(1, 0, 1, 1)):
    base = get_preset("tiny")
    lm = dataclasses.replace(base.language, num_layers=len(freq), hidden_size=H, num_attention_heads=2,
                             num_query_groups=1, ffn_hidden_size=40, head_dim=None,
                             moe=MoESpec(E, K, F, tuple(freq), shared_expert_ffn_hidden_size=shared,
                                         shared_expert_gate=gate, capacity_factor=cf))
    return base.replace(name="tiny-moe", language=lm)


def test_moe_layer_flops_equal_the_closed_form_count_of_routed_tokens():
    spec = tiny_moe_spec(shared=FS, gate=True)
    T, lens = 30, (10, 20)
    shape = MicroBatchShape(2, T, 2, llm_attn_tokens_sq=float(sum(x * x for x in lens)))
    comps = unit_components(spec)
    moe = next(c for c in comps if c.kind == "llm_moe_layer")
    dense = next(c for c in comps if c.kind == "llm_layer")
    d, heads, groups = H // 2, 2, 1
    attention = (2 * T * H * (heads * d + 2 * groups * d) + 2 * T * heads * d * H
                 + 4 * heads * d * 0.5 * sum(x * x for x in lens))
    routed = T * K  # no dropping: every token through top-k experts
    want = (attention + 2 * T * H * E  # router
            + routed * (2 * H * 2 * F + 2 * F * H)  # experts: gate+up (H -> 2F), down (F -> H)
            + T * (2 * H * 2 * FS + 2 * FS * H) + 2 * T * H)  # shared expert and its sigmoid gate H -> 1
    assert moe.flops(shape, 1)[0] == pytest.approx(want, rel=1e-12)
    assert dense.flops(shape, 1)[0] == pytest.approx(attention + 6 * T * H * 40, rel=1e-12)
    # the busiest EP rank's time: experts' work times the imbalance, the rest as it is
    slow = moe.with_experts(ExpertRun(ExpertGrid(2, 1), imbalance=1.5))
    assert slow.rank_work(shape, 1) == pytest.approx(want + 0.5 * routed * 6 * H * F, rel=1e-12)
    assert slow.flops(shape, 1) == moe.flops(shape, 1)
    # params: attention + norms as the dense layer, router E x H, experts, shared expert and gate
    dense_mlp = 3 * H * 40
    assert moe.params(1) == dense.params(1) - dense_mlp + E * H + E * 3 * H * F + 3 * H * FS + H
    assert moe.expert_params() == E * 3 * H * F


def test_capacity_factor_caps_the_routed_tokens():
    spec = tiny_moe_spec(cf=0.5)
    T = 30
    cap = math.ceil(0.5 * T * K / E)  # per expert
    assert moe_mlp_flops(spec, T) == 2 * T * H * E + E * cap * 6 * H * F


def test_alltoall_time_and_bytes_at_the_ep_size():
    spec = tiny_moe_spec()
    shape = MicroBatchShape(2, 64, 2)
    dev = DEVICES["h100-80g"]
    base = analytic_costs(spec, shape, 1, dev, experts=ExpertRun(ExpertGrid(1, 1)))
    for ep, rate in ((2, dev.tp_bytes_per_s), (4, dev.tp_bytes_per_s)):
        c = analytic_costs(spec, shape, 1, dev, experts=ExpertRun(ExpertGrid(ep, 1)))
        a2a = 2 * 64 * K * H * 2 * (ep - 1) / ep / rate  # dispatch + combine, each tokens x topk x H x D
        # the local experts' weights: E / EP of them read forward (D bytes each), read again with the fp32 gradient
        # read and written backward (D + 8)
        fewer = E * 3 * H * F * (1 / ep - 1) / dev.mem_bytes_per_s
        for u0, u in zip(base.units, c.units):
            moe = u.kind == "llm_moe_layer"
            assert u.fwd_s - u0.fwd_s == pytest.approx(a2a + 2 * fewer if moe else 0.0, rel=1e-9, abs=1e-18)
            assert u.bwd_s - u0.bwd_s == pytest.approx(a2a + 10 * fewer if moe else 0.0, rel=1e-9, abs=1e-18)
    # an EP group wider than a node goes at the inter-node rate
    wide = dataclasses.replace(spec, language=dataclasses.replace(
        spec.language, moe=dataclasses.replace(spec.language.moe, num_experts=16)))
    c1 = analytic_costs(wide, shape, 1, dev, experts=ExpertRun(ExpertGrid(1, 1)))
    c16 = analytic_costs(wide, shape, 1, dev, experts=ExpertRun(ExpertGrid(16, 1)))
    i = next(j for j, u in enumerate(c1.units) if u.kind == "llm_moe_layer")
    want = 2 * 64 * K * H * 2 * 15 / 16 / dev.p2p_bytes_per_s + 16 * 3 * H * F * 2 * (1 / 16 - 1) / dev.mem_bytes_per_s
    assert c16.units[i].fwd_s - c1.units[i].fwd_s == pytest.approx(want, rel=1e-9)


# --- static bytes: experts over EP x ETP, their optimizer state over expert DP --------------------------------
def test_expert_static_bytes_by_hand():
    spec = tiny_moe_spec()
    shape = MicroBatchShape(2, 64, 2)
    tp, dp, ep, etp = 2, 4, 4, 1  # 8 ranks per stage: expert DP = 2 * 4 / (4 * 1) = 2
    costs = analytic_costs(spec, shape, tp, DEVICES["h100-80g"], experts=ExpertRun(ExpertGrid(ep, etp)),
                           sequence_parallel=True)
    layout = PipelineLayout((len(costs.units),))
    mem = stage_memory(costs, layout, None, 1, tp, dp, 1, precision=MIXED_BF16_ADAM)[0]
    total = sum(u.param_count for u in costs.units)
    experts = sum(u.expert_params for u in costs.units)
    assert experts == 3 * E * 3 * H * F  # three MoE layers
    edp = tp * dp // (ep * etp)
    want = ((total - experts) / tp * (2 + 4 + 12 / dp)  # dense: bf16 + fp32 grad, Adam sharded over DP
            + experts / (ep * etp) * (2 + 4 + 12 / edp))  # experts: per EP x ETP rank, Adam over expert DP
    assert mem.static_bytes == pytest.approx(want, rel=1e-12)
    assert mem.param_count == pytest.approx((total - experts) / tp + experts / (ep * etp), rel=1e-12)


# --- the expert grid: megatron-core's rule, brute force ------------------------------------------------------
def test_expert_grids_follow_megatron_cores_rule():
    moe = MoESpec(8, 2, 16, (1,))
    for tp in (1, 2, 4):
        for cp in (1, 2):
            for dp in (1, 2, 3, 4):
                grids, _ = expert_grids(moe, tp, cp, dp)
                # parallel_state.initialize_model_parallel: world % (ETP x EP x PP) == 0, i.e. ETP x EP divides
                # TP x CP x DP; MoELayer: experts % EP == 0; ETP tried at 1 and TP
                want = {(ep, etp) for ep in range(1, 9) for etp in {1, tp}
                        if 8 % ep == 0 and (tp * cp * dp) % (ep * etp) == 0}
                assert {(g.ep, g.etp) for g in grids} == want, (tp, cp, dp)
    assert "does not divide the 8 experts" in expert_grid_problem(moe, ExpertGrid(3, 1), 1, 1, 6)
    assert expert_grids(None, 2, 1, 4)[0] == [ExpertGrid(1, 1)]


# --- against megatron-core's MoELayer (world of one, SequentialMLP, as tests/moe_cpu_probe.py builds it) -------
T_MC = 40


@pytest.fixture
def mcore_world(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from megatron.training import cpu_compat

    with cpu_compat.patched():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()
        try:
            yield torch
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def run_moe_layer(torch, capacity_factor=None):
    """Forward of a tiny MoELayer (top-2 of 6 softmax, SwiGLU experts H=16, F=24, fp32) on 40 tokens: the FLOPs
    torch counts, the bytes autograd saves (each storage once, parameters excluded) and the tokens each expert
    ran (from the router's routing map, after any dropping)."""
    import torch.nn.functional as tF
    from torch.utils.flop_counter import FlopCounterMode
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    drop = {} if capacity_factor is None else {"moe_expert_capacity_factor": capacity_factor,
                                               "moe_token_drop_policy": "probs"}
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
        moe_ffn_hidden_size=F, ffn_hidden_size=F, moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
        activation_func=tF.silu, add_bias_linear=False, use_cpu_initialization=True,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_router_pre_softmax=False,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, moe_permute_fusion=False, **drop)
    layer = build_module(get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False).submodules.mlp,
                         config=config)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)  # an uneven routing
    maps = []
    layer.router.register_forward_hook(lambda m, i, out: maps.append(out[1].detach().clone()))
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    x = torch.randn(T_MC, 1, H, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    counted = counter.get_total_flops()
    x2 = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x2)
    out.sum().backward()
    per_expert = maps[-1].sum(0).numpy()
    return counted, float(sum(saved.values())), per_expert


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_flops_and_activations_against_megatron_core_moe_layer(mcore_world, capacity_factor):
    counted, saved, per_expert = run_moe_layer(mcore_world, capacity_factor)
    spec = tiny_moe_spec(cf=capacity_factor)
    routed = float(per_expert.sum())
    if capacity_factor is None:
        assert routed == T_MC * K
    else:
        assert routed <= E * math.ceil(capacity_factor * T_MC * K / E)
    # FLOPs: torch's count of the layer's matmuls equals the cost model's at the routing the router chose
    assert counted == pytest.approx(moe_mlp_flops(spec, T_MC, routed), rel=1e-9)
    if capacity_factor is None:
        assert counted == pytest.approx(moe_mlp_flops(spec, T_MC), rel=1e-9)  # no drop: T x top-k
    # activations: the layer's input (the dense layer's fc1 input, counted there) plus the MoE part
    inp = T_MC * H * 4
    for ep in (1, 2, 3):
        # the busiest EP rank's load from the measured per-expert counts (each EP rank holds E / EP experts)
        loads = per_expert.reshape(ep, E // ep).sum(1)
        imbalance = float(loads.max() / loads.mean()) if capacity_factor is None else None
        measured_run = ExpertRun(ExpertGrid(ep, 1), imbalance if capacity_factor is None else None)
        worst_run = ExpertRun(ExpertGrid(ep, 1))
        model_measured = moe_act_bytes_per_rank(spec, measured_run, T_MC / ep, 4, 1)
        model_worst = moe_act_bytes_per_rank(spec, worst_run, T_MC / ep, 4, 1)
        assert model_worst >= model_measured * (1 - 1e-9)
        if ep == 1:  # one rank: the layer measured here
            if capacity_factor is None:
                assert inp + model_measured == pytest.approx(saved, rel=0.05)
                assert inp + model_worst == pytest.approx(saved, rel=0.05)  # one rank: the worst case is exact
            else:  # the capacity bound holds; the measured count within 5%
                assert inp + model_worst >= saved
                assert inp + moe_act_bytes(spec, T_MC, routed, 4) == pytest.approx(saved, rel=0.05)


# --- omnibal plan with experts -------------------------------------------------------------------------------
def qwen3_30b_a3b_vlm():
    """InternVL3.5-30B-A3B's shape: InternViT-300M (the internvl3-2b preset's) and the Qwen3-30B-A3B text model as
    published (config.json: 48 layers, hidden 2048, 32 heads, 4 key-value heads, head_dim 128, 128 experts, top-8,
    moe_intermediate_size 768, vocab 151936, decoder_sparse_step 1, no mlp_only_layers, norm_topk_prob true)."""
    base = get_preset("internvl3-2b")
    lm = LanguageSpec(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, head_dim=128,
                      ffn_hidden_size=6144, vocab_size=151936, rotary_base=1000000, norm_eps=1e-6,
                      moe=MoESpec(128, 8, 768, layer_freq_from_qwen(48, 1, ())))
    return base.replace(name="qwen3-30b-a3b-vlm", language=lm)


def vlm_stats(n=1200, seed=4):
    from omnibal_ext.data.stats import from_arrays

    rng = np.random.default_rng(seed)
    tiles = np.where(rng.random(n) < 0.15, 0, rng.integers(1, 7, n))
    return from_arrays(tiles, rng.integers(30, 900, n) + 256 * tiles)


def test_plan_searches_the_expert_grid_by_brute_force():
    """A small grid: every (TP, PP, DP, EP, ETP) megatron-core allows is screened, and the plan is the fastest."""
    from omnibal_ext.memory.memory_model import GIB
    from omnibal_ext.plan import PlanConfig, make_plan

    spec = tiny_moe_spec(freq=(1, 1, 0, 1))
    plan = make_plan(vlm_stats(200, 1), PlanConfig(spec, 4, 4 * GIB, global_batch_size=32, sim_iterations=1,
                                                  isf_max_candidates=2, max_vpp=1))
    screened = {(r["tp"], r["pp"], r["dp"], r["ep"], r["etp"]) for r in plan.configs_tried if "least_need_bytes" in r}
    want = set()
    n_units = len(build_units(spec))
    for tp in (1, 2, 4):
        if spec.language.num_attention_heads % tp or spec.language.kv_groups % tp:  # the trainer's TP rule
            continue
        for pp in (1, 2, 4):
            dp = 4 // (tp * pp)
            if tp * pp * dp != 4 or pp > n_units:
                continue
            for ep in range(1, E + 1):
                for etp in {1, tp}:
                    if E % ep == 0 and (tp * dp) % (ep * etp) == 0:
                        want.add((tp, pp, dp, ep, etp))
    assert screened == want
    usable = [r for r in plan.configs_tried if r.get("fits") and "estimated_seconds_per_sample" in r]
    best = min(usable, key=lambda r: r["estimated_seconds_per_sample"])
    assert (plan.tp, plan.pp, plan.dp, plan.ep, plan.etp) == (best["tp"], best["pp"], best["dp"], best["ep"],
                                                              best["etp"])
    flags = plan.trainer_flags
    assert flags["--expert-model-parallel-size"] == plan.ep and flags["--expert-tensor-parallel-size"] == plan.etp
    assert flags["--num-experts"] == E and flags["--moe-router-topk"] == K and flags["--moe-ffn-hidden-size"] == F
    assert flags["--moe-layer-freq"] == "[1,1,0,1]"
    with pytest.raises(UserError, match="--ep 4 does not divide the model's 6 experts"):
        make_plan(vlm_stats(50, 1), PlanConfig(spec, 4, 4 * GIB, ep=4))
    with pytest.raises(UserError, match="--ep 2: model 'tiny' has no experts"):
        make_plan(vlm_stats(50, 1), PlanConfig("tiny", 4, 4 * GIB, ep=2))


@pytest.mark.slow
@pytest.mark.parametrize("gpus,batch,tp", [(64, 512, None), (256, 2048, 2)])  # 256: TP fixed, for time (~1 min)
def test_plan_qwen3_30b_a3b_chooses_expert_parallelism(gpus, batch, tp):
    from omnibal_ext.memory.memory_model import GIB
    from omnibal_ext.plan import PlanConfig, format_plan, make_plan

    plan = make_plan(vlm_stats(), PlanConfig(qwen3_30b_a3b_vlm(), gpus, 80 * GIB, device="h100-80g", tp=tp,
                                             global_batch_size=batch, sim_iterations=2, isf_max_candidates=4))
    print(format_plan(plan))
    assert plan.ep > 1
    assert [r.setting for r in plan.rows] == ["baseline", "+data", "+model", "+memory"]
    assert all(r.fits_memory for r in plan.rows[1:])
    assert plan.rows[-1].gpu_days <= plan.rows[0].gpu_days
    assert plan.trainer_flags["--expert-model-parallel-size"] == plan.ep
    assert (plan.tp * plan.dp * plan.cp) % (plan.ep * plan.etp) == 0


def test_imbalance_from_the_flag_or_the_profile():
    from omnibal_ext.model.cost_model import calibrated_costs

    spec = tiny_moe_spec()
    shape = MicroBatchShape(2, 64, 2)
    dev = DEVICES["h100-80g"]
    mean = analytic_costs(spec, shape, 1, dev, experts=ExpertRun(ExpertGrid(2, 1)))
    slow = analytic_costs(spec, shape, 1, dev, experts=ExpertRun(ExpertGrid(2, 1), imbalance=2.0))
    moe = [i for i, u in enumerate(mean.units) if u.kind == "llm_moe_layer"]
    experts_s = 64 * K * 6 * H * F / (dev.matmul_flops_per_s * MoELayerCost.efficiency)
    for i, (a, b) in enumerate(zip(mean.units, slow.units)):
        assert b.fwd_s - a.fwd_s == pytest.approx(experts_s if i in moe else 0.0, rel=1e-9, abs=1e-18)
    # a profile that measured the load: its imbalance is the default of the costs calibrated on it
    profile = dataclasses.replace(slow, meta={**slow.meta, "moe_imbalance": 2.0})
    cal = calibrated_costs(spec, shape, profile, 1, device=dev, experts=ExpertRun(ExpertGrid(2, 1)))
    assert cal.meta["moe_imbalance"] == 2.0
    with pytest.raises(UserError, match="--moe-imbalance must be >= 1"):
        ExpertRun(ExpertGrid(2, 1), imbalance=0.5)
