"""Balance metrics of the OmniBal paper, for one step or many.

PadRatio (inside one device's batch of B samples padded to the longest, ``t_max`` tokens)::

    sum_i (t_max - t_i) / (t_max * B)

Over several devices and steps we report padding tokens over allocated tokens (the ratio of the
sums).  A packed group (samples concatenated into one sequence) has no padding.

DistRatio (across the N data-parallel devices of one step, ``T_i`` the real tokens, or the real
ViT tiles, device i gets in the step)::

    sum_i (T_max - T_i) / (T_max * N)      (0 when T_max == 0)

averaged over steps, once for LLM tokens and once for ViT tiles.

Fill: mean per-group tokens (tiles) divided by the group cap Qt (Qv).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def dist_ratio_one(totals: Sequence[float]) -> float:
    """DistRatio of one step given each device's total (tokens or tiles)."""
    t = np.asarray(totals, dtype=np.float64)
    if t.size == 0:
        return 0.0
    m = t.max()
    return 0.0 if m <= 0 else float((m - t).sum() / (m * t.size))


def dist_ratio_matrix(totals: np.ndarray) -> float:
    """Mean DistRatio over steps; ``totals`` is (steps, devices) of per-device totals."""
    t = np.asarray(totals, dtype=np.float64)
    if t.ndim != 2:
        raise ValueError(f"dist_ratio_matrix: expected a (steps, devices) array, got shape {t.shape}")
    if t.shape[0] == 0:
        return 0.0
    m = t.max(axis=1)
    n = t.shape[1]
    waste = (m[:, None] - t).sum(axis=1)
    per_step = np.divide(waste, m * n, out=np.zeros_like(m), where=m > 0)
    return float(per_step.mean())


def pad_counts(lengths: Sequence[int]) -> tuple[int, int]:
    """(padding tokens, allocated tokens) of one padded batch: (sum(t_max - t_i), t_max * B)."""
    t = np.asarray(lengths, dtype=np.int64)
    if t.size == 0:
        return 0, 0
    m = int(t.max())
    return int(m * t.size - t.sum()), m * int(t.size)


def pad_ratio(batches: Sequence[Sequence[int]]) -> float:
    """PadRatio over padded batches (each a list of sample token counts): padding / allocated."""
    pad = alloc = 0
    for b in batches:
        p, a = pad_counts(b)
        pad += p
        alloc += a
    return pad / alloc if alloc else 0.0


def step_balance(
    tokens_per_rank: Sequence[Sequence[int]],
    tiles_per_rank: Sequence[Sequence[int]],
    packed: bool = False,
) -> dict:
    """Balance of ONE training step.

    tokens_per_rank[r] lists the LLM token counts of the samples rank r got in the step,
    tiles_per_rank[r] their ViT tile counts.  ``packed=True``: each rank's samples form one packed
    sequence (padding 0); otherwise they are padded to the rank's longest sample.
    Returns {"pad_ratio", "dist_ratio_llm", "dist_ratio_vit"}.
    """
    if len(tokens_per_rank) != len(tiles_per_rank):
        raise ValueError(
            f"step_balance: {len(tokens_per_rank)} ranks of tokens but {len(tiles_per_rank)} of tiles")
    pad = 0.0 if packed else pad_ratio(tokens_per_rank)
    return {
        "pad_ratio": float(pad),
        "dist_ratio_llm": dist_ratio_one([sum(int(x) for x in r) for r in tokens_per_rank]),
        "dist_ratio_vit": dist_ratio_one([sum(int(x) for x in r) for r in tiles_per_rank]),
    }


def step_balance_time(ids_per_rank: Sequence[Sequence[int]], sample_times) -> dict:
    """Balance of ONE training step in predicted time: ``ids_per_rank[r]`` lists the samples rank r got,
    ``sample_times`` = (ViT, LLM) predicted time of every sample (arrays indexed by sample id).
    Returns {"dist_ratio_llm_time", "dist_ratio_vit_time"} of the ranks' summed times."""
    vit, llm = (np.asarray(t, dtype=np.float64) for t in sample_times)
    ids = [np.asarray(r, dtype=np.int64) for r in ids_per_rank]
    return {"dist_ratio_llm_time": dist_ratio_one([llm[r].sum() for r in ids]),
            "dist_ratio_vit_time": dist_ratio_one([vit[r].sum() for r in ids])}


def fill(group_totals: np.ndarray, cap: float) -> float:
    """Mean group total (tokens or tiles) over the cap; 0 for no groups or a zero cap."""
    g = np.asarray(group_totals, dtype=np.float64)
    if g.size == 0 or cap <= 0:
        return 0.0
    return float(g.mean() / cap)


