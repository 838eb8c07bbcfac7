"""The planners count side tensors (DeepStack features) at every boundary they cross: bytes against the closed form
rows x width x dtype bytes per live feature per boundary, the memory model's received buffers per micro-batch in
flight, the simulator's P2P time, and the partition search choosing another cut when the side bytes are large (the
brute-force oracle of test_partition)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnibal_ext.model.cost_model import MicroBatchShape, analytic_costs
from omnibal_ext.model.costs import CostTable, UnitCost
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.partition import optimal_partition, search_partition
from test_partition import all_splits, brute_keys


@pytest.fixture(scope="module")
def toy():
    import toy_deepstack

    toy_deepstack.register()
    yield toy_deepstack
    toy_deepstack.unregister()


def test_side_bytes_closed_form(toy):
    """Units: I 0, v 1-4, P 5, E 6, t 7-10, L 11; feature 0 made by unit 2 read by unit 7, feature 1 made by unit 3
    read by unit 9, both 64 wide; 3 tiles of 4 image tokens, bf16."""
    spec = toy.toy_spec()
    one = 3 * 4 * 64 * 2
    table = analytic_costs(spec, MicroBatchShape(vision_items=3, llm_tokens=96, dtype_bytes=2))
    want = [0, 0, one, 2 * one, 2 * one, 2 * one, 2 * one, one, one, 0, 0, 0]
    assert [u.side_send_bytes for u in table.units] == want
    # CP 2: the busiest rank's tiles, ceil(3 / 2) = 2
    cp = analytic_costs(spec, MicroBatchShape(vision_items=3, llm_tokens=96, dtype_bytes=2, cp=2))
    assert [u.side_send_bytes for u in cp.units] == [b * 2 / 3 for b in want]
    # a family without side tensors: none
    from omnibal_ext.model.units import get_preset

    assert not any(u.side_send_bytes for u in analytic_costs(get_preset("tiny"), MicroBatchShape(3, 96)).units)
    # written and read back with the table
    assert CostTable.from_dict(table.to_dict()) == table


def _without_sides(table):
    return dataclasses.replace(table, units=tuple(dataclasses.replace(u, side_send_bytes=0.0) for u in table.units))


def test_memory_and_simulator_count_the_received_side_bytes(toy):
    from omnibal_ext.memory.memory_model import in_flight_1f1b, stage_memory
    from omnibal_ext.model.simulate import layout_stage_costs

    spec = toy.toy_spec()
    one = 3 * 4 * 64 * 2
    table = analytic_costs(spec, MicroBatchShape(vision_items=3, llm_tokens=96, dtype_bytes=2))
    plain = _without_sides(table)
    layout = PipelineLayout((3, 5, 4))  # I v v | v v P E t | t t t L: boundaries after units 2 and 7
    m = 6
    got = stage_memory(table, layout, None, 3, 1, 1, m)
    base = stage_memory(plain, layout, None, 3, 1, 1, m)
    flight = in_flight_1f1b(3, m)
    received = [0, one, one]  # stage 1 receives feature 0, stage 2 feature 1
    for g, b, n, r in zip(got, base, flight, received):
        assert g.peak_bytes - b.peak_bytes == pytest.approx(n * r)
    bw = 1e9
    _, _, p2p = layout_stage_costs(table, layout, 3, bw)
    _, _, p2p_plain = layout_stage_costs(plain, layout, 3, bw)
    assert (p2p - p2p_plain)[:, 0].tolist() == pytest.approx([one / bw, one / bw, 0.0])


def _table(w, send, side):
    units = tuple(UnitCost(f"u{i}", "llm_layer", float(t), 0.0, 0.0, 0.0, 0.0, 0.0, float(s), 1, code="t",
                           side_send_bytes=float(b)) for i, (t, s, b) in enumerate(zip(w, send, side)))
    return CostTable(units)


def test_large_side_bytes_move_the_cut():
    """Two cuts as fast and as balanced: the hidden states alone favour the first, a large feature live there moves
    the search and the optimum to the second; both agree with brute force over send + side bytes."""
    w, send = [1, 2, 1], [1, 5, 0]
    quiet, loud = _table(w, send, [0, 0, 0]), _table(w, send, [100, 0, 0])
    assert search_partition(quiet, 2).layout.stage_units == optimal_partition(quiet, 2).layout.stage_units == (1, 2)
    assert search_partition(loud, 2).layout.stage_units == optimal_partition(loud, 2).layout.stage_units == (2, 1)
    assert search_partition(loud, 2).comm_bytes == 5
    for table in (quiet, loud):
        total = np.array([u.send_bytes + u.side_send_bytes for u in table.units])
        best = min(all_splits(3, 2), key=lambda c: brute_keys(np.array(w, float), total, c, 2))
        assert optimal_partition(table, 2).layout.stage_units == best


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_optimum_with_side_bytes_equals_brute_force(data):
    n = data.draw(st.integers(2, 8))
    pp = data.draw(st.integers(1, min(n, 4)))
    w = data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    send = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    side = data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    report = optimal_partition(_table(w, send, side), pp)
    total = np.array(send, float) + np.array(side, float)
    keys = lambda c: brute_keys(np.array(w, float), total, c, pp)  # noqa: E731
    best = min(keys(c) for c in all_splits(n, pp))
    assert keys(report.layout.stage_units) == pytest.approx(best)
