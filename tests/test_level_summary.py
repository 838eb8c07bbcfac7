"""The trainer's closing summary of what each OmniBal level did (megatron/training/level_summary.py) and the random
re-batching it compares the data level with (omnibal_ext.data.metrics.random_rebatch_balance), against closed forms."""
import itertools

import numpy as np
import pytest

from omnibal_ext.data.metrics import random_rebatch_balance


def test_one_rank_one_micro_batch_is_all_samples_padded_together():
    tokens, tiles = [[[5, 1, 3, 7]]], [[[1, 0, 2, 1]]]
    got = random_rebatch_balance(tokens, tiles, np.random.default_rng(0))
    assert got["pad_ratio"] == pytest.approx((4 * 7 - 16) / (4 * 7))  # every sample padded to the longest, 7
    assert got["dist_ratio_llm"] == 0 and got["dist_ratio_vit"] == 0  # one rank: nothing to balance


def test_two_ranks_one_sample_each_whatever_the_order():
    """Two samples over two ranks of one micro-batch: each rank gets one, in either order the same ratios."""
    for seed in range(4):
        got = random_rebatch_balance([[[8]], [[2]]], [[[3]], [[1]]], np.random.default_rng(seed))
        assert got["pad_ratio"] == 0
        assert got["dist_ratio_llm"] == pytest.approx((8 - 2) / (8 * 2))
        assert got["dist_ratio_vit"] == pytest.approx((3 - 1) / (3 * 2))


def test_mean_over_shuffles_is_the_mean_over_all_deals():
    """Two ranks x two micro-batches, four distinct samples: over many seeds the mean Dist ratio approaches the
    exact mean over all 4! deals (brute force)."""
    lengths = [1, 2, 4, 8]
    exact = []
    for perm in itertools.permutations(lengths):  # slot s: micro-batch s // 2 of rank s % 2
        per_mb = [abs(perm[2 * j] - perm[2 * j + 1]) / (2 * max(perm[2 * j], perm[2 * j + 1])) for j in range(2)]
        exact.append(sum(per_mb) / 2)
    rng = np.random.default_rng(0)
    tokens = [[[1], [2]], [[4], [8]]]
    got = np.mean([random_rebatch_balance(tokens, tokens, rng)["dist_ratio_llm"] for _ in range(4000)])
    assert got == pytest.approx(np.mean(exact), abs=0.01)


def test_uneven_micro_batches_deal_every_sample_once():
    """Seven samples over 2 ranks x 2 micro-batches: slots of 2, 2, 2 and 1 samples; with equal samples no padding
    and the Dist ratio of one micro-batch index is that of 2 against 1 sample."""
    tokens = [[[3, 3, 3], [3]], [[3, 3], [3]]]
    got = random_rebatch_balance(tokens, tokens, np.random.default_rng(1))
    assert got["pad_ratio"] == 0
    # micro-batch 0: ranks get 2 and 2 samples (6, 6); micro-batch 1: 2 and 1 (6, 3) -> (0 + (6-3)/(6*2)) / 2
    assert got["dist_ratio_llm"] == pytest.approx((0 + 3 / 12) / 2)


# ------------------------------------------------------------------------------------------- model and memory levels
def _reference():
    from pathlib import Path

    import megatron.vlm.families  # noqa: F401  (registers the built-in families)
    from omnibal_ext.model.costs import CostTable
    from omnibal_ext.model.units import get_preset

    return get_preset("tiny"), CostTable.load(str(Path(__file__).parent / "data" / "reference_profile.json"))


def _stage_sums(costs, counts, full_layers=False):
    """Seconds of forward + backward per stage of unit ``counts``, summed unit by unit; ``full_layers``: every ViT
    and LLM layer recomputed (one more forward)."""
    out, start = [], 0
    for n in counts:
        units = costs.units[start:start + n]
        out.append(sum(u.fwd_s + u.bwd_s + (u.fwd_s if full_layers and u.kind.endswith("layer") else 0.0)
                       for u in units))
        start += n
    return out


def test_model_level_recounted_from_the_unit_costs():
    from megatron.training import level_summary
    from omnibal_ext.model.layout import parse_layout

    spec, costs = _reference()
    layout = parse_layout("Iv*4PEt|t*3L", spec, 2)
    level = level_summary.model_level(spec, layout, 2, 1, costs, searched=True)
    assert level.default_flag == "Iv*4PEt*2|t*2L"  # Megatron's: the ViT and projector first, the LLM layers even
    for report, counts in ((level.chosen, (8, 4)), (level.default, (9, 3))):
        want = _stage_sums(costs, counts)
        assert report.stage_times_s == pytest.approx(want, rel=1e-12)
        assert report.bottleneck_over_mean == pytest.approx(max(want) / (sum(want) / 2), rel=1e-12)
    line = level_summary.model_line(level)
    assert f"{max(_stage_sums(costs, (8, 4))) * 1e3:.2f} ms" in line and "Iv*4PEt*2|t*2L" in line


def test_memory_level_full_recompute_recounted():
    from megatron.training import level_summary
    from omnibal_ext.memory.recompute import MIXED_BF16_ADAM, plan_recompute
    from omnibal_ext.model.layout import parse_layout

    spec, costs = _reference()
    layout = parse_layout("Iv*4PEt|t*3L", spec, 2)
    chosen = plan_recompute(costs, layout, 2**30, 2, 1, 1, 4, distributed_optimizer=False)
    level = level_summary.memory_level(layout, chosen, "none", costs, 2, 1, 1, 4, False, MIXED_BF16_ADAM)
    assert level.full.stage_time_s == pytest.approx(_stage_sums(costs, (8, 4), full_layers=True), rel=1e-12)
    assert max(chosen.stage_peak_bytes) <= 2**30 and level.recompute_flag == chosen.to_flag()
    off = level_summary.memory_level(layout, None, "full", costs, 2, 1, 1, 4, False, MIXED_BF16_ADAM)
    assert not off.adaptive and "off (the given recompute) full" in level_summary.memory_line(off)


def test_data_line_says_what_each_side_measured():
    from megatron.training import level_summary

    measured = {"pad_ratio": 0.0, "dist_ratio_llm": 0.01, "dist_ratio_vit": 0.02}
    random = {"pad_ratio": 0.2, "dist_ratio_llm": 0.3, "dist_ratio_vit": 0.4}
    line = level_summary.data_line(level_summary.DataLevel(True, measured, random))
    assert "ISF groups: pad ratio 0.000, Dist ratio LLM 0.010 / ViT 0.020" in line
    assert "random batches of the same samples: 0.200, 0.300 / 0.400" in line
    assert "no step logged" in level_summary.data_line(level_summary.DataLevel(False, None, None))


def test_model_level_without_a_default_layout_at_the_split():
    """Four virtual stages but two LLM layers: Megatron's default split does not exist; the given layout is kept."""
    from megatron.training import level_summary
    from omnibal_ext.model.layout import parse_layout

    spec, costs = _reference()
    layout = parse_layout("Iv*4PEt|t*3L", spec, 2)
    level = level_summary.model_level(spec, layout, 2, 8, costs, searched=False)
    assert level.default is None and level.chosen.stage_times_s == pytest.approx(_stage_sums(costs, (8, 4)))
    assert "(none at this split)" in level_summary.model_line(level)
