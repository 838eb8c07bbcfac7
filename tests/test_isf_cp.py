"""The ISF threshold search and grouping under context parallelism (SearchConfig.token_multiple = 2 x CP x TP with
sequence parallelism, ``cp_split.cp_multiple``): every sample counted
padded as the trainer pads it, so Qt caps, and the step assembly balances, the per-rank tokens; checked against a
brute-force split of each group over the CP ranks.  At CP 1 nothing changes."""
import numpy as np
import pytest

from omnibal_ext.data.search import SearchConfig, run_isf
from omnibal_ext.model.cp_split import cp_multiple


def data(n=600, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 7, n), rng.integers(20, 400, n)


def rank_tokens(lengths, cp, multiple):
    """Tokens of each CP rank for samples of ``lengths``, by brute force: each sample padded one token at a time to
    a multiple of ``multiple``, cut into 2 cp chunks, chunk i on rank i (i < cp) or 2 cp - 1 - i."""
    per_rank = [0] * cp
    for n in lengths:
        n = int(n)
        while n % multiple:
            n += 1
        chunk = n // (2 * cp)
        for i in range(2 * cp):
            per_rank[i if i < cp else 2 * cp - 1 - i] += chunk
    return per_rank


@pytest.mark.parametrize("cp,sp_tp", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_search_caps_and_balances_the_padded_per_rank_tokens(cp, sp_tp):
    vit, tokens = data()
    cfg = SearchConfig(dp_size=4, samples_per_group=4, seed=1, max_candidates=6,
                       token_multiple=cp_multiple(cp, sp_tp))
    plan = run_isf(vit, tokens, cfg)
    g, qt = plan.grouping, plan.params.qt
    per_rank = [rank_tokens(tokens[m], cp, 2 * cp * sp_tp) for m in g.groups()]
    for ranks, total in zip(per_rank, g.tokens):
        assert len(set(ranks)) == 1 and ranks[0] * cp == total  # every rank holds the same padded share
        assert ranks[0] <= qt / cp  # the cap holds per rank, pads included
    # the search is the CP-1 search of the padded counts: same thresholds, groups and balanced order
    padded = np.array([rank_tokens([n], cp, 2 * cp * sp_tp)[0] * cp for n in tokens])
    same = run_isf(vit, padded, SearchConfig(dp_size=4, samples_per_group=4, seed=1, max_candidates=6))
    assert plan.params == same.params
    assert [m.tolist() for m in g.groups()] == [m.tolist() for m in same.grouping.groups()]
    assert np.array_equal(plan.assembly.order, same.assembly.order)
    real = run_isf(vit, tokens, SearchConfig(dp_size=4, samples_per_group=4, seed=1, max_candidates=6))
    assert real.params.qt < qt  # the real-token search caps fewer tokens: pads are not free


def test_cp1_is_unchanged():
    vit, tokens = data(400, 3)
    base = run_isf(vit, tokens, SearchConfig(dp_size=2, samples_per_group=3, seed=0, max_candidates=5))
    one = run_isf(vit, tokens, SearchConfig(dp_size=2, samples_per_group=3, seed=0, max_candidates=5,
                                             token_multiple=cp_multiple(1, 4)))
    assert base.params == one.params and np.array_equal(base.grouping.members, one.grouping.members)
    assert np.array_equal(base.grouping.tokens, one.grouping.tokens) and base.metrics == one.metrics
