"""Partition planners vs brute-force enumeration of contiguous splits."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.costs import CostTable, UnitCost
from omnibal_ext.model.layout import default_layout
from omnibal_ext.model.partition import (
    PartitionError, anchor_bounds, default_partition, optimal_counts, optimal_partition, param_counts_split,
    param_split, plan_partitions, search_counts, search_partition, stage_loads,
)
from omnibal_ext.model.units import build_units, get_preset


def all_splits(n, k):
    """Every split of n units into k non-empty contiguous parts, as counts."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0,) + cuts + (n,)
        yield tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


def brute_keys(w, send, counts, pp):
    loads = np.zeros(pp)
    ends = np.cumsum(counts)
    start = 0
    for c, e in enumerate(ends):
        loads[c % pp] += sum(w[start:e])
        start = e
    comm = sum(send[e - 1] for e in ends[:-1])
    return loads.max(), float((loads**2).sum()), comm


def lex_close(a, b):
    return all(x == pytest.approx(y, rel=1e-9, abs=1e-12) for x, y in zip(a, b))


weights = st.lists(st.integers(1, 9), min_size=2, max_size=10)


@settings(max_examples=150, deadline=None)
@given(w=weights, data=st.data())
def test_optimum_equals_brute_force(w, data):
    n = len(w)
    pp = data.draw(st.integers(1, min(n, 5)))
    send = np.asarray(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), float)
    w = np.asarray(w, float)
    counts, exact = optimal_counts(w, send, pp)
    assert exact and len(counts) == pp and all(c > 0 for c in counts) and sum(counts) == n
    best = min(brute_keys(w, send, c, pp) for c in all_splits(n, pp))
    assert lex_close(brute_keys(w, send, counts, pp), best)


@settings(max_examples=100, deadline=None)
@given(w=weights, data=st.data())
def test_search_equals_enumeration_of_its_window(w, data):
    n = len(w)
    pp = data.draw(st.integers(1, min(n, 5)))
    radius = data.draw(st.integers(0, 2))
    send = np.asarray(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), float)
    w = np.asarray(w, float)
    counts, _ = search_counts(w, send, pp, 1, radius)
    anchor = anchor_bounds(w, pp)
    cands = []
    for c in all_splits(n, pp):
        bounds = np.cumsum(c)[:-1]
        if all(abs(b - a) <= radius for b, a in zip(bounds, anchor)):
            cands.append(c)
    assert counts in cands
    best = min((brute_keys(w, send, c, pp)[1:], ) for c in cands)[0]  # (sum of squares, comm)
    assert lex_close(brute_keys(w, send, counts, pp)[1:], best)


def test_anchor_cuts_at_cumulative_fractions():
    w = np.ones(12)
    assert list(anchor_bounds(w, 4)) == [3, 6, 9]
    w = np.array([10.0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])  # total 20: first cut after the big unit
    assert list(anchor_bounds(w, 2)) == [1]


@settings(max_examples=60, deadline=None)
@given(w=st.lists(st.integers(1, 9), min_size=4, max_size=9), data=st.data())
def test_interleaved_search_and_optimum(w, data):
    n = len(w)
    pp, vpp = 2, 2
    send = np.zeros(n)
    w = np.asarray(w, float)
    counts, _ = search_counts(w, send, pp, vpp, radius=1)
    assert len(counts) == 4 and all(c > 0 for c in counts) and sum(counts) == n
    opt, exact = optimal_counts(w, send, pp, vpp, start=[counts])
    assert not exact
    brute = min(brute_keys(w, send, c, pp) for c in all_splits(n, pp * vpp))
    got = brute_keys(w, send, opt, pp)
    assert got[0] >= brute[0] - 1e-9  # no better than the true optimum ...
    assert got[0] <= brute_keys(w, send, counts, pp)[0] + 1e-9  # ... and no worse than the search
    # stage time = sum of chunks c % pp
    loads = stage_loads(w, opt, pp)
    assert loads.sum() == pytest.approx(w.sum())


def _costs(name="internvl-6b-20b"):
    spec = get_preset(name)
    return spec, analytic_costs(spec, MicroBatchShape(9, 4096))


LAYOUT_CASES = [("tiny", pp, vpp) for pp, vpp in [(1, 1), (2, 1), (4, 1)]] + [
    (name, pp, vpp) for name in ("internvl-6b-20b", "internvl-6b-34b")
    for pp, vpp in [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (4, 2), (2, 4)]]  # tiny has 4 LLM layers: 5 chunks at most


@pytest.mark.parametrize("name,pp,vpp", LAYOUT_CASES)
def test_layouts_cover_units_in_order(name, pp, vpp):
    spec, costs = _costs(name)
    n = len(build_units(spec))
    assert pp * vpp <= min(n, spec.language.num_layers + 1)
    reports = plan_partitions(spec, costs, pp, vpp=vpp, radius=1)
    for r in reports.values():
        counts = r.layout.stage_units
        assert len(counts) == pp * vpp and all(c > 0 for c in counts) and sum(counts) == n
        assert len(r.stage_times_s) == pp
        assert sum(r.stage_times_s) == pytest.approx(sum(u.fwd_s + u.bwd_s for u in costs.units))
        assert r.flag.count("|") == pp * vpp - 1
        assert r.gap_to_optimum >= -1e-9 or not reports["optimal"].exact
    if vpp == 1:
        assert reports["optimal"].bottleneck_s <= min(r.bottleneck_s for r in reports.values()) + 1e-12


