"""Adaptive recompute planner: exactness against brute force, budgets, errors, flag syntax."""
import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnibal_ext.memory.memory_model import stage_memory, stage_time_s
from omnibal_ext.memory.recompute import (
    MemoryBudgetError,
    RecomputeFlagError,
    RecomputePlan,
    StageRecompute,
    evaluate_plan,
    format_recompute_plan,
    full_recompute_plan,
    no_recompute_plan,
    parse_recompute_plan,
    plan_recompute,
    validate_recompute_plan,
)
from omnibal_ext.model.costs import CostTable, UnitCost
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.units import PRESETS, build_units
from omnibal_ext.model.layout import default_layout


def make_table(nv, nl, rng):
    """A random table with integer bytes and integer seconds (sums are exact in float64)."""
    kinds = ["vit_embed"] + ["vit_layer"] * nv + ["projector", "llm_embed"] + ["llm_layer"] * nl + ["llm_head"]
    units = []
    for i, kind in enumerate(kinds):
        layer = kind.endswith("layer")
        act = int(rng.integers(50, 400))
        full = int(rng.integers(1, act // 4 + 2)) if layer else act
        sel = int(rng.integers(full, act + 1)) if layer else act
        units.append(UnitCost(f"u{i}", kind, float(rng.integers(1, 9)), float(rng.integers(1, 17)), act, full, sel,
                              float(rng.integers(0, 4)) if layer else 0.0, 1.0, int(rng.integers(0, 50))))
    return CostTable(tuple(units))


def all_stage_options(nv, nl):
    for vf, vs, lf, ls in itertools.product(range(nv + 1), (False, True), range(nl + 1), (False, True)):
        yield StageRecompute(vf, vs, lf, ls)


def brute_force(costs, layout, budget, pp, tp, dp, m):
    """Per stage: (best time, least peak) over every StageRecompute, evaluated one by one."""
    counts = [(sum(costs.units[i].kind == "vit_layer" for i in r), sum(costs.units[i].kind == "llm_layer" for i in r))
              for r in layout.stage_slices()]
    out = []
    for s, (nv, nl) in enumerate(counts):
        best, least = float("inf"), float("inf")
        for opt in all_stage_options(nv, nl):
            plan = [StageRecompute()] * pp
            plan[s] = opt
            peak = stage_memory(costs, layout, plan, pp, tp, dp, m)[s].peak_bytes
            least = min(least, peak)
            if peak <= budget:
                best = min(best, stage_time_s(costs, layout, plan)[s])
        out.append((best, least))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nv=st.integers(0, 3), nl=st.integers(1, 3), pp=st.integers(1, 3),
       m=st.integers(1, 4), dp=st.sampled_from([1, 2]), frac=st.floats(0.0, 1.0))
def test_planner_equals_brute_force(seed, nv, nl, pp, m, dp, frac):
    rng = np.random.default_rng(seed)
    costs = make_table(nv, nl, rng)
    n = len(costs.units)
    cuts = np.sort(rng.choice(np.arange(1, n), size=pp - 1, replace=False)) if pp > 1 else []
    layout = PipelineLayout(tuple(np.diff([0, *cuts, n]).tolist()))
    lo = max(m.peak_bytes for m in stage_memory(costs, layout, full_recompute_plan(layout, costs.units), pp, 1, dp, m))
    hi = max(m.peak_bytes for m in stage_memory(costs, layout, None, pp, 1, dp, m))
    budget = float(int(0.9 * lo + frac * (hi - 0.9 * lo)))
    truth = brute_force(costs, layout, budget, pp, 1, dp, m)
    infeasible = [s for s, (best, _) in enumerate(truth) if best == float("inf")]
    if infeasible:
        with pytest.raises(MemoryBudgetError) as err:
            plan_recompute(costs, layout, budget, pp, 1, dp, m)
        s = infeasible[0]
        assert err.value.stage == s
        assert err.value.need_bytes == truth[s][1]
        assert err.value.shortfall_bytes == truth[s][1] - budget
        return
    plan = plan_recompute(costs, layout, budget, pp, 1, dp, m)
    assert list(plan.stage_time_s) == pytest.approx([best for best, _ in truth])
    mem = stage_memory(costs, layout, plan.stages, pp, 1, dp, m)
    assert all(x.peak_bytes <= budget for x in mem)
    assert list(plan.stage_peak_bytes) == [x.peak_bytes for x in mem]
    assert list(plan.stage_static_bytes) == [x.static_bytes for x in mem]


def test_loose_budget_no_recompute_tight_budget_more():
    rng = np.random.default_rng(7)
    costs = make_table(6, 8, rng)
    layout = PipelineLayout((5, 6, 7))
    pp, tp, dp, m = 3, 1, 2, 6
    none = stage_memory(costs, layout, None, pp, tp, dp, m)
    loose = plan_recompute(costs, layout, 10 * max(x.peak_bytes for x in none), pp, tp, dp, m)
    assert list(loose.stages) == no_recompute_plan(layout)
    assert list(loose.stage_time_s) == pytest.approx(stage_time_s(costs, layout, None))
    full = stage_memory(costs, layout, full_recompute_plan(layout, costs.units), pp, tp, dp, m)
    lo, hi = max(x.peak_bytes for x in full), max(x.peak_bytes for x in none)
    previous_time = loose.bottleneck_s
    for budget in np.linspace(hi, lo, 6)[1:]:
        plan = plan_recompute(costs, layout, budget, pp, tp, dp, m)
        assert max(plan.stage_peak_bytes) <= budget
        assert plan.bottleneck_s >= previous_time - 1e-9  # less memory never makes it faster
        recomputed = sum(s.vit_full_layers + s.llm_full_layers + s.vit_selective + s.llm_selective
                         for s in plan.stages)
        assert recomputed > 0
        previous_time = plan.bottleneck_s
    tight = plan_recompute(costs, layout, lo, pp, tp, dp, m)
    assert tight.bottleneck_s > loose.bottleneck_s


def test_impossible_budget_names_stage_and_shortfall():
    rng = np.random.default_rng(3)
    costs = make_table(2, 4, rng)
    layout = PipelineLayout((4, 6))
    full = stage_memory(costs, layout, full_recompute_plan(layout, costs.units), 2, 1, 1, 4)
    budget = full[1].peak_bytes - 2**30  # one GiB short on stage 1 at least
    budget_per_stage = [full[0].peak_bytes * 10, budget]
    with pytest.raises(MemoryBudgetError, match=r"pipeline stage 1 needs .* short by 1\.\d\d GiB") as err:
        plan_recompute(costs, layout, budget_per_stage, 2, 1, 1, 4)
    assert err.value.stage == 1
    assert err.value.shortfall_bytes >= 2**30 - 1e-6


def test_full_and_no_recompute_plans():
    spec = PRESETS["tiny"]
    units = build_units(spec)
    layout = default_layout(spec, 2)
    full = full_recompute_plan(layout, units)
    assert full == [StageRecompute(4, False, 2, False), StageRecompute(0, False, 2, False)]
    validate_recompute_plan(full, layout, units)
    assert no_recompute_plan(layout) == [StageRecompute(), StageRecompute()]
    with pytest.raises(RecomputeFlagError, match="stage 1 fully recomputes 0 ViT / 3 LLM"):
        validate_recompute_plan([StageRecompute(), StageRecompute(llm_full_layers=3)], layout, units)


def test_flag_examples_and_errors():
    assert parse_recompute_plan("v2s,t3|t0s|-") == [
        StageRecompute(2, True, 3, False), StageRecompute(0, False, 0, True), StageRecompute()]
    assert parse_recompute_plan(" t1 , v0s ||") == [StageRecompute(0, True, 1, False), StageRecompute(),
                                                    StageRecompute()]
    for bad, msg in [("v2x", "cannot read 'v2x' in stage 0"), ("t1|t2,t3", "stage 1 gives 't' twice"),
                     ("q1", "cannot read")]:
        with pytest.raises(RecomputeFlagError, match=msg):
            parse_recompute_plan(bad)
    with pytest.raises(RecomputeFlagError, match="2 stages given"):
        parse_recompute_plan("v1|t1", num_stages=3)


@given(st.lists(st.builds(StageRecompute, st.integers(0, 60), st.booleans(), st.integers(0, 60), st.booleans()),
                min_size=1, max_size=8))
def test_flag_and_dict_round_trip(stages):
    assert parse_recompute_plan(format_recompute_plan(stages)) == stages
    assert [StageRecompute.from_dict(json.loads(json.dumps(s.to_dict()))) for s in stages] == stages


def test_plan_dict_round_trip():
    rng = np.random.default_rng(1)
    costs = make_table(2, 2, rng)
    layout = PipelineLayout((4, 4))
    plan = evaluate_plan(costs, layout, full_recompute_plan(layout, costs.units), 2, 1, 1, 2, 1e9)
    back = RecomputePlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    assert plan.to_dict()["flag"] == plan.to_flag() == "v2|t2"


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nv=st.integers(0, 2), nl=st.integers(1, 3), pp=st.integers(1, 3),
       m=st.integers(1, 3), frac=st.floats(0.0, 1.0))
