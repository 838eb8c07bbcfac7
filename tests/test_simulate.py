"""Pipeline simulator vs closed forms and the schedule's own rules."""
import numpy as np
import pytest

from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs
from omnibal_ext.model.layout import default_layout
from omnibal_ext.model.simulate import (
    allreduce_seconds, layout_stage_costs, schedule_order, simulate_data_parallel, simulate_layout,
    simulate_pipeline,
)
from omnibal_ext.model.units import get_preset


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_1f1b_closed_form(P, m):
    f, b = 0.7, 1.9
    r = simulate_pipeline([f] * P, [b] * P, m)
    assert r.iteration_s == pytest.approx((m + P - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((P - 1) / (m + P - 1))
    assert r.per_stage_busy_s == pytest.approx([m * (f + b)] * P)
    assert len(r.events) == 2 * m * P


@pytest.mark.parametrize("P,V,m", [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 12), (3, 4, 6)])
def test_interleaved_closed_form(P, V, m):
    """Equal chunks f/V, b/V: the bubble shrinks by V: (m + (P-1)/V) * (f + b)."""
    f, b = 1.0, 2.0
    r = simulate_pipeline(np.full((P, V), f / V), np.full((P, V), b / V), m, vpp=V)
    assert r.iteration_s == pytest.approx((m + (P - 1) / V) * (f + b))
    assert len(r.events) == 2 * m * P * V


def test_single_microbatch_with_comm_is_the_critical_path():
    f, b, c = [1.0, 2.0, 3.0], [2.0, 1.0, 4.0], 0.25
    r = simulate_pipeline(f, b, 1, p2p_s=c)
    assert r.iteration_s == pytest.approx(sum(f) + sum(b) + 2 * 2 * c)


def test_unequal_stages_bound_by_slowest():
    f, b, m = np.array([1.0, 3.0, 1.0]), np.array([2.0, 6.0, 2.0]), 10
    r = simulate_pipeline(f, b, m)
    # the slowest stage works m*(f+b) and must wait for the others' first forward / last backward
    assert r.iteration_s == pytest.approx(m * 9 + 1 + 2)


@pytest.mark.parametrize("P,V,m", [(4, 1, 6), (4, 2, 8), (3, 3, 6)])
def test_events_respect_dependencies_and_order(P, V, m):
    rng = np.random.default_rng(P * 10 + V)
    F = rng.uniform(0.5, 2, (m, P, V))
    B = rng.uniform(0.5, 3, (m, P, V))
    C = rng.uniform(0, 0.3, (P, V))
    r = simulate_pipeline(F, B, m, p2p_s=C, vpp=V)
    ev = {(e.kind, e.stage, e.chunk, e.microbatch): e for e in r.events}
    assert len(ev) == 2 * m * P * V
    for (kind, i, c, mb), e in ev.items():
        dur = (F if kind == "fwd" else B)[mb, i, c]
        assert e.end_s - e.start_s == pytest.approx(dur)
        if kind == "fwd" and i > 0:
            assert e.start_s >= ev[("fwd", i - 1, c, mb)].end_s + C[i - 1, c] - 1e-12
        if kind == "fwd" and i == 0 and c > 0:
            assert e.start_s >= ev[("fwd", P - 1, c - 1, mb)].end_s + C[P - 1, c - 1] - 1e-12
        if kind == "bwd" and i < P - 1:
            assert e.start_s >= ev[("bwd", i + 1, c, mb)].end_s + C[i, c] - 1e-12
        if kind == "bwd":
            assert e.start_s >= ev[("fwd", i, c, mb)].end_s - 1e-12
    for i in range(P):
        mine = sorted((e for e in r.events if e.stage == i), key=lambda e: e.start_s)
        assert [(e.kind, e.microbatch, e.chunk) for e in mine] == schedule_order(P, i, m, V)
        for a, b in zip(mine, mine[1:]):
            assert b.start_s >= a.end_s - 1e-12


def test_schedule_order_counts():
    o = schedule_order(4, 0, 8)
    assert [k for k, _, _ in o[:4]] == ["fwd"] * 4 and o[4][0] == "bwd"
    assert [k for k, _, _ in schedule_order(4, 3, 8)[:2]] == ["fwd", "bwd"]
    with pytest.raises(ValueError, match="multiple"):
        schedule_order(4, 0, 6, vpp=2)


def test_data_parallel_takes_slowest_rank_plus_allreduce():
    fast = simulate_pipeline([1.0, 1.0], [2.0, 2.0], 4)
    ar = allreduce_seconds(8e9, 4, 100e9)
    assert ar == pytest.approx(2 * 3 / 4 * 8e9 / 100e9)
    r = simulate_data_parallel([[1.0, 1.0], [1.5, 1.0]], [[2.0, 2.0], [2.0, 2.0]], 4, allreduce_s=ar)
    assert r.slowest_rank == 1
    assert r.iteration_s == pytest.approx(r.ranks[1].iteration_s + ar)
    assert r.ranks[0].iteration_s == pytest.approx(fast.iteration_s)


def test_simulate_layout_from_costs():
    spec = get_preset("internvl-6b-20b")
    costs = analytic_costs(spec, MicroBatchShape(9, 4096))
    layout = default_layout(spec, 4)
    dev = DEVICES["a100-80g"]
    fwd, bwd, p2p = layout_stage_costs(costs, layout, 4, dev.p2p_bytes_per_s)
    assert fwd.sum() == pytest.approx(sum(u.fwd_s for u in costs.units))
    assert p2p[0, 0] == pytest.approx(costs.units[layout.stage_units[0] - 1].send_bytes / dev.p2p_bytes_per_s)
    r = simulate_layout(costs, layout, 4, 8, dev.p2p_bytes_per_s)
    slowest = (fwd + bwd).max()
    # stage 0 (the whole ViT) is the bottleneck and the first stage: it never waits
    assert (fwd + bwd).argmax() == 0
    assert r.iteration_s == pytest.approx(8 * slowest)
    assert r.per_stage_busy_s[0] == pytest.approx(r.iteration_s)
