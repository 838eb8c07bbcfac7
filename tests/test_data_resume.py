"""The data position survives a checkpoint resumed under another parallel configuration.

All data-parallel ranks' samplers are simulated in one process: random batching serves the same
groups per iteration for any DP size, and a resume (same or other DP, random or ISF groups) serves
every sample of the interrupted epoch exactly once (omnibal_ext.data.sampler, megatron.training.isf).
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from megatron.training.isf import isf_subset_groups
from omnibal_ext.data.isf import ISFParams
from omnibal_ext.data.metrics import dist_ratio_matrix
from omnibal_ext.data.sampler import GroupBatchSampler, random_groups, random_regroup
from omnibal_ext.errors import UserError

N = 1500  # samples
SEED = 5
K = 3  # samples per random group
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(40, 700, N)
TILES = RNG.integers(0, 9, N)
PARAMS = ISFParams(qv=24, qt=1400, qv_min=21, qt_min=1260)


def isf_for_ranks(dp: int):
    """(groups, order, regroup) as the trainer builds them under ISF for ``dp`` ranks."""
    groups, order = isf_subset_groups(TOKENS, TILES, np.arange(N), PARAMS, dp, SEED)
    return groups, order, lambda ids: isf_subset_groups(TOKENS, TILES, ids, PARAMS, dp, SEED)


def random_plan(dp: int, k: int = K):
    return random_groups(N, k, SEED), None, random_regroup(k, SEED)


def samplers(plan, dp: int, mb: int, state: dict | None = None) -> list[GroupBatchSampler]:
    """Every rank's sampler for a run of ``dp`` ranks and ``mb`` micro-batches, loaded from ``state``."""
    groups, order, regroup = plan(dp)
    out = [GroupBatchSampler(groups, dp, r, seed=SEED, order=order, microbatches=mb, regroup=regroup)
           for r in range(dp)]
    if state is not None:
        for s in out:
            s.load_state_dict(state)
    return out


def serve(ranks: list[GroupBatchSampler], iterations: int, mb: int) -> list[np.ndarray]:
    """Groups (sample ids) served in stream order (step by step, rank by rank) over ``iterations``."""
    its = [iter(s) for s in ranks]
    return [np.asarray(next(it)) for _ in range(iterations * mb) for it in its]


def state_of(ranks: list[GroupBatchSampler]) -> dict:
    """Rank 0's state, after checking every rank's is identical (it is saved once), as a checkpoint
    returns it: through the common state's torch.save and torch.load(weights_only=True)."""
    from megatron.training.checkpointing import to_arrays, to_tensors

    states = [s.state_dict() for s in ranks]
    for other in states[1:]:
        assert other.keys() == states[0].keys()
        for key, value in states[0].items():
            assert np.array_equal(np.asarray(other[key]), np.asarray(value)) if value is not None \
                else other[key] is None, key
    saved = io.BytesIO()
    torch.save(to_tensors(states[0]), saved)
    saved.seek(0)
    return to_arrays(torch.load(saved, weights_only=True))


def counts(groups: list[np.ndarray]) -> np.ndarray:
    return np.bincount(np.concatenate(groups), minlength=N)


