"""ISF threshold search in predicted time (native resolution): the counterpart of ``search.py`` for groups
balanced in time.

Given per-sample ViT items (tiles or patches), tokens and predicted ViT and LLM times (integer units,
``model/sample_time.py``), the search picks the time caps and lower bounds; the counts stay hard caps (memory
is planned for them: ``max_seq_len`` / ``vit_cap`` when given, else twice / two and a half times the target
group's mean tokens / ViT items, never below the largest sample). Candidates run on a random subset, are
grouped by ISF in time, assembled into balanced steps by their times, and scored::

    score = dist_ratio_llm_time + dist_ratio_vit_time + 4 * max(0, min_fill - fill_llm_time)
            + 0.05 * (1 - fill_vit_time) + 0.02 * |samples_per_group - K| / K

Stage 1 tries a grid of LLM-time caps (around K mean sample times) and ViT-time caps (the LLM cap at the data's
ViT/LLM time ratio, times 1, 1.2, 1.6), stage 2 the lower bounds, stage 3 the pass count: ``search.run_search``,
the one threshold search, with time caps (``SearchSpace``) in place of count caps.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .assign import DEFAULT_KEYS, StepAssembly, assemble_steps
from .isf import Grouping, ISFParams, group_sums, isf_group
from .metrics import evaluate_steps, time_metrics
from .search import (IsfResult, SearchConfig, SearchResult, SearchSpace, llm_cap_grid, random_group_totals, run_search,
                     search_subset, step_matrix_epoch0, vit_cap_grid)


def evaluate_grouping_time(g: Grouping, dp_size: int, sp: int = 1, params: ISFParams | None = None, seed: int = 0,
                           assembly: StepAssembly | None = None, keys=DEFAULT_KEYS) -> tuple[dict, StepAssembly]:
    """Metrics of groups balanced in time: steps assembled by the groups' (LLM, ViT) times; the count metrics
    of ``evaluate_steps`` plus ``time_metrics``."""
    if assembly is None:
        assembly = assemble_steps(g.llm_time, g.vit_time, dp_size, sp, keys=keys)
    steps = step_matrix_epoch0(len(g), assembly.width, assembly.order, seed)
    qt = qv = vcap = lcap = None
    if params is not None:
        qt, qv, vcap, lcap = params.qt, params.qv, params.vit_time, params.llm_time
    m = evaluate_steps(steps, g.tokens, g.tiles, g.sizes, None, qt, qv)
    m.update(time_metrics(steps, g.vit_time, g.llm_time, vcap, lcap))
    return m, assembly


def steps_time_metrics(steps: np.ndarray, g: Grouping, times) -> dict:
    """Time balance of a step plan of groups formed without times (ISF by counts): the groups' times are summed
    from the samples' ``times`` = (ViT, LLM)."""
    vt, lt = (group_sums(t, g.members, g.offsets) for t in times)
    return time_metrics(steps, vt, lt)


def random_baseline_time(vit, tokens, times, dp_size: int, k: int, seed: int = 0) -> dict:
    """``search.random_baseline`` with the time metrics of its groups (``k`` random samples per device; the
    groups' times are their samples' summed times: the real work, as its DistRatio counts real tokens)."""
    gt, gv, gm, sizes = random_group_totals(vit, tokens, k, seed)
    lt, vt, _, _ = random_group_totals(times[0], times[1], k, seed)  # the same permutation, so the same groups
    steps = step_matrix_epoch0(len(gt), dp_size, None, seed)
    m = evaluate_steps(steps, gt, gv, sizes, gm)
    m.update(time_metrics(steps, vt, lt))
    return m


def count_caps(vit: np.ndarray, tokens: np.ndarray, cfg: SearchConfig) -> tuple[int, int]:
    """(qv, qt): the hard count caps of ISF in time (module docstring)."""
    k = cfg.samples_per_group or 1.0
    qt = cfg.max_seq_len if cfg.max_seq_len is not None else max(int(tokens.max()), math.ceil(2.0 * k * tokens.mean()))
    qv = cfg.vit_cap if cfg.vit_cap is not None else max(int(vit.max()), math.ceil(2.5 * k * vit.mean()))
    return int(qv), int(qt)


