"""ISF at native resolution: per-image stats, the numpy smart_resize and patch grids against the trainer's, sizes
drawn to fit InternVL tile counts against the trainer's tiling, per-sample times against the cost model of whole
groups, window segments against brute force, and ISF in time (caps, filter, partition, balance)."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from megatron.vlm.data.tiling import count_tiles
from megatron.vlm.lineages.qwen.image_processing import smart_resize as trainer_smart_resize
from omnibal_ext.data import native
from omnibal_ext.data.isf import ISFParams, check_partition, isf_group
from omnibal_ext.data.search import SearchConfig, step_matrix_epoch0
from omnibal_ext.data.search_time import run_isf_in_time, random_baseline_time
from omnibal_ext.data.stats import StatsError, from_arrays, load_stats
from omnibal_ext.model.cost_model import DEVICES, analytic_costs
from omnibal_ext.model.sample_time import VISION_CODES, sample_times, sample_work, time_coefficients
from omnibal_ext.model.shape import MicroBatchShape
from omnibal_ext.model.units import get_preset


def _random_sizes(n, seed):
    rng = np.random.default_rng(seed)
    h, w = rng.integers(3, 5000, n), rng.integers(3, 5000, n)
    keep = np.maximum(h, w) / np.minimum(h, w) <= 200
    return h[keep], w[keep]


def test_smart_resize_and_grid_match_the_trainer():
    h, w = _random_sizes(3000, 0)
    for lo, hi in ((56 * 56, 28 * 28 * 1280), (3136, 12845056), (200 * 28 * 28, 300 * 28 * 28)):
        nh, nw = native.smart_resize(h, w, min_pixels=lo, max_pixels=hi)
        ref = np.array([trainer_smart_resize(int(a), int(b), min_pixels=lo, max_pixels=hi) for a, b in zip(h, w)])
        assert np.array_equal(nh, ref[:, 0]) and np.array_equal(nw, ref[:, 1])
        rows, cols = native.patch_grid(h, w, native.native_patches(h, w, lo, hi))
        assert np.array_equal(rows, ref[:, 0] // 14) and np.array_equal(cols, ref[:, 1] // 14)


def test_drawn_sizes_tile_to_the_published_counts():
    tiles = np.array([1, 3, 4, 5] * 200)
    w, h = native.draw_sizes_for_tiles(tiles, max_num=4, seed=3)
    assert [count_tiles(int(a), int(b), 448, 1, 4) for a, b in zip(w, h)] == tiles.tolist()
    w2, _ = native.draw_sizes_for_tiles(tiles, max_num=4, seed=3)
    assert np.array_equal(w, w2)  # seeded
    with pytest.raises(Exception, match="cannot give"):
        native.draw_sizes_for_tiles(np.array([2]), max_num=4)  # 2 tiles: a 2-grid always adds a thumbnail


def test_derived_stats_swap_tile_tokens_for_merged_patches():
    stats = from_arrays([1, 5, 0], [400, 1400, 50])
    d = native.derive_native_stats(stats, max_num=4, seed=1)
    assert d.images.offsets.tolist() == [0, 1, 2, 2]
    p = d.images.patches
    assert np.array_equal(p, native.native_patches(d.images.height, d.images.width))
    assert d.tokens.tolist() == [400 - 256 + p[0] // 4, 1400 - 5 * 256 + p[1] // 4, 50]
    assert d.patches.tolist() == [p[0], p[1], 0]


def test_stats_file_with_images_round_trip(tmp_path):
    recs = [{"vit_num": 2, "token_num": 900, "images": [{"width": 640, "height": 480, "patches": 1564},
                                                         {"width": 30, "height": 40, "patches": 16}]},
            {"vit_num": 0, "token_num": 12, "images": []}]
    f = tmp_path / "s.json.gz"
    with gzip.open(f, "wt") as fh:
        json.dump(recs, fh)
    s = load_stats([f, f])
    assert s.patches.tolist() == [1580, 0, 1580, 0]
    assert s.subset(np.array([2, 1])).images.width.tolist() == [640, 30]
    assert native.records_of(s.subset(np.array([0, 1]))) == recs
    assert s.summary()["all"]["patches_mean"] == 790 and s.summary()["all"]["images_mean"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([recs[0], {"vit_num": 0, "token_num": 3}]))
    with pytest.raises(StatsError, match="record 1 has no \"images\""):
        load_stats([bad])
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"vit_num": 1, "token_num": 3}]))
    with pytest.raises(StatsError, match="no per-image sizes"):
        load_stats([f, plain])
    with pytest.raises(StatsError, match="no per-image sizes"):
        load_stats([plain]).patches


def test_window_segments_brute_force():
    spec = get_preset("qwen2.5-vl-tiny")  # 56 px windows: 4 x 4 patches
    side = spec.vision.window_patches_side
    for rows, cols in ((2, 2), (4, 6), (10, 6), (18, 34)):
        sizes = [min(side, rows - r) * min(side, cols - c) for r in range(0, rows, side) for c in range(0, cols, side)]
        full, window = spec.vision.segments_sq(np.array([rows]), np.array([cols]))
        assert window[0] == sum(s * s for s in sizes) and full[0] == (rows * cols) ** 2


@pytest.mark.parametrize("model", ["qwen2.5-vl-7b", "internvl-6b-20b"])
def test_sample_times_sum_to_the_cost_model_of_the_group(model):
    spec = get_preset(model)
    device = DEVICES["h200-141g"]
    stats = native.derive_native_stats(from_arrays([1, 5, 3, 4, 5], [400, 1400, 900, 1100, 1500]), max_num=4, seed=2)
    work = sample_work(stats, spec)
    vit, llm = sample_times(work, time_coefficients(spec, device, tp=2))
    shape = MicroBatchShape(int(work.vit_items.sum()), int(work.llm_tokens.sum()),
                            llm_attn_tokens_sq=float(work.llm_tokens_sq.sum()),
                            vision_attn_tokens_sq=float(work.vit_full_sq.sum()),
                            vision_window_tokens_sq=float(work.vit_window_sq.sum()))
    costs = analytic_costs(spec, shape, 2, device, attention="flash")
    assert vit.sum() == pytest.approx(sum(u.fwd_s + u.bwd_s for u in costs.units if u.code in VISION_CODES), rel=1e-9)
    assert llm.sum() == pytest.approx(sum(u.fwd_s + u.bwd_s for u in costs.units if u.code not in VISION_CODES),
                                      rel=1e-9)
    if model.startswith("qwen"):  # full attention is quadratic per image: one big image costs more than two halves
        assert work.vit_full_sq.tolist() == pytest.approx(
            [float((stats.images.patches[stats.images.offsets[i]:stats.images.offsets[i + 1]] ** 2).sum())
             for i in range(len(stats))])


def _timed_data(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    vit = rng.integers(100, 5000, n)
    tok = rng.integers(50, 2000, n) + vit // 4
    vt = vit * 7 + (vit.astype(np.float64) ** 2 / 2000).astype(np.int64)  # a quadratic part
    lt = tok * 80 + (tok.astype(np.float64) ** 2 / 1000).astype(np.int64)
    return vit, tok, (vt, lt)


def test_isf_in_time_respects_every_cap_and_the_time_filter():
    vit, tok, (vt, lt) = _timed_data()
    p = ISFParams(qv=12000, qt=5000, qv_min=0, qt_min=0, iters=8, vit_time=60000, llm_time=400000,
                  vit_time_min=50000, llm_time_min=380000)
    g = isf_group(vit, tok, p, seed=1, times=(vt, lt))
    check_partition(g, len(vit))
    groups = g.groups()
    assert all(vit[m].sum() <= 12000 and tok[m].sum() <= 5000 for m in groups)
    assert all(vt[m].sum() <= 60000 and lt[m].sum() <= 400000 for m in groups)
    assert np.array_equal(g.vit_time, [vt[m].sum() for m in groups])
    kept = g.kind == 0
    assert np.all((g.vit_time[kept] >= 50000) | (g.llm_time[kept] >= 380000))
    # greedy: the walk closes a group only when the next sample would break a cap
    assert g.report["kept_groups"] > 0.8 * len(g)
    with pytest.raises(ValueError, match="need times"):
        isf_group(vit, tok, p)
    assert "vit_time" not in ISFParams(1, 2, 0, 0).to_dict()  # count params keep their form


def test_isf_in_time_balances_time_better_than_random():
    vit, tok, times = _timed_data(6000, 1)
    cfg = SearchConfig(dp_size=8, samples_per_group=4.0, time_budget_s=float("inf"))
    plan = run_isf_in_time(vit, tok, times, cfg)
    check_partition(plan.grouping, len(vit))
    rnd = random_baseline_time(vit, tok, times, 8, 4)
    assert plan.metrics["dist_ratio_vit_time"] < 0.02 and plan.metrics["dist_ratio_llm_time"] < 0.02
    assert rnd["dist_ratio_vit_time"] > 5 * plan.metrics["dist_ratio_vit_time"]
    # the metric itself, recomputed from the step matrix
    steps = step_matrix_epoch0(len(plan.grouping), 8, plan.assembly.order, cfg.seed)  # as the sampler serves them
    per = (plan.grouping.vit_time + plan.grouping.llm_time)[steps].astype(float)
    expect = np.mean((per.max(1)[:, None] - per).sum(1) / (per.max(1) * per.shape[1]))
    assert plan.metrics["dist_ratio_time"] == pytest.approx(expect)


def test_tight_count_caps_keep_the_grouping():
    from omnibal_ext.data.search_time import tight_count_caps

    vit, tok, times = _timed_data(4000, 2)
    p = ISFParams(qv=40000, qt=20000, qv_min=0, qt_min=0, iters=6, vit_time=60000, llm_time=400000,
                  vit_time_min=50000, llm_time_min=380000)
    g = isf_group(vit, tok, p, seed=3, times=times)
    tight = tight_count_caps(p, g)
    assert tight.qv == g.tiles.max() < p.qv and tight.qt == g.tokens.max() < p.qt
    g2 = isf_group(vit, tok, tight, seed=3, times=times)
    assert np.array_equal(g.members, g2.members) and np.array_equal(g.offsets, g2.offsets)


def test_cli_search_and_pack_in_time(tmp_path):
    from omnibal_cli import main
    from omnibal_ext.data.assign import load_pack
    from omnibal_ext.model.cost_model import DEVICES
    from omnibal_ext.model.sample_time import sample_time_units

    rng = np.random.default_rng(4)
    tiles = rng.choice([1, 3, 4, 5], 1500)
    stats = native.derive_native_stats(from_arrays(tiles, 256 * tiles + rng.integers(20, 600, 1500)), max_num=4)
    f = tmp_path / "native.json"
    f.write_text(json.dumps(native.records_of(stats)))
    out, pack = tmp_path / "out.json", tmp_path / "pack.json"
    args = ["--stats", str(f), "--model", "qwen2.5-vl-7b", "--samples-per-group", "4", "--max-candidates", "6"]
    assert main(["isf", "search", *args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["params"]["vit_time"] > 0 and doc["params"]["qv"] >= stats.patches.max()
    assert doc["isf"]["dist_ratio_vit_time"] < doc["random"]["dist_ratio_vit_time"]
    assert main(["isf", "pack", *args, "--out", str(pack)]) == 0
    plan = load_pack(pack)
    vt, lt = sample_time_units(stats, get_preset("qwen2.5-vl-7b"), DEVICES["h200-141g"])
    p = plan.meta["params"]
    assert all(vt[g].sum() <= p["vit_time"] and lt[g].sum() <= p["llm_time"] for g in plan.groups)
    assert sorted(np.concatenate(plan.groups).tolist()) == list(range(len(stats)))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"vit_num": 1, "token_num": 300}]))
    assert main(["isf", "search", "--stats", str(plain), "--model", "qwen2.5-vl-7b"]) == 1  # no images: refused