def evaluate_steps(
    steps: np.ndarray,
    group_tokens: np.ndarray,
    group_tiles: np.ndarray,
    group_sizes: np.ndarray,
    group_max_tokens: np.ndarray | None = None,
    qt: float | None = None,
    qv: float | None = None,
) -> dict:
    """Metrics of a step plan, vectorised.

    steps: (S, N) group ids, one row per step, one column per DP rank (full steps only).
    group_tokens/group_tiles/group_sizes: per-group totals and sample counts.
    group_max_tokens: per-group longest sample, for padded batching (None: packed, no padding).
    qt/qv: caps for the fill ratios (None: the largest group total, the capacity such a batching
    must provision).
    Returns pad_ratio, dist_ratio_llm, dist_ratio_vit, fill_llm, fill_vit, samples_per_group.
    """
    steps = np.asarray(steps, dtype=np.int64)
    if steps.ndim != 2:
        raise ValueError(f"evaluate_steps: steps must be (steps, ranks), got shape {steps.shape}")
    used = steps.ravel()
    gt = np.asarray(group_tokens, dtype=np.int64)
    gv = np.asarray(group_tiles, dtype=np.int64)
    gs = np.asarray(group_sizes, dtype=np.int64)
    if group_max_tokens is None:
        pad = 0.0
    else:
        gm = np.asarray(group_max_tokens, dtype=np.int64)
        alloc = (gm[used] * gs[used]).sum()
        pad = float((alloc - gt[used].sum()) / alloc) if alloc else 0.0
    cap_t = qt if qt is not None else (gt.max() if gt.size else 0)
    cap_v = qv if qv is not None else (gv.max() if gv.size else 0)
    return {
        "pad_ratio": pad,
        "dist_ratio_llm": dist_ratio_matrix(gt[steps]),
        "dist_ratio_vit": dist_ratio_matrix(gv[steps]),
        "fill_llm": fill(gt, cap_t),
        "fill_vit": fill(gv, cap_v),
        "samples_per_group": float(gs.mean()) if gs.size else 0.0,
    }


def time_metrics(steps: np.ndarray, group_vit_time: np.ndarray, group_llm_time: np.ndarray,
                 vit_cap: float | None = None, llm_cap: float | None = None) -> dict:
    """Balance of a step plan in predicted time (ISF at native resolution).

    steps: (S, N) group ids as in ``evaluate_steps``; group_vit_time/group_llm_time: per-group predicted ViT-side
    and LLM-side time (any unit). Returns dist_ratio_vit_time, dist_ratio_llm_time, dist_ratio_time (of each
    rank's ViT + LLM time: what a step waits for when one stage runs both), fill_vit_time and fill_llm_time
    (mean group time over the cap; the largest group when no cap is given).
    """
    steps = np.asarray(steps, dtype=np.int64)
    vt = np.asarray(group_vit_time, dtype=np.float64)
    lt = np.asarray(group_llm_time, dtype=np.float64)
    return {
        "dist_ratio_vit_time": dist_ratio_matrix(vt[steps]),
        "dist_ratio_llm_time": dist_ratio_matrix(lt[steps]),
        "dist_ratio_time": dist_ratio_matrix((vt + lt)[steps]),
        "fill_vit_time": fill(vt, vit_cap if vit_cap is not None else (vt.max() if vt.size else 0)),
        "fill_llm_time": fill(lt, llm_cap if llm_cap is not None else (lt.max() if lt.size else 0)),
    }


def random_rebatch_balance(
    tokens: Sequence[Sequence[Sequence[int]]],
    tiles: Sequence[Sequence[Sequence[int]]],
    rng: np.random.Generator,
) -> dict:
    """What Megatron's default batching would have given on the samples of ONE training step.

    ``tokens[r][j]`` lists the LLM tokens of the samples that data-parallel rank r trained in its micro-batch j,
    ``tiles[r][j]`` their ViT tiles.  All the step's samples are shuffled (``rng``) and dealt into the same number of
    micro-batches per rank (round-robin: sizes differ by one at most), each padded to its longest sample; returns
    ``step_balance``'s keys (padded), averaged over the micro-batch index as the trainer's log averages them."""
    ranks = len(tokens)
    micro = len(tokens[0]) if ranks else 0
    pool_t = np.array([t for rank in tokens for mb in rank for t in mb], dtype=np.int64)
    pool_v = np.array([v for rank in tiles for mb in rank for v in mb], dtype=np.int64)
    if ranks == 0 or micro == 0 or pool_t.size == 0:
        return {}
    if pool_t.size != pool_v.size:
        raise ValueError(f"random_rebatch_balance: {pool_t.size} samples of tokens but {pool_v.size} of tiles")
    order = rng.permutation(pool_t.size)
    slots = ranks * micro  # slot s = micro-batch s // ranks of rank s % ranks
    per_step = []
    for j in range(micro):
        picks = [order[(j * ranks + r)::slots] for r in range(ranks)]
        per_step.append(step_balance([pool_t[p].tolist() for p in picks], [pool_v[p].tolist() for p in picks]))
    return {k: sum(s[k] for s in per_step) / micro for k in per_step[0]}