def search_params_time(vit, tokens, times, cfg: SearchConfig) -> SearchResult:
    """Choose ISF-in-time thresholds for these samples (module docstring); ``times`` = (ViT, LLM) int arrays: the
    search of ``search.run_search`` over time caps, the count caps fixed."""
    vit = np.asarray(vit, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    vt_all, lt_all = (np.asarray(t, dtype=np.int64) for t in times)
    if len(vit) == 0:
        raise ValueError("search_params_time: no samples")
    if cfg.samples_per_group is None:
        raise ValueError("search_params_time: give samples_per_group (K)")
    sub = search_subset(len(vit), cfg)
    sv, st, svt, slt = vit[sub], tokens[sub], vt_all[sub], lt_all[sub]
    qv, qt = count_caps(vit, tokens, cfg)
    mean_lt, mean_vt = float(slt.mean()), float(svt.mean())

    def params(vcap, lcap, a, b, iters) -> ISFParams:
        return ISFParams(qv=qv, qt=qt, qv_min=0, qt_min=0, iters=iters, oversize=cfg.oversize, vit_time=vcap,
                         llm_time=lcap, vit_time_min=min(vcap, int(math.ceil(b * vcap))),
                         llm_time_min=int(math.ceil(a * lcap)))

    def evaluate(p: ISFParams):
        g = isf_group(sv, st, p, seed=cfg.seed, times=(svt, slt))
        m, asm = evaluate_grouping_time(g, cfg.dp_size, cfg.sp, p, seed=cfg.seed)
        return m, g, asm

    space = SearchSpace(llm_cap_grid(cfg, mean_lt, int(lt_all.max())),
                        lambda lcap: vit_cap_grid(cfg, lcap, mean_vt, mean_lt, int(vt_all.max())), params,
                        lambda p: (p["vit_time"], p["llm_time"]), evaluate, suffix="_time")
    return run_search(space, cfg, len(sv))


def run_isf_in_time(vit, tokens, times, cfg: SearchConfig, params: ISFParams | None = None) -> IsfResult:
    """Search time thresholds (unless ``params`` is given), group all samples in time and assemble steps; searched
    count caps are then lowered to the largest group's (``tight_count_caps``) where that keeps the groups."""
    vit = np.asarray(vit, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    search, t_search, keys = None, 0.0, DEFAULT_KEYS
    if params is None:
        search = search_params_time(vit, tokens, times, cfg)
        params, t_search = search.params, search.seconds
        keys = [tuple(search.best["assembly_key"]), ("tiles", 0.0)]
    t0 = time.perf_counter()
    g = isf_group(vit, tokens, params, seed=cfg.seed, times=times)
    if search is not None and len(g):
        tight = tight_count_caps(params, g)
        if same_groups(isf_group(vit, tokens, tight, seed=cfg.seed, times=times), g):
            params = tight
    m, asm = evaluate_grouping_time(g, cfg.dp_size, cfg.sp, params, seed=cfg.seed, keys=keys)
    return IsfResult(params, g, asm, m, search, time.perf_counter() - t0, t_search)


def tight_count_caps(params: ISFParams, g: Grouping) -> ISFParams:
    """``params`` with the count caps lowered to the largest group of ``g`` (what memory must be planned for).

    Within one pass the grouping stays the same (every partial sum of a group stays within its total, and a group
    that closed at a cap would close at the lower one too), but a group a filter pass dropped may be larger in counts
    than every kept one (a video costs less time per patch than an image of its patches), and the lower caps would
    change that pass: ``run_isf_in_time`` keeps them only where regrouping under them gives the same groups."""
    return dataclasses.replace(params, qv=max(params.qv_min, int(g.tiles.max())),
                               qt=max(params.qt_min, int(g.tokens.max())))


def same_groups(a: Grouping, b: Grouping) -> bool:
    """The two groupings hold the same groups in the same order."""
    ga, gb = a.groups(), b.groups()
    return len(ga) == len(gb) and all(np.array_equal(x, y) for x, y in zip(ga, gb))


def sample_bound(times, g: Grouping, dp_size: int) -> dict | None:
    """The sample that sets the bound of the step balance, or None: the sample of the largest predicted time
    (ViT + LLM, ``times`` = (ViT, LLM) per sample, indexed by sample id) when it exceeds a rank's mean step load
    (the mean group time: each rank takes one group a step).  Its rank then carries at least its time in its
    step, so that step's time DistRatio is ``(N - 1) / N * (1 - mean / time)`` with every other rank at the mean
    (``step_dist_ratio_bound``; N = ``dp_size``): the assembly cannot balance that step unless the other ranks
    carry more than the mean, so a video mix whose longest video exceeds the mean load is bound by that video,
    not by the grouping.

    Returns {"sample": id, "time": its time units, "mean_rank_load": mean group time units, "ratio": time / mean,
    "step_dist_ratio_bound": the bound above}."""
    total = np.asarray(times[0], dtype=np.int64) + np.asarray(times[1], dtype=np.int64)
    if not len(g) or not len(total):
        return None
    mean = float((group_sums(times[0], g.members, g.offsets) + group_sums(times[1], g.members, g.offsets)).mean())
    i = int(np.argmax(total))
    if not total[i] > mean:
        return None
    t = float(total[i])
    return {"sample": i, "time": int(total[i]), "mean_rank_load": mean, "ratio": t / mean,
            "step_dist_ratio_bound": (dp_size - 1) / dp_size * (1.0 - mean / t)}