def test_joint_layout_equals_brute_force_over_all_layouts(seed, nv, nl, pp, m, frac):
    from omnibal_ext.memory.recompute import joint_optimal_layout, plan_layout_and_recompute

    rng = np.random.default_rng(seed)
    costs = make_table(nv, nl, rng)
    n = len(costs.units)
    layouts = [PipelineLayout(tuple(np.diff([0, *cuts, n]).tolist()))
               for cuts in itertools.combinations(range(1, n), pp - 1)]
    needs = sorted(max(x.peak_bytes for x in stage_memory(costs, lay, full_recompute_plan(lay, costs.units),
                                                           pp, 1, 1, m)) for lay in layouts)
    budget = float(needs[int(frac * (len(needs) - 1))]) + float(rng.integers(0, 300))
    best = float("inf")
    for lay in layouts:
        try:
            best = min(best, plan_recompute(costs, lay, budget, pp, 1, 1, m).bottleneck_s)
        except MemoryBudgetError:
            pass
    assert best < float("inf")  # the budget is at least one layout's full-recompute need
    layout = joint_optimal_layout(costs, pp, budget, 1, 1, m)
    assert plan_recompute(costs, layout, budget, pp, 1, 1, m).bottleneck_s == pytest.approx(best)
    joint = plan_layout_and_recompute(costs, pp, budget, 1, 1, m, method="joint")
    assert joint.recompute.bottleneck_s == pytest.approx(best)
    searched = plan_layout_and_recompute(costs, pp, budget, 1, 1, m, method="searched", radius=1)
    assert searched.recompute.bottleneck_s >= best - 1e-9
    assert max(searched.recompute.stage_peak_bytes) <= budget
    assert sum(searched.layout.stage_units) == n and searched.layout.num_stages == pp
    assert [c[0] for c in joint.candidates][-1] == "joint-optimal"


def test_joint_raises_when_no_split_fits():
    from omnibal_ext.memory.recompute import joint_optimal_layout, plan_layout_and_recompute

    costs = make_table(1, 2, np.random.default_rng(0))
    with pytest.raises(MemoryBudgetError, match="no split of the 7 units into 2 pipeline stages"):
        joint_optimal_layout(costs, 2, 10.0, 1, 1, 2)
    with pytest.raises(MemoryBudgetError, match="no split of the 7 units into 2 pipeline stages"):
        plan_layout_and_recompute(costs, 2, 10.0, 1, 1, 2)