def test_targets_from_notes():
    spec, costs = _costs()
    r4 = plan_partitions(spec, costs, 4)
    assert r4["default"].bottleneck_over_mean == pytest.approx(2.16, abs=0.02)
    assert r4["searched"].bottleneck_over_mean <= 1.03
    for pp, limit in ((8, 1.04), (16, 1.11)):
        r = plan_partitions(spec, costs, pp)
        assert r["optimal"].bottleneck_over_mean == pytest.approx(limit, abs=0.01)
        assert r["searched"].gap_to_optimum <= 0.01


def test_default_is_megatron_layout():
    spec, costs = _costs()
    assert default_partition(spec, costs, 4).layout == default_layout(spec, 4)


def test_param_split_minimises_largest_stage_params():
    spec, costs = _costs("tiny")
    params = np.asarray([u.param_count for u in costs.units], float)
    for pp in (2, 3, 4):
        got = param_counts_split(params, pp)
        best = min(stage_loads(params, c, pp).max() for c in all_splits(len(params), pp))
        assert stage_loads(params, got, pp).max() == best
        assert param_split(costs, pp).layout.stage_units == got


def test_stage_ok_hook_is_respected():
    spec, costs = _costs("tiny")
    n = len(costs.units)
    w = np.asarray([u.fwd_s + u.bwd_s for u in costs.units])
    limit = 4
    ok = lambda stage, rng: len(rng) <= limit  # noqa: E731
    opt = optimal_partition(costs, 3, stage_ok=ok)
    assert max(opt.layout.stage_units) <= limit
    best = min(brute_keys(w, np.zeros(n), c, 3)[0] for c in all_splits(n, 3) if max(c) <= limit)
    assert opt.bottleneck_s == pytest.approx(best)
    # with a radius covering every split, the search is the constrained brute-force (variance, comm) best
    srch = search_partition(costs, 3, radius=n, stage_ok=ok)
    assert max(srch.layout.stage_units) <= limit
    send = np.asarray([u.send_bytes for u in costs.units])
    best_sq = min(brute_keys(w, send, c, 3)[1:] for c in all_splits(n, 3) if max(c) <= limit)
    assert lex_close(brute_keys(w, send, srch.layout.stage_units, 3)[1:], best_sq)
    with pytest.raises(PartitionError, match="radius 0"):
        search_partition(costs, 3, radius=0, stage_ok=lambda s, r: len(r) != search_partition(costs, 3, radius=0).layout.stage_units[s])
    with pytest.raises(PartitionError):
        optimal_partition(costs, 3, stage_ok=lambda s, r: False)
    seen = []
    search_partition(costs, 2, vpp=2, radius=1, stage_ok=lambda s, r: seen.append(r) or True)
    assert seen and all(isinstance(r, tuple) and len(r) == 2 for r in seen)


def test_recompute_adds_time_and_cuts_bytes():
    spec, costs = _costs("tiny")
    base = optimal_partition(costs, 2)
    full = {u.name: "full" for u in costs.units if u.kind.endswith("layer")}
    rep = optimal_partition(costs, 2, recompute=full)
    extra = sum(u.fwd_s for u in costs.units if u.kind.endswith("layer"))
    assert sum(rep.stage_times_s) == pytest.approx(sum(base.stage_times_s) + extra)
    assert sum(rep.stage_act_bytes) < sum(base.stage_act_bytes)
    with pytest.raises(ValueError, match="recompute mode"):
        optimal_partition(costs, 2, recompute={"llm.layer.0": "half"})


def test_communication_breaks_ties():
    def table(ws, sends):
        return CostTable(tuple(UnitCost(f"u{i}", "llm_layer", w, 0.0, 0, 0, 0, 0, s, 1)
                               for i, (w, s) in enumerate(zip(ws, sends))))

    # cutting after unit 1 or after the zero-time unit 2 both give stages [2, 2]: the cheaper cut wins
    assert optimal_partition(table([1, 1, 0, 1, 1], [9, 9, 1, 9, 9]), 2).layout.stage_units == (3, 2)
    assert optimal_partition(table([1, 1, 0, 1, 1], [9, 1, 9, 9, 9]), 2).layout.stage_units == (2, 3)
    assert search_partition(table([1, 1, 0, 1, 1], [9, 9, 1, 9, 9]), 2, radius=1).layout.stage_units == (3, 2)


def test_too_many_stages_is_a_clear_error():
    spec, costs = _costs("tiny")
    with pytest.raises(PartitionError, match="only"):
        optimal_partition(costs, 40)
