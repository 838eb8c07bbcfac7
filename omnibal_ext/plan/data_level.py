"""The data level: ISF thresholds and the micro-batches of sampled iterations under each batching.

Megatron's default: ``K`` random samples per micro-batch padded to the longest of them (tiles: the
K samples' tiles; LLM tokens ``K * longest``; attention ``K * longest^2``).  ISF: one packed group
per micro-batch (its tiles, its tokens, ``sum(len_i^2)`` of its samples), steps in the balanced
order the sampler serves.

Context parallelism (``cp`` > 1): the trainer pads every sample of a micro-batch to a multiple of 2 x CP tokens
(2 x CP x TP with sequence parallelism: ``sp_tp`` = TP, else 1) and splits it over the CP ranks
(``omnibal_ext.model.cp_split``); the shapes here then hold the padded figures (tokens: ``sum(padded)``, attention:
``sum(padded^2)``) and ``MicroBatchShape(..., cp=cp)`` gives the cost model one rank's share of them.  The ISF
search and grouping count the padded tokens too (``SearchConfig.token_multiple``): Qt caps CP x a rank's tokens,
Qv the tiles of the micro-batch.

Native resolution (a family whose ViT items vary in cost, ``Family.native_resolution``; stats listing each sample's
images): ISF groups in predicted time as the trainer does (``data/search_time.py``), each sample's ViT and LLM time
from ``model.sample_time.isf_sample_times`` of the plan's model on its device at the configuration's TP (the
trainer's time model; ``--omnibal-isf-time-device`` carries the device), the count caps hard caps; the data plan's
params hold the time thresholds and its metrics the DistRatio in time beside the counts'.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..data.search import SearchConfig, run_isf, random_baseline, random_group_totals, step_matrix_epoch0
from ..data.search_time import run_isf_in_time, random_baseline_time
from ..data.stats import SampleStats
from ..model.cost_model import MicroBatchShape
from ..model.cp_split import cp_multiple, padded_lengths
from ..model.sample_time import SampleWork, isf_sample_times, sample_work, with_tokens
from ..model.units import family_of
from .config import PlanConfig, PlanError

SHAPE_FIELDS = ("tiles", "llm_tokens", "llm_attn_tokens_sq")  # the three columns of a micro-batch shape


@dataclass(frozen=True)
class Loads:
    """Micro-batches of sampled iterations: ``shape[i, r, mb] = (tiles, LLM tokens, sum len^2)``
    (padded where the batching pads), ``real_tokens`` and ``samples`` (i, r, mb)."""

    shape: np.ndarray
    real_tokens: np.ndarray
    samples: np.ndarray

    @property
    def mean_shape(self) -> np.ndarray:
        return self.shape.reshape(-1, 3).mean(axis=0)


def grouped_in_time(config: PlanConfig) -> bool:
    """Whether the plan's ISF groups in predicted time (a family whose ViT items vary in cost, as the trainer
    decides: ``sample_time.isf_sample_times``); its data level then depends on the TP."""
    return family_of(config.spec).native_resolution


def _search_config(dp: int, config: PlanConfig, sp_tp: int) -> SearchConfig:
    return SearchConfig(dp_size=dp, samples_per_group=float(config.samples_per_group),
                        max_seq_len=config.max_seq_length, seed=config.seed,
                        max_candidates=config.isf_max_candidates, search_samples=config.isf_search_samples,
                        token_multiple=cp_multiple(int(config.cp), sp_tp))


def sample_work_of(stats: SampleStats, config: PlanConfig) -> SampleWork | None:
    """The samples' work (``sample_time.sample_work``: ViT items, segments, tokens) where the plan groups in time,
    computed once for every TP tried; None where it groups by counts."""
    return sample_work(stats, config.spec) if grouped_in_time(config) else None


def isf_times_at(stats: SampleStats, config: PlanConfig, tp: int, sp_tp: int = 1, work: SampleWork | None = None):
    """(ViT items, (ViT, LLM) predicted time units) of every sample at TP ``tp`` on the plan's device, tokens as ISF
    counts them (``isf_for_ranks``), or None where ISF groups by counts; ``work``: ``sample_work_of``'s (else computed)."""
    tokens = _search_config(1, config, sp_tp).counted_tokens(stats.tokens)
    return isf_sample_times(dataclasses.replace(stats, tokens=tokens), config.spec, config.device_spec, tp,
                            work=None if work is None else with_tokens(work, tokens))


