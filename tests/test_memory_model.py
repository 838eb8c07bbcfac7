"""Memory model vs hand computation on a tiny hand-built cost table."""
import pytest

from omnibal_ext.memory.memory_model import (
    MemoryModelError,
    Precision,
    in_flight_1f1b,
    interleaved_live_counts,
    stage_memory,
    stage_time_s,
)
from omnibal_ext.memory.recompute import StageRecompute
from omnibal_ext.model.costs import CostTable, UnitCost
from omnibal_ext.model.layout import PipelineLayout


def unit(name, kind, act, full=None, sel=None, params=0, fwd=1.0, bwd=2.0, sel_s=0.0):
    full = act if full is None else full
    sel = act if sel is None else sel
    return UnitCost(name, kind, fwd, bwd, act, full, sel, sel_s, 8.0, params)


# I v0 v1 P E t0 t1 t2 L
TABLE = CostTable((
    unit("vit.embed", "vit_embed", 10, params=100, fwd=0.5, bwd=0.5),
    unit("vit.layer.0", "vit_layer", 100, 10, 60, 1000, fwd=1.0, bwd=2.0, sel_s=0.25),
    unit("vit.layer.1", "vit_layer", 120, 12, 70, 1000, fwd=1.5, bwd=3.0, sel_s=0.5),
    unit("projector", "projector", 20, params=200, fwd=0.25, bwd=0.25),
    unit("llm.embed", "llm_embed", 30, params=300, fwd=0.25, bwd=0.25),
    unit("llm.layer.0", "llm_layer", 200, 20, 150, 2000, fwd=2.0, bwd=4.0, sel_s=0.5),
    unit("llm.layer.1", "llm_layer", 210, 21, 160, 2000, fwd=2.0, bwd=4.0, sel_s=0.5),
    unit("llm.layer.2", "llm_layer", 220, 22, 170, 2000, fwd=2.0, bwd=4.0, sel_s=0.5),
    unit("llm.head", "llm_head", 50, params=500, fwd=1.0, bwd=1.0),
))
LAYOUT = PipelineLayout((3, 6))
PLAN = [StageRecompute(vit_full_layers=1), StageRecompute(llm_full_layers=1, llm_selective=True)]


def test_stage_memory_matches_hand_computation():
    mem = stage_memory(TABLE, LAYOUT, PLAN, pp=2, tp=2, dp=4, num_microbatches=3)
    # stage 0: I (10) + v0 full (10) + v1 kept (120) = 140 per micro-batch, min(2 - 0, 3) = 2 in flight,
    # params (100 + 1000 + 1000) / tp 2 = 1050 at 2 + 4 + 12/4 = 9 bytes, recompute working set 100 - 10.
    assert mem[0].act_bytes_per_mb == 140
    assert mem[0].in_flight == 2
    assert mem[0].static_bytes == 1050 * 9
    assert mem[0].transient_bytes == 90
    assert mem[0].peak_bytes == 9450 + 2 * 140 + 90
    # stage 1: P 20 + E 30 + t0 full 20 + t1 sel 160 + t2 sel 170 + L 50 = 450, 1 in flight,
    # params 7000 / 2 = 3500, working set max(200 - 20, 210 - 160, 220 - 170) = 180.
    assert mem[1].act_bytes_per_mb == 450
    assert mem[1].in_flight == 1
    assert mem[1].static_bytes == 3500 * 9
    assert mem[1].peak_bytes == 31500 + 450 + 180


def test_no_plan_and_plain_optimizer():
    mem = stage_memory(TABLE, LAYOUT, None, pp=2, tp=1, dp=4, num_microbatches=1, distributed_optimizer=False)
    assert [m.in_flight for m in mem] == [1, 1]
    assert mem[0].static_bytes == 2100 * 18
    assert mem[0].act_bytes_per_mb == 10 + 100 + 120
    assert mem[0].transient_bytes == 0
    assert mem[1].peak_bytes == 7000 * 18 + 20 + 30 + 200 + 210 + 220 + 50
    custom = Precision(param_bytes=2, grad_bytes=2, optimizer_bytes=8)
    mem = stage_memory(TABLE, LAYOUT, None, pp=2, tp=1, dp=4, num_microbatches=1, precision=custom)
    assert mem[0].static_bytes == 2100 * (2 + 2 + 8 / 4)


