"""Qwen2.5-VL in the planners: recompute of alternating window/full-attention ViT runs as the memory model counts it
(checked on built stages), the data's ViT segments in the plan's micro-batch shapes, and `omnibal plan` on native
stats (patches as ViT items, groups balanced in predicted time: the thresholds, DistRatio in time, shapes and
trainer flags of the time groups)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from isf_reference import dist_ratio, reference_isf

from omnibal_ext.data.isf import ISFParams
from omnibal_ext.data.native import derive_native_stats, records_of
from omnibal_ext.data.search import step_matrix_epoch0
from omnibal_ext.data.stats import from_arrays
from omnibal_ext.memory.memory_model import MODE_FULL, unit_modes
from omnibal_ext.memory.stage_recompute import StageRecompute
from omnibal_ext.model.cost_model import analytic_costs, get_device
from omnibal_ext.model.layout import PipelineLayout
from omnibal_ext.model.sample_time import sample_time_units, vision_segments
from omnibal_ext.model.shape import MicroBatchShape
from omnibal_ext.model.spec import VISION_LAYER
from omnibal_ext.model.units import build_units, get_preset, unit_components
from omnibal_ext.plan import PlanConfig, format_plan, make_plan
from omnibal_ext.plan.data_level import cap_shape, isf_for_ranks, shape_of


def _recomputed_layers(stage) -> list[bool]:
    """Per ViT layer of a built stage, in unit order: fully recomputed."""
    out = []
    for block in stage.vit_blocks:
        out += [block.config.recompute_granularity == "full"] * block.config.num_layers
    return out


@pytest.mark.parametrize("full_layers", [0, 1, 2, 3, 4])
def test_mixed_vit_runs_recompute_the_stages_first_layers(megatron_world, full_layers):
    from megatron.vlm.stage.build import StageBuild, build_stage

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


def _segments_by_hand(height, width, side: int) -> tuple[list[int], list[int], list[int]]:
    """(patches, full-attention square, window squares) of each image: its size resized as transformers'
    Qwen2-VL image processor resizes it (``smart_resize``, its default pixel limits), 14 px patches; the whole image
    is one full-attention segment; windows of ``side`` x ``side`` patches from the top left corner, cut at the
    right and bottom edges (transformers pads the merged grid at its end)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patches, full, window = [], [], []
    for h, w in zip(height, width):
        rh, rw = smart_resize(int(h), int(w))
        rows, cols = rh // 14, rw // 14
        patches.append(rows * cols)
        full.append((rows * cols) ** 2)
        window.append(sum((min(side, rows - i) * min(side, cols - j)) ** 2
                          for i in range(0, rows, side) for j in range(0, cols, side)))
    return patches, full, window


def test_plan_shapes_carry_the_datas_vit_segments():
    pytest.importorskip("transformers")
    spec = get_preset("qwen2.5-vl-7b")
    stats = derive_native_stats(from_arrays([1, 5, 3, 5, 4] * 20, [400, 1400, 900, 1300, 1100] * 20), max_num=4)
    patches, full, window = (np.array(x, dtype=np.float64) for x in
                             _segments_by_hand(stats.images.height, stats.images.width, 8))  # 112 px windows
    assert np.array_equal(patches, stats.images.patches)
    seg = vision_segments(stats, spec)
    assert seg.mean_full == pytest.approx(full.sum() / patches.sum(), rel=1e-12)
    assert seg.mean_window == pytest.approx(window.sum() / patches.sum(), rel=1e-12)
    assert seg.max_full == pytest.approx((full / patches).max(), rel=1e-12)  # an image's square per patch
    assert seg.max_window == pytest.approx((window / patches).max(), rel=1e-12)
    assert seg.max_window < seg.max_full and seg.max_window <= 64
    shape = shape_of(np.array([3000.0, 4000.0, 5e6]), 1, seg)
    assert shape.vision_attn_tokens_sq == pytest.approx(3000 * full.sum() / patches.sum())
    assert shape.vision_window_tokens_sq == pytest.approx(3000 * window.sum() / patches.sum())

    class Caps:
        qv, qt = 12000, 5000
    cap = cap_shape(Caps, stats.in_vision_items("patch"), 1, None, seg)
    assert cap.vision_items == 12000 and cap.vision_attn_tokens_sq == pytest.approx(12000 * (full / patches).max())
    assert cap.vision_window_tokens_sq == pytest.approx(12000 * (window / patches).max())
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