def isf_for_ranks(stats: SampleStats, dp: int, config: PlanConfig, sp_tp: int = 1, tp: int = 1,
             work: SampleWork | None = None):
    """ISF thresholds and groups for ``dp`` data-parallel ranks (``data.search.run_isf``); under CP on the padded
    token counts (each sample to a multiple of 2 x CP x ``sp_tp``): Qt caps and the assembly balances the per-rank
    tokens x CP.  Native resolution: in predicted time at TP ``tp`` (``data.search_time.run_isf_in_time``; module
    docstring; ``work``: ``sample_work_of``'s)."""
    search = _search_config(dp, config, sp_tp)
    timed = isf_times_at(stats, config, tp, sp_tp, work)
    if timed is None:
        return run_isf(stats.vit, stats.tokens, search)
    return run_isf_in_time(timed[0], search.counted_tokens(stats.tokens), timed[1], search)


def random_metrics(stats: SampleStats, config: PlanConfig, dp: int, tp: int, sp_tp: int = 1,
                   work: SampleWork | None = None) -> dict:
    """Random batching's metrics (``data.search.random_baseline``), with its DistRatio in time where the plan groups
    in time (``random_baseline_time``, the times of ``isf_times_at``)."""
    k, seed = int(config.samples_per_group), config.seed
    timed = isf_times_at(stats, config, tp, sp_tp, work)
    if timed is None:
        return random_baseline(stats.vit, stats.tokens, dp, k, seed)
    return random_baseline_time(stats.vit, stats.tokens, timed[1], dp, k, seed)


def _member_lengths(stats: SampleStats, grouping, cp: int, sp_tp: int = 1) -> np.ndarray:
    """Token counts of the groups' members (padded as the trainer pads them under CP), float64."""
    return padded_lengths(stats.tokens[grouping.members], cp, sp_tp).astype(np.float64)


def group_sq_tokens(stats: SampleStats, grouping, cp: int = 1, sp_tp: int = 1) -> np.ndarray:
    """Per ISF group, the sum of its samples' squared token counts (tokens^2; under CP of the padded counts)."""
    if not len(grouping):
        return np.zeros(0)
    return np.add.reduceat(_member_lengths(stats, grouping, cp, sp_tp) ** 2, grouping.offsets[:-1])


def group_llm_tokens(stats: SampleStats, grouping, cp: int = 1, sp_tp: int = 1) -> np.ndarray:
    """Per ISF group, the LLM tokens the trainer runs: its tokens, padded per sample under CP."""
    if cp == 1 or not len(grouping):
        return grouping.tokens.astype(np.float64)
    return np.add.reduceat(_member_lengths(stats, grouping, cp, sp_tp), grouping.offsets[:-1])


def mean_isf_group(stats: SampleStats, grouping, cp: int = 1, sp_tp: int = 1) -> tuple[np.ndarray, float]:
    """(mean (tiles, tokens, sum len^2) of an ISF group (CP: padded), mean samples per group)."""
    shape = np.array([grouping.tiles.mean(), float(np.mean(group_llm_tokens(stats, grouping, cp, sp_tp))),
                      float(np.mean(group_sq_tokens(stats, grouping, cp, sp_tp)))])
    return shape, float(grouping.sizes.mean())


def cap_shape(params, stats: SampleStats, cp: int = 1, sp_tp: int = 1, segments=None) -> MicroBatchShape:
    """The largest micro-batch the ISF caps allow: Qv tiles, Qt tokens, attention ``min(Qt, longest) * Qt``.

    Under CP (``cp`` > 1) the ISF plan counted each sample's tokens padded to a multiple of 2 CP (x TP with sequence
    parallelism, ``sp_tp``; ``isf_for_ranks``), so Qt caps the padded tokens; the longest sample is padded, and the shape
    is split over ``cp`` ranks (``MicroBatchShape.cp``). segments: the data's ViT segments per item
    (``model.sample_time.VisionSegments``), at their largest (None: the family's default)."""
    longest = int(stats.tokens.max()) if len(stats) else 0
    qt = int(params.qt)
    if cp > 1:
        longest = int(padded_lengths([longest], cp, sp_tp)[0])
    vit_sq = {} if segments is None else segments.shape_sq(params.qv, mean=False)
    return MicroBatchShape(int(params.qv), qt, llm_attn_tokens_sq=float(min(qt, longest)) * qt, cp=cp, **vit_sq)


