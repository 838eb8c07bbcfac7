"""Qwen2.5-VL in the planners: recompute of alternating window/full-attention ViT runs as the memory model counts it
(checked on built stages), the data's ViT segments in the plan's micro-batch shapes, and `omnibal plan` on native
stats (patches as ViT items)."""
from __future__ import annotations

import numpy as np
import pytest

from omnibal_ext.data.native import derive_native_stats
from omnibal_ext.data.stats import from_arrays
from omnibal_ext.memory.memory_model import MODE_FULL, unit_modes
from omnibal_ext.memory.stage_recompute import StageRecompute
from omnibal_ext.model.cost_model import analytic_costs
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.sample_time import sample_work, vision_segments
from omnibal_ext.model.shape import MicroBatchShape
from omnibal_ext.model.spec import VISION_LAYER
from omnibal_ext.model.units import build_units, get_preset, unit_components
from omnibal_ext.plan import PlanConfig, make_plan
from omnibal_ext.plan.data_level import cap_shape, shape_of


def _recomputed_layers(stage) -> list[bool]:
    """Per ViT layer of a built stage, in unit order: fully recomputed."""
    out = []
    for block in stage.vit_blocks:
        out += [block.config.recompute_granularity == "full"] * block.config.num_layers
    return out


@pytest.mark.parametrize("full_layers", [0, 1, 2, 3, 4])
def test_mixed_vit_runs_recompute_the_stages_first_layers(megatron_world, full_layers):
    from megatron.vlm.stage import StageBuild, build_stage

    spec = get_preset("qwen2.5-vl-tiny")  # ViT runs: window 0, full 1, window 2, full 3
    units = build_units(spec)
    vit_end = max(u.index for u in units if u.code == VISION_LAYER) + 1
    plan = [StageRecompute(vit_full_layers=full_layers), StageRecompute()]
    stage = build_stage(StageBuild(spec, range(0, vit_end + 1), pp=2, recompute=plan[0], seed=1))
    costs = analytic_costs(spec, MicroBatchShape(16, 64), 1)
    layout = PipelineLayout((vit_end + 1, len(units) - vit_end - 1))
    modes = unit_modes(costs, layout, plan)
    planned = [bool(modes[u.index] == MODE_FULL) for u in units if u.code == VISION_LAYER]
    assert _recomputed_layers(stage) == planned == [i < full_layers for i in range(4)]


def test_plan_shapes_carry_the_datas_vit_segments():
    spec = get_preset("qwen2.5-vl-7b")
    stats = derive_native_stats(from_arrays([1, 5, 3, 5, 4] * 20, [400, 1400, 900, 1300, 1100] * 20), max_num=4)
    seg = vision_segments(stats, spec)
    work = sample_work(stats, spec)
    assert seg.mean_full == pytest.approx(work.vit_full_sq.sum() / work.vit_items.sum())
    assert seg.max_full == stats.images.patches.max()  # an image's full-attention square per patch: its patches
    assert seg.max_window <= spec.vision.window_patches_side ** 2
    shape = shape_of(np.array([3000.0, 4000.0, 5e6]), 1, seg)
    assert shape.vision_attn_tokens_sq == pytest.approx(3000 * seg.mean_full)

    class Caps:
        qv, qt = 12000, 5000
    cap = cap_shape(Caps, stats.in_vision_items("patch"), 1, None, seg)
    assert cap.vision_items == 12000 and cap.vision_attn_tokens_sq == pytest.approx(12000 * seg.max_full)
    assert vision_segments(stats, get_preset("internvl-6b-20b")) is None  # fixed-size tiles: the family's own


def test_plan_counts_patches_for_qwen():
    spec = get_preset("qwen2.5-vl-7b")
    rng = np.random.default_rng(0)
    tiles = rng.choice([1, 3, 4, 5], 3000)
    stats = derive_native_stats(from_arrays(tiles, 256 * tiles + rng.integers(50, 400, 3000)), max_num=4)
    plan = make_plan(stats, PlanConfig(model=spec, gpus=16, gpu_memory_bytes=80 * 2**30, device="h100-80g",
                                       global_batch_size=256, sim_iterations=2, max_vpp=1))
    # the ISF caps are in patches: at least the largest sample's, far above any tile count
    assert plan.isf["params"]["qv"] >= stats.patches.max() > 100
    assert plan.shapes["isf_caps"]["vision_items"] == plan.isf["params"]["qv"]
    assert plan.shapes["isf_caps"]["vision_attn_tokens_sq"] == pytest.approx(
        plan.isf["params"]["qv"] * stats.images.patches.max())
    assert plan.rows[-1].gpu_days <= plan.rows[0].gpu_days


@pytest.mark.parametrize("patches", [3000, 3001])
def test_vit_layer_sequence_parallel_splits_input_and_send(patches):
    spec = get_preset("qwen2.5-vl-7b")
    layer = next(c for c in unit_components(spec) if c.kind == "qwen_vit_window_layer")
    shape = MicroBatchShape(patches, 2048)
    v, padded = spec.vision, -(-patches // 2) * 2
    plain = layer.act_bytes(shape, 2, False, "flash")
    split = layer.act_bytes(shape, 2, False, "flash", sequence_parallel=True)
    assert plain.send == patches * v.hidden_size * 2 and split.send == padded * v.hidden_size * 2 / 2
    assert split.full == padded * v.hidden_size + padded * v.head_dim * 4.0
    assert layer.tp_allreduce_bytes(shape, True, 2)[0] == 2 * padded * v.hidden_size * 2