def test_plan_groups_native_data_in_predicted_time():
    spec = get_preset("qwen2.5-vl-7b")
    rng = np.random.default_rng(0)
    tiles = rng.choice([1, 3, 4, 5], 3000)
    stats = derive_native_stats(from_arrays(tiles, 256 * tiles + rng.integers(50, 400, 3000)), max_num=4)
    config = PlanConfig(model=spec, gpus=16, gpu_memory_bytes=80 * 2**30, device="h100-80g", global_batch_size=256,
                        sim_iterations=2, max_vpp=1)
    plan = make_plan(stats, config)
    p = plan.isf["params"]
    assert p["vit_time"] > 0 and p["llm_time"] > 0 and p["llm_time_min"] <= p["llm_time"]

    # the plan's groups (its data level at the chosen sizes) are ISF's, run one sample at a time with the plan's
    # thresholds on each sample's time from the cost model of the plan's model and device at its TP
    data = isf_for_ranks(stats.in_vision_items("patch"), plan.dp, config, 1, plan.tp)
    assert data.params.to_dict() == p
    vt, lt = sample_time_units(stats, spec, get_device("h100-80g"), tp=plan.tp)
    groups = data.grouping.groups()
    assert [g.tolist() for g in groups] == reference_isf(stats.patches, stats.tokens, p, config.seed, (vt, lt))
    gvt, glt = (np.array([t[g].sum() for g in groups], dtype=np.float64) for t in (vt, lt))
    gp = np.array([stats.patches[g].sum() for g in groups])
    gt = np.array([stats.tokens[g].sum() for g in groups])
    assert gvt.max() <= p["vit_time"] and glt.max() <= p["llm_time"]
    # the count caps are the time groups' largest (what memory is planned for), and the caps' shape holds them
    assert (gp.max(), gt.max()) == (p["qv"], p["qt"]) and plan.shapes["isf_caps"]["vision_items"] == p["qv"]

    # DistRatio in time: recomputed from the samples' times over the step plan the sampler serves
    steps = step_matrix_epoch0(len(groups), data.assembly.width, data.assembly.order, config.seed)
    assert sorted(steps.ravel().tolist()) == list(range(steps.size)) and steps.shape[1] == plan.dp
    m = plan.isf["metrics"]
    assert m["dist_ratio_vit_time"] == pytest.approx(dist_ratio(gvt[steps]), rel=1e-12)
    assert m["dist_ratio_llm_time"] == pytest.approx(dist_ratio(glt[steps]), rel=1e-12)
    assert m["dist_ratio_time"] == pytest.approx(dist_ratio((gvt + glt)[steps]), rel=1e-12)
    assert m["dist_ratio_time"] < 0.02 < plan.random["dist_ratio_time"]  # random batching, in time too
    assert "dist_ratio_llm" in m and "DistRatio in time llm" in format_plan(plan)

    # the mean ISF micro-batch of the simulated iterations: the time groups' (patches, tokens, sum len^2)
    n_steps, mb, iters = len(steps), plan.num_microbatches, config.sim_iterations
    served = np.concatenate([steps[(i * n_steps // iters + np.arange(mb)) % n_steps].ravel() for i in range(iters)])
    sq = np.array([(stats.tokens[g].astype(float) ** 2).sum() for g in groups])
    want = [gp[served].mean(), gt[served].mean(), sq[served].mean()]
    assert [plan.shapes["isf_mean"][k] for k in ("tiles", "llm_tokens", "llm_attn_tokens_sq")] == pytest.approx(want)

    # the trainer is told the thresholds as found, the pass count and the device of the times
    f = plan.trainer_flags
    assert (f["--omnibal-isf-vit-time"], f["--omnibal-isf-llm-time"], f["--omnibal-isf-vit-time-min"],
            f["--omnibal-isf-llm-time-min"], f["--omnibal-isf-iters"], f["--omnibal-isf-qv"], f["--omnibal-isf-qt"]) == (
        p["vit_time"], p["llm_time"], p["vit_time_min"], p["llm_time_min"], p["iters"], p["qv"], p["qt"])
    assert f["--omnibal-isf-time-device"] == "h100-80g"


def test_omnibal_plan_cli_writes_time_thresholds_the_trainer_reads(tmp_path):
    from megatron.training.arguments import plan_flags
    from megatron.training.flags import build_parser
    from megatron.training.validation import check_isf_flags
    from megatron.training.specs import isf_params_from_flags
    from omnibal_cli import main

    rng = np.random.default_rng(2)
    tiles = rng.choice([1, 3, 4, 5], 1500)
    stats = derive_native_stats(from_arrays(tiles, 256 * tiles + rng.integers(50, 400, 1500)), max_num=4)
    f, out = tmp_path / "native.json", tmp_path / "plan.json"
    f.write_text(json.dumps(records_of(stats)))
    assert main(["plan", "--data", str(f), "--model", "qwen2.5-vl-7b", "--gpus", "16", "--gpu-memory", "80",
                 "--dp", "4", "--device", "h200-141g", "--global-batch-size", "128", "--sim-iterations", "1", "--max-vpp", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    p = doc["isf"]["params"]
    assert p["vit_time"] > 0 and p["llm_time"] > 0 and p["qv"] >= stats.patches.max()
    assert doc["isf"]["metrics"]["dist_ratio_time"] < doc["random"]["dist_ratio_time"]
    args = build_parser().parse_args(plan_flags(str(out)))  # what --omnibal-plan applies
    check_isf_flags(args)
    assert isf_params_from_flags(args) == ISFParams(**p) and args.omnibal_isf_time_device == "h200-141g"


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
