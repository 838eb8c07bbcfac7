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
