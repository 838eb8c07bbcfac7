"""GroupBatchSampler: coverage per epoch, carried steps, rank agreement, resume (omnibal_ext.data.sampler)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibal_ext.data.assign import assemble_steps
from omnibal_ext.data.metrics import dist_ratio_matrix
from omnibal_ext.data.sampler import GroupBatchSampler, epoch_stream, random_groups

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_groups(G: int, seed: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """G disjoint groups of 1..4 samples with random token/tile totals."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, G)
    perm = rng.permutation(int(sizes.sum()))
    groups = np.split(perm, np.cumsum(sizes)[:-1]) if G else []
    return groups, rng.integers(100, 5000, G), rng.integers(0, 20, G)


def serve(groups, dp, seed, order, steps, sp=1, mb=1):
    """Run every consumer's sampler for ``steps`` steps; rows = steps, columns = consumers' groups."""
    index = {tuple(g.tolist()): i for i, g in enumerate(groups)}
    cols = []
    for r in range(dp):
        for s in range(sp):
            smp = GroupBatchSampler(groups, dp, r, seed=seed, order=order, num_steps=steps, sp=sp, sp_rank=s,
                                    microbatches=mb)
            cols.append([index[tuple(b)] for b in smp])
    return np.array(cols).T


@SETTINGS
@given(G=st.integers(1, 60), dp=st.sampled_from([1, 2, 3, 8]), seed=st.integers(0, 10_000),
       balanced=st.booleans(), sp=st.sampled_from([1, 2]), mb=st.sampled_from([1, 3]))
def test_every_group_once_per_epoch(G, dp, seed, balanced, sp, mb):
    groups, tok, til = make_groups(G, seed)
    order = assemble_steps(tok, til, dp, sp).order if balanced else None
    W = dp * sp
    epochs = 3
    steps = -(-epochs * G // W) + 1
    served = serve(groups, dp, seed, order, steps, sp, mb)
    stream = served.reshape(-1)  # step by step, consumer by consumer
    for e in range(epochs):  # each run of G consecutive servings is one epoch: all groups once
        assert sorted(stream[e * G:(e + 1) * G].tolist()) == list(range(G))
    if G >= 2 * W * mb:  # a step never holds a group twice, carried boundary steps included
        assert all(len(set(row)) == W for row in served.tolist())
    # every consumer's sampler agrees with the global step plan
    ref = GroupBatchSampler(groups, dp, 0, seed=seed, order=order, sp=sp, microbatches=mb)
    assert all(np.array_equal(ref.step_groups(s), served[s]) for s in range(steps))


@SETTINGS
@given(G=st.integers(1, 50), dp=st.sampled_from([1, 2, 3, 8]), seed=st.integers(0, 10_000),
       balanced=st.booleans(), cut=st.integers(0, 40), rank=st.integers(0, 7))
def test_resume_mid_epoch_gives_identical_batches(G, dp, seed, balanced, cut, rank):
    rank %= dp
    groups, tok, til = make_groups(G, seed)
    order = assemble_steps(tok, til, dp).order if balanced else None
    a = GroupBatchSampler(groups, dp, rank, seed=seed, order=order)
    it = iter(a)
    for _ in range(cut):
        next(it)
    state = a.state_dict()
    expected = [next(it) for _ in range(12)]
    b = GroupBatchSampler(groups, dp, rank, seed=seed, order=order)
    b.load_state_dict(state)
    assert list(itertools.islice(iter(b), 12)) == expected
    # a sampler over other groups, without a regroup function, refuses the state
    with pytest.raises(ValueError, match="differs from this run's"):
        GroupBatchSampler(groups + [np.array([10**6])], dp, rank, seed=seed).load_state_dict(state)


def test_epochs_are_reshuffled_and_seeded():
    groups, tok, til = make_groups(64, 1)
    order = assemble_steps(tok, til, 4).order
    e0, e1 = epoch_stream(64, 4, 0, 7, order), epoch_stream(64, 4, 1, 7, order)
    assert not np.array_equal(e0, e1)
    assert np.array_equal(e0, epoch_stream(64, 4, 0, 7, order))
    # balanced steps keep their composition (as sets) across epochs
    steps0 = {frozenset(r) for r in e0.reshape(-1, 4).tolist()}
    steps1 = {frozenset(r) for r in e1.reshape(-1, 4).tolist()}
    assert steps0 == steps1 == {frozenset(order[i:i + 4].tolist()) for i in range(0, 64, 4)}


def test_balanced_stream_is_balanced_including_carried_steps():
    rng = np.random.default_rng(2)
    G, W = 1003, 8  # not a multiple: every epoch boundary has a carried step
    tok = rng.integers(4600, 5000, G)  # like ISF groups: near the token cap, tiles spread
    til = rng.integers(10, 19, G)
    order = assemble_steps(tok, til, W).order
    groups = [np.array([i]) for i in range(G)]
    smp = GroupBatchSampler(groups, W, 0, seed=3, order=order)
    steps = np.array([smp.step_groups(s) for s in range(3 * G // W)])
    assert dist_ratio_matrix(tok[steps]) < 0.01 and dist_ratio_matrix(til[steps]) < 0.01
    rnd = GroupBatchSampler(groups, W, 0, seed=3)
    steps_r = np.array([rnd.step_groups(s) for s in range(3 * G // W)])
    assert dist_ratio_matrix(til[steps_r]) > 0.1


def test_num_steps_bounds_iteration_and_len():
    groups = random_groups(10, 3, seed=0)
    smp = GroupBatchSampler(groups, 2, 1, seed=0, num_steps=5)
    assert len(smp) == 5 and len(list(smp)) == 5 and len(smp) == 0
    assert GroupBatchSampler(groups, 2, 0).steps_per_epoch == 2.0


def test_random_groups_partition():
    gs = random_groups(103, 4, seed=9)
    flat = np.concatenate(gs)
    assert sorted(flat.tolist()) == list(range(103)) and [len(g) for g in gs[:-1]] == [4] * 25
    assert len(gs[-1]) == 3
    assert all(np.array_equal(a, b) for a, b in zip(gs, random_groups(103, 4, seed=9)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="dp_rank"):
        GroupBatchSampler([np.array([0])], 2, 2)
    with pytest.raises(ValueError, match="no groups"):
        GroupBatchSampler([], 2, 0)
    with pytest.raises(ValueError, match="permutation"):
        GroupBatchSampler([np.array([0]), np.array([1])], 1, 0, order=np.array([0, 0]))
