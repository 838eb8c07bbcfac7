"""ISF as the OmniBal paper states it, one sample at a time: the oracle of tests whose code groups by
``omnibal_ext.data.isf`` (a vectorised implementation: prefix sums, searchsorted, pointer doubling).

Sampling: walk a random permutation of the pool, adding samples to the current group until one more would take
its ViT items over ``qv``, its tokens over ``qt`` (or, in time, its ViT or LLM time over ``vit_time`` /
``llm_time``); then a new group starts with that sample.  Filtering: a group is kept when it reaches ``qv_min``
items or ``qt_min`` tokens (in time: ``vit_time_min`` or ``llm_time_min``); the others' samples go back to the
pool.  At most ``iters`` passes; the pass that keeps every group or none, or the last one, ends it, and its unkept
groups stay as leftover groups.  The walks are drawn as ``omnibal_ext`` draws them (one
``numpy.random.default_rng(seed).permutation`` of the pool per pass) so that the groups can be compared exactly.
"""
from __future__ import annotations

import numpy as np


def reference_isf(items, tokens, params: dict, seed: int, times=None) -> list[list[int]]:
    """Groups of sample indices: the kept groups pass by pass, then the last pass's leftovers.  params: the
    ``ISFParams`` fields as a dict; times: (ViT, LLM) per-sample time when the params have time caps."""
    items, tokens = [int(x) for x in items], [int(x) for x in tokens]
    timed = params.get("vit_time") is not None
    if timed:
        vt, lt = ([int(x) for x in t] for t in times)
    rng = np.random.default_rng(seed)
    pool = list(range(len(items)))
    kept: list[list[int]] = []
    passes = 0
    while pool:
        passes += 1
        walk = [pool[i] for i in rng.permutation(len(pool))]
        groups, group = [], []
        sums = [0, 0, 0, 0]  # items, tokens, ViT time, LLM time
        for s in walk:
            add = [items[s], tokens[s], vt[s] if timed else 0, lt[s] if timed else 0]
            caps = [params["qv"], params["qt"]] + ([params["vit_time"], params["llm_time"]] if timed else [])
            if group and any(sums[k] + add[k] > cap for k, cap in enumerate(caps)):
                groups.append(group)
                group, sums = [], [0, 0, 0, 0]
            group.append(s)
            sums = [a + b for a, b in zip(sums, add)]
        groups.append(group)

        def reaches(g):
            if timed:
                return sum(lt[s] for s in g) >= params["llm_time_min"] or sum(vt[s] for s in g) >= params["vit_time_min"]
            return sum(tokens[s] for s in g) >= params["qt_min"] or sum(items[s] for s in g) >= params["qv_min"]
        keep = [reaches(g) for g in groups]
        kept += [g for g, k in zip(groups, keep) if k]
        left = [g for g, k in zip(groups, keep) if not k]
        if all(keep) or not any(keep) or passes >= params["iters"]:
            return kept + left
        pool = [s for g in left for s in g]
    return kept


def dist_ratio(per_rank: np.ndarray) -> float:
    """OmniBal's DistRatio of (steps, ranks) loads: the mean over steps of sum(max - load) / (max * ranks)."""
    per_rank = np.asarray(per_rank, dtype=np.float64)
    top = per_rank.max(axis=1)
    return float(np.mean((top[:, None] - per_rank).sum(axis=1) / (top * per_rank.shape[1])))
