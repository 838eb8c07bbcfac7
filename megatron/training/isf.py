"""ISF in the trainer: group the training set so that each micro-batch is one balanced pack.

A family whose ViT items vary in cost (``Family.native_resolution``) is grouped in predicted time
(``omnibal_ext/data/search_time.py``): each sample's ViT-side and LLM-side time from the cost model of the run's
model at its TP on --omnibal-isf-time-device (``sample_time.isf_sample_times``, the time model of `omnibal plan`),
each image's patch grid from the pre-training scan; the count caps stay hard caps (--omnibal-isf-qv/-qt when given,
else searched).  With the time thresholds given (--omnibal-isf-vit-time/-llm-time: `omnibal plan` writes them)
the groups are made with them as given, nothing searched.  Other families are grouped by counts
(``omnibal_ext/data/search.py``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from omnibal_ext.data.assign import assemble_steps
from omnibal_ext.data.isf import ISFParams, check_partition, isf_group
from omnibal_ext.data.search import IsfResult, SearchConfig, run_isf
from omnibal_ext.data.cli import bound_line
from omnibal_ext.data.search_time import run_isf_in_time, sample_bound
from omnibal_ext.model.cost_model import get_device
from omnibal_ext.model.cp_split import rank_vit_budget, video_fit
from omnibal_ext.model.sample_time import isf_sample_times
from omnibal_ext.model.units import ModelSpec, family_of

from megatron.vlm.data.energon.dataset import EnergonSource

from .config import RunConfig
from .flags import ArgumentError


@dataclass(frozen=True)
class MeanGroup:
    """The mean ISF group of a run: what a micro-batch costs on average (tokens as ISF counts them)."""

    tiles: float
    """ViT items per group (tiles, or patches at native resolution)."""
    tokens: float
    """LLM tokens per group."""
    attn_tokens_sq: float
    """Sum of the squared sample lengths per group, tokens^2 (packed attention's cost)."""


@dataclass(frozen=True)
class IsfGroups:
    """The training set grouped by ISF (``isf_groups``): one group per micro-batch."""

    groups: list[np.ndarray]
    """Sample indices of each group."""
    order: np.ndarray
    """The balanced step order of the groups."""
    params: ISFParams
    """The caps the groups keep (given or searched; memory is planned for them)."""
    mean_group: MeanGroup


def search_config(config: RunConfig) -> SearchConfig:
    """The ISF search's settings of this run (tokens counted to ``balance.isf_token_multiple``)."""
    return SearchConfig(dp_size=config.parallel.data_parallel_size, samples_per_group=config.optim.micro_batch_size,
                        seed=config.optim.seed, time_budget_s=math.inf,
                        token_multiple=config.balance.isf_token_multiple)


def check_samples_fit_caps(config: RunConfig, spec: ModelSpec, dataset) -> None:
    """Refuse fixed ISF caps below a single sample, naming the sample's ``file:line``, its size and the flag
    to raise (ISF itself would stop with sample indices only, on rank 0 alone), and under CP a video over one
    rank's share of --omnibal-isf-qv (``check_videos_fit_cp_ranks``).  Runs on every rank."""
    fixed = config.balance.isf_fixed_params
    if fixed is None:
        return  # searched caps hold the largest sample
    qv, qt = fixed.qv, fixed.qt
    tokens, tiles = dataset.sample_lengths()
    m = config.balance.isf_token_multiple
    counted, token_unit = search_config(config).counted_tokens(tokens), \
        "tokens" if m == 1 else f"tokens padded to a multiple of {m}"
    for flag, cap, sizes, unit in (("--omnibal-isf-qt", qt, counted, token_unit),
                                   ("--omnibal-isf-qv", qv, tiles, dataset.config.images.unit)):
        over = np.flatnonzero(sizes > cap)
        if len(over):
            i = int(over[np.argmax(sizes[over])])
            raise ArgumentError(
                f"{flag} {cap} is below a single sample: {dataset.where(i)} has {int(sizes[i])} {unit} "
                f"({len(over)} sample(s) over the cap, largest {int(sizes[i])}); raise {flag} to at least "
                f"{int(sizes[i])}")
    # a cap memory was planned for (a searched one holds the largest sample)
    check_videos_fit_cp_ranks(config.parallel.context_parallel_size, spec, dataset, qv)


def check_videos_fit_cp_ranks(cp: int, spec: ModelSpec, dataset, vit_cap: int) -> None:
    """Under context parallelism (``cp`` ranks) a family whose images and videos go whole to the CP ranks
    (``Family.native_resolution``) gives each rank its share of a micro-batch's ViT cap (``cp_split.rank_vit_budget``):
    a video over it is refused, naming its ``file:line``, its size and the ``--video-max-frames`` /
    ``--video-max-pixels`` values that would fit it (``cp_split.video_fit``).  Runs on every rank (the same data, the
    same answer)."""
    stats = dataset.sample_stats()
    videos = stats.videos
    if cp == 1 or videos is None or not len(videos.patches) or not family_of(spec).native_resolution:
        return
    budget = rank_vit_budget(vit_cap, cp)
    over = np.flatnonzero(videos.patches > budget)
    if not len(over):
        return
    k = int(over[np.argmax(videos.patches[over])])
    sample = int(np.searchsorted(videos.offsets, k, side="right") - 1)
    frames, temporal, patches = int(videos.frames[k]), int(videos.temporal[k]), int(videos.patches[k])
    vs = dataset.config.videos.settings
    max_frames, max_pixels = video_fit(frames, temporal, patches, budget, vs.temporal_patch_size, vs.min_pixels,
                                       vs.patch_size, vs.merge_size)
    fits = [f"--video-max-frames {max_frames}" if max_frames else None,
            f"--video-max-pixels {max_pixels}" if max_pixels else None]
    fits = " or ".join(f for f in fits if f) or "fewer frames and pixels"
    raise ArgumentError(
        f"{dataset.where(sample)}: a video of {frames} frames ({temporal} temporal patches, {patches} patches) is "
        f"longer than one context-parallel rank's ViT budget ({budget} patches: the ViT cap {vit_cap} over "
        f"--context-parallel-size {cp}; {len(over)} video(s) over it); videos go whole to one rank: pass {fits}, "
        f"or raise --omnibal-isf-qv to at least {patches * cp}")


def isf_times(config: RunConfig, dataset, spec: ModelSpec, counted_tokens: np.ndarray) -> tuple[np.ndarray, tuple] | None:
    """(ViT items int64 [N], (ViT, LLM) predicted time int64 [N] each, ``sample_time.TIME_UNIT_S`` units) of every
    sample for ISF in time (``sample_time.isf_sample_times`` on --omnibal-isf-time-device at the run's TP; LLM time
    of ``counted_tokens``: ISF's count of each sample), or None for a family whose ViT items cost alike (grouped by
    counts)."""
    stats = dataclasses.replace(dataset.sample_stats(), tokens=counted_tokens)
    return isf_sample_times(stats, spec, get_device(config.balance.isf_time_device),
                            tp=config.parallel.tensor_model_parallel_size,
                            grids=dataset.image_grids())


def run_sample_times(config: RunConfig, spec: ModelSpec, dataset) -> tuple[np.ndarray, np.ndarray] | None:
    """(ViT, LLM) predicted time of every training sample (``isf_times``, tokens as ISF counts them) for the
    per-iteration Dist ratios in time, with or without --omnibal-isf; None for a family grouped by counts."""
    if isinstance(dataset, EnergonSource):  # no scan: each micro-batch carries its samples' times
        return None
    timed = isf_times(config, dataset, spec, search_config(config).counted_tokens(dataset.sample_lengths()[0]))
    return None if timed is None else timed[1]


def search_isf(config: RunConfig, spec: ModelSpec, dataset) -> IsfResult:
    """The run's ISF result (thresholds searched unless fixed, groups, balanced step order, metrics): in predicted
    time for a family with ``isf_times``, with --omnibal-isf-qv/-qt as the hard count caps and the time thresholds
    as given when the flags give them (a plan's: nothing searched); else by counts."""
    tokens, tiles = dataset.sample_lengths()
    cfg = search_config(config)
    tokens = cfg.counted_tokens(tokens)
    timed = isf_times(config, dataset, spec, tokens)
    fixed = config.balance.isf_fixed_params
    if timed is None:
        if fixed is not None and fixed.timed:
            raise ArgumentError(f"--omnibal-isf-vit-time/--omnibal-isf-llm-time: {spec.name}'s ViT items "
                                "cost alike, so ISF groups by counts; drop the time thresholds")
        return run_isf(tiles, tokens, cfg, fixed)
    if fixed is not None and fixed.timed:
        return run_isf_in_time(timed[0], tokens, timed[1], cfg, fixed)
    if fixed is not None:
        cfg = dataclasses.replace(cfg, vit_cap=fixed.qv, max_seq_len=fixed.qt)
    return run_isf_in_time(timed[0], tokens, timed[1], cfg)


def report_line(num_samples: int, num_groups: int, params: dict, m: dict) -> str:
    """The trainer's ISF line: the caps and the planned balance (DistRatio and fill, in time too when grouped in
    time)."""
    line = (f"> ISF: {num_samples} samples -> {num_groups} groups, params {params}; "
            f"planned dist ratio llm {m['dist_ratio_llm']:.4f} vit {m['dist_ratio_vit']:.4f}, "
            f"fill llm {m['fill_llm']:.3f} vit {m['fill_vit']:.3f}, ")
    if "dist_ratio_llm_time" in m:
        line += (f"in time: dist ratio llm {m['dist_ratio_llm_time']:.4f} vit {m['dist_ratio_vit_time']:.4f} "
                 f"total {m['dist_ratio_time']:.4f}, fill llm {m['fill_llm_time']:.3f} vit {m['fill_vit_time']:.3f}, ")
    return line + f"{m['samples_per_group']:.2f} samples/group"


def isf_groups(config: RunConfig, spec: ModelSpec, dataset) -> IsfGroups:
    """The training set (``dataset``, of the model ``spec``) grouped by ISF, in a balanced step order.

    Rank 0 searches (thresholds, grouping, step assembly) and broadcasts the result, so every
    rank trains the same groups whatever its speed (the search is bounded by a candidate count,
    not by time, and is deterministic for a seed anyway).  Nothing is dropped or duplicated
    (checked).
    """
    check_samples_fit_caps(config, spec, dataset)
    box = [None]
    if dist.get_rank() == 0:
        result = search_isf(config, spec, dataset)
        tokens = search_config(config).counted_tokens(dataset.sample_lengths()[0])
        check_partition(result.grouping, len(dataset))
        g = result.grouping
        times = run_sample_times(config, spec, dataset) if g.vit_time is not None else None
        box = [{"groups": g.groups(), "order": result.assembly.order, "params": result.params,
                "mean_group": MeanGroup(tiles=float(g.tiles.mean()), tokens=float(g.tokens.mean()),
                                        attn_tokens_sq=float((tokens.astype(float) ** 2).sum() / len(g))),
                "metrics": result.metrics,
                "bound": None if times is None else sample_bound(times, g, config.parallel.data_parallel_size)}]
    dist.broadcast_object_list(box, src=0)
    found = box[0]
    if dist.get_rank() == 0:
        print(report_line(len(dataset), len(found["groups"]), found["params"].to_dict(), found["metrics"]), flush=True)
        if found["bound"] is not None:
            print(f"> ISF {bound_line(found['bound'], describe_sample(dataset, found['bound']['sample']))}",
                  flush=True)
    return IsfGroups(found["groups"], found["order"], found["params"], found["mean_group"])


def describe_sample(dataset, index: int) -> str:
    """``file:line`` of sample ``index``, with its videos (frames, patches) when it has any."""
    videos = dataset.sample_stats().videos
    where = dataset.where(index)
    if videos is None or videos.offsets[index] == videos.offsets[index + 1]:
        return where
    k = range(int(videos.offsets[index]), int(videos.offsets[index + 1]))
    return where + " (" + ", ".join(f"a video of {int(videos.frames[j])} frames, {int(videos.patches[j])} patches"
                                    for j in k) + ")"


def isf_subset_groups(tokens: np.ndarray, tiles: np.ndarray, sample_ids: np.ndarray, params: ISFParams,
                      dp_size: int, seed: int, times: tuple | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """(groups, balanced step order) of the samples ``sample_ids`` only, by ISF with ``params``.

    tokens, tiles: int64 [N] per sample of the whole training set (tokens as ISF counts them:
    ``SearchConfig.counted_tokens``; tiles: ViT items); groups hold global sample ids.  times: (ViT, LLM) int64
    [N] predicted times (``isf_times``) when ``params`` have time caps: grouped and assembled in time.
    The same method as the run's plan (its caps, step assembly for ``dp_size`` ranks), on a subset.
    """
    ids = np.asarray(sample_ids, dtype=np.int64)
    sub_times = None if times is None else tuple(np.asarray(t)[ids] for t in times)
    grouping = isf_group(np.asarray(tiles)[ids], np.asarray(tokens)[ids], params, seed=seed, sample_ids=ids,
                         times=sub_times)
    if times is None:
        assembly = assemble_steps(grouping.tokens, grouping.tiles, dp_size)
    else:
        assembly = assemble_steps(grouping.llm_time, grouping.vit_time, dp_size)
    return grouping.groups(), assembly.order


def isf_regroup(config: RunConfig, spec: ModelSpec, dataset, params: ISFParams):
    """``regroup(sample_ids) -> (groups, order)`` for the sampler: ISF on a subset with this run's caps ``params``
    (``isf_groups``').

    Used when a checkpoint's epoch is continued under another data-parallel size: its unserved
    samples are grouped for this run.  Collective: rank 0 groups and broadcasts, every rank must call
    it (``load_state_dict`` runs on every rank).
    """
    def regroup(sample_ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        box = [None]
        if dist.get_rank() == 0:
            tokens, tiles = dataset.sample_lengths()
            tokens = search_config(config).counted_tokens(tokens)
            timed = isf_times(config, dataset, spec, tokens)
            if timed is not None:
                tiles, times = timed
            box = [isf_subset_groups(tokens, tiles, sample_ids, params, config.parallel.data_parallel_size,
                                     config.optim.seed, None if timed is None else times)]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return regroup