def shape_of(v: np.ndarray, cp: int = 1, segments=None) -> MicroBatchShape:
    """A (tiles, tokens, sum len^2) vector as a MicroBatchShape split over ``cp`` ranks (rounded; attention at most
    tokens^2; ``segments``: the data's mean ViT segments per item)."""
    tiles, tokens = int(round(v[0])), int(round(v[1]))
    vit_sq = {} if segments is None else segments.shape_sq(tiles, mean=True)
    return MicroBatchShape(tiles, tokens, llm_attn_tokens_sq=float(min(v[2], float(tokens) ** 2)), cp=cp, **vit_sq)


def shape_dict(v: np.ndarray) -> dict:
    """A (tiles, tokens, sum len^2) vector as the JSON's dict."""
    return dict(zip(SHAPE_FIELDS, v.tolist()))


def iteration_steps(num_steps: int, m: int, iterations: int) -> np.ndarray:
    """(iterations, m) step indices: ``iterations`` runs of m consecutive steps spread over the epoch
    (indices wrap around when the epoch holds fewer steps)."""
    starts = np.floor(np.arange(iterations) * num_steps / iterations).astype(np.int64)
    return (starts[:, None] + np.arange(m)[None, :]) % num_steps


def sampled_loads(group_shape: np.ndarray, group_real: np.ndarray, group_samples: np.ndarray, steps: np.ndarray,
                  m: int, iterations: int) -> Loads:
    """Loads of sampled iterations from per-group arrays and a (steps, dp) matrix of group ids."""
    if len(steps) == 0:
        raise PlanError(f"the data make no full step of {steps.shape[1]} data-parallel micro-batches; "
                        "give more samples or fewer GPUs")
    it = iteration_steps(len(steps), m, iterations)  # (I, m)
    g = steps[it]  # (I, m, dp)
    g = np.transpose(g, (0, 2, 1))  # (I, dp, m)
    return Loads(group_shape[g].astype(np.float64), group_real[g].astype(np.float64),
                 group_samples[g].astype(np.float64))


def random_loads(stats: SampleStats, k: int, dp: int, m: int, iterations: int,
                 seed: int, cp: int = 1, sp_tp: int = 1) -> tuple[Loads, np.ndarray, np.ndarray]:
    """Megatron's random batching: (loads of sampled iterations, mean and worst (tiles, padded tokens,
    padded sum len^2) over every micro-batch of the epoch).  Under CP the padded row is rounded up to a multiple
    of 2 x CP (x ``sp_tp``; one segment per row: the sample and its padding)."""
    gt, gv, gmax, sizes = random_group_totals(stats.vit, stats.tokens, k, seed)
    width = padded_lengths(gmax, cp, sp_tp).astype(np.float64)
    padded = (sizes * width).astype(np.float64)
    shape = np.stack([gv.astype(np.float64), padded, sizes * width ** 2], axis=1)
    full = len(gt) // dp
    steps = np.arange(full * dp).reshape(full, dp)
    return sampled_loads(shape, gt, sizes, steps, m, iterations), shape.mean(axis=0), shape.max(axis=0)


def isf_loads(stats: SampleStats, data_plan, m: int, iterations: int, seed: int, cp: int = 1,
              sp_tp: int = 1) -> Loads:
    """ISF: one packed group per micro-batch, steps in the balanced order the sampler serves (CP: padded)."""
    g = data_plan.grouping
    shape = np.stack([g.tiles.astype(np.float64), group_llm_tokens(stats, g, cp, sp_tp),
                      group_sq_tokens(stats, g, cp, sp_tp)], axis=1)
    steps = step_matrix_epoch0(len(g), data_plan.assembly.width, data_plan.assembly.order, seed)
    real = g.tokens if cp == 1 or not len(g) else np.add.reduceat(stats.tokens[g.members], g.offsets[:-1])
    return sampled_loads(shape, real, g.sizes, steps, m, iterations)