@pytest.mark.parametrize("G", [64, 61, 37])
def test_random_iterations_do_not_depend_on_dp(G):
    """Block of 8 groups per iteration (dp x micro-batches); epochs of G groups, also not multiples of 8."""
    groups = [np.array([i]) for i in range(G)]
    iterations = 5 * G // 8 + 2
    unions = {}
    for dp in (1, 2, 4):
        smp = GroupBatchSampler(groups, dp, 0, seed=SEED, microbatches=8 // dp)
        unions[dp] = [sorted(np.concatenate([smp.step_groups(s) for s in range(i * 8 // dp, (i + 1) * 8 // dp)]).tolist())
                      for i in range(iterations)]
    assert unions[1] == unions[2] == unions[4]
    flat = np.concatenate([smp.step_groups(s) for s in range(iterations * 2)])  # dp=4, stream order
    for e in range(5):  # the stream is still every group once per epoch
        assert sorted(flat[e * G:(e + 1) * G].tolist()) == list(range(G))


@pytest.mark.parametrize("plan", [random_plan, isf_for_ranks], ids=["random", "isf"])
def test_same_config_resume_is_exact(plan):
    dp, mb = 2, 3
    full = serve(samplers(plan, dp, mb), 40, mb)
    first = samplers(plan, dp, mb)
    head = serve(first, 15, mb)
    rest = serve(samplers(plan, dp, mb, state_of(first)), 25, mb)
    assert all(np.array_equal(a, b) for a, b in zip(head + rest, full, strict=True))


def test_random_dp_change_continues_the_same_stream():
    full = serve(samplers(random_plan, 1, 8), 30, 8)
    first = samplers(random_plan, 1, 8)
    head = serve(first, 11, 8)
    rest = serve(samplers(random_plan, 4, 2, state_of(first)), 19, 2)
    assert all(np.array_equal(a, b) for a, b in zip(head + rest, full, strict=True))


def epoch_exactly_once(before: list[np.ndarray], after: list[np.ndarray], state: dict) -> list[np.ndarray]:
    """``before`` (from the epoch's start) + the first groups of ``after`` holding ``state``'s
    unserved samples cover every sample once; returns the groups that follow."""
    n_rest = len(state["unserved"])
    sizes = np.cumsum([len(g) for g in after])
    cut = int(np.searchsorted(sizes, n_rest)) + 1
    assert sizes[cut - 1] == n_rest, "the rest of the epoch is not served first, in whole groups"
    assert np.all(counts(before + after[:cut]) == 1)
    return after[cut:]


@pytest.mark.parametrize("plan,a,b", [
    (isf_for_ranks, (2, 4), (4, 2)),  # ISF, DP 2 -> 4, same global batch
    (isf_for_ranks, (4, 1), (1, 3)),  # ISF, DP 4 -> 1, other global batch
    (random_plan, (2, 2), (2, 3)),  # random, other global batch: regrouped too
], ids=["isf-dp2-dp4", "isf-dp4-dp1", "random-gbs"])
def test_other_config_serves_the_rest_of_the_epoch_once(plan, a, b):
    (dp_a, mb_a), (dp_b, mb_b) = a, b
    first = samplers(plan, dp_a, mb_a)
    before = serve(first, 9, mb_a)  # all in epoch 0
    state = state_of(first)
    assert state["epoch"] == 0 and state["position"] == 9 * dp_a * mb_a
    second = samplers(plan, dp_b, mb_b, state)
    assert second[0].first_epoch == 1 and len(second[0].prefix_groups) > 0
    block_b = dp_b * mb_b
    G_b = len(second[0].groups)
    after = serve(second, (len(second[0].prefix_groups) + G_b) // block_b + 2, mb_b)
    following = epoch_exactly_once(before, after, state)
    assert np.all(counts(following[:G_b]) == 1)  # then a whole epoch of this run's plan
    if plan is isf_for_ranks:  # the regrouped rest is balanced across the ranks of each step, as the plan is
        steps = len(second[0].prefix_groups) // dp_b
        tokens = np.array([TOKENS[g].sum() for g in after[:steps * dp_b]]).reshape(steps, dp_b)
        regular = np.array([TOKENS[g].sum() for g in following[:(G_b // dp_b) * dp_b]]).reshape(-1, dp_b)
        assert dist_ratio_matrix(tokens) < max(0.02, 2 * dist_ratio_matrix(regular))


def test_resume_twice_inside_the_rest_of_the_epoch():
    """DP 2 -> 4 (regrouped prefix), saved inside the prefix, then resumed under DP 4 (exact) and DP 1."""
    first = samplers(isf_for_ranks, 2, 4)
    before = serve(first, 6, 4)
    s1 = state_of(first)
    second = samplers(isf_for_ranks, 4, 2, s1)
    middle = serve(second, 5, 2)
    s2 = state_of(second)
    assert s2["epoch"] == 0 and s2["epoch_started"] and len(s2["prefix_sizes"]) > 5 * 8
    # same configuration: bit-exact continuation of the prefix and what follows
    uninterrupted = serve(second, 60, 2)
    again = serve(samplers(isf_for_ranks, 4, 2, s2), 60, 2)
    assert all(np.array_equal(x, y) for x, y in zip(again, uninterrupted, strict=True))
    # another DP: the rest of the prefix is regrouped again, the epoch still served once
    third = samplers(isf_for_ranks, 1, 3, s2)
    after = serve(third, len(third[0].prefix_groups) // 3 + 2, 3)
    epoch_exactly_once(before + middle, after, s2)


def test_nothing_served_of_the_epoch_starts_it_afresh():
    first = samplers(isf_for_ranks, 2, 1)
    G = len(first[0].groups)
    if G % 2:
        pytest.skip("needs an epoch that ends on a step")
    serve(first, G // 2, 1)
    state = state_of(first)
    assert not state["epoch_started"] and state["epoch"] == 1
    second = samplers(isf_for_ranks, 4, 1, state)
    assert second[0].prefix_groups == [] and second[0].first_epoch == 1


def test_dp_change_off_an_iteration_boundary_is_refused():
    first = samplers(random_plan, 2, 2)
    serve(first, 1, 2)
    its = iter(first[0]), iter(first[1])
    next(its[0]), next(its[1])  # one more step: half an iteration
    state = state_of(first)
    with pytest.raises(UserError, match="iteration boundary"):
        samplers(random_plan, 1, 4, state)
    with pytest.raises(UserError, match="multiple of this run's 4 groups per global step"):
        samplers(random_plan, 4, 1, state)


def test_state_is_compact_and_checked():
    first = samplers(isf_for_ranks, 2, 2)
    serve(first, 3, 2)
    state = state_of(first)
    assert state["unserved"].dtype == np.int32 and state["position"] == 12
    with pytest.raises(UserError, match="version"):
        samplers(isf_for_ranks, 2, 2, {"step": 3})
    lone = GroupBatchSampler(random_groups(N, K, SEED), 2, 0, seed=SEED)  # no regroup function
    with pytest.raises(UserError, match="no regroup function"):
        lone.load_state_dict(state)
    small = GroupBatchSampler(random_groups(N // 2, K, SEED), 2, 0, seed=SEED, regroup=random_regroup(K))
    with pytest.raises(UserError, match="same training data"):
        small.load_state_dict(state)