def test_stage_time_includes_recompute():
    t = stage_time_s(TABLE, LAYOUT, PLAN)
    # stage 0: fwd+bwd 1 + 3 + 4.5, plus v0 forward again (1.0)
    assert t[0] == pytest.approx(1 + 3 + 4.5 + 1.0)
    # stage 1: 0.5 + 0.5 + 3*6 + 2, plus t0 forward (2.0) and t1, t2 selective (0.5 each)
    assert t[1] == pytest.approx(0.5 + 0.5 + 18 + 2 + 2.0 + 1.0)


def test_in_flight_1f1b():
    assert list(in_flight_1f1b(4, 8)) == [4, 3, 2, 1]
    assert list(in_flight_1f1b(4, 2)) == [2, 2, 2, 1]
    assert list(in_flight_1f1b(1, 5)) == [1]
    for p, m in [(4, 8), (3, 2), (5, 5)]:
        for r in range(p):  # the schedule replay with one chunk agrees with the closed form
            assert interleaved_live_counts(p, 1, m, r).sum(axis=1).max() == min(p - r, m)


def test_interleaved_replay_by_hand():
    # P=2, V=2, m=4, rank 0: 4 warm-up forwards (chunks 0,0,1,1), then fwd/bwd pairs; backwards run
    # chunk 1 first.  Alive (chunk0, chunk1) after each forward, worked out by hand:
    live = interleaved_live_counts(2, 2, 4, 0)
    assert live.tolist() == [[1, 0], [2, 0], [2, 1], [2, 2], [3, 2], [4, 1], [4, 1], [3, 2]]
    # rank 0 holds virtual stages 0 and 2
    table = CostTable(tuple(unit(f"vit.layer.{i}", "vit_layer", a) for i, a in enumerate([300, 7, 100, 9])))
    mem = stage_memory(table, PipelineLayout((1, 1, 1, 1)), None, pp=2, tp=1, dp=1, num_microbatches=4,
                       virtual_stages=2)
    assert mem[0].peak_bytes == 4 * 300 + 1 * 100  # at the 6th forward
    assert mem[0].in_flight == 5
    assert mem[0].act_bytes_per_mb == 400
    # closed form of the first rank's total (Megatron: P*V + P - 1 chunk micro-batches)
    for p, v in [(4, 2), (4, 3), (2, 4)]:
        assert interleaved_live_counts(p, v, 4 * p, 0).sum(axis=1).max() == p * v + p - 1


def test_bad_inputs_are_named():
    with pytest.raises(MemoryModelError, match="3 stages"):
        stage_memory(TABLE, PipelineLayout((3, 3, 3)), None, pp=2, tp=1, dp=1, num_microbatches=1)
    with pytest.raises(MemoryModelError, match="stage 0"):
        stage_memory(TABLE, LAYOUT, [StageRecompute(vit_full_layers=3), StageRecompute()], 2, 1, 1, 1)
    with pytest.raises(MemoryModelError, match="dp"):
        stage_memory(TABLE, LAYOUT, None, 2, 1, 0, 1)


def test_layer_tradeoffs_by_hand():
    from omnibal_ext.memory.recompute import layer_tradeoffs

    rows = {r["unit"]: r for r in layer_tradeoffs(TABLE, LAYOUT, pp=2, num_microbatches=3)}
    assert set(rows) == {"vit.layer.0", "vit.layer.1", "llm.layer.0", "llm.layer.1", "llm.layer.2"}
    assert rows["vit.layer.0"]["memory_bytes"] == (100 - 10) * 2  # stage 0 holds 2 micro-batches
    assert rows["vit.layer.1"]["time_saved_s"] == 1.5
    assert rows["llm.layer.2"]["memory_bytes"] == (220 - 22) * 1
    assert rows["llm.layer.2"]["bytes_per_s"] == 198 / 2.0
