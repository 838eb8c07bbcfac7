"""One row of the ablation: a setting's simulated candidate as a :class:`SettingPrediction`."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..memory.recompute import format_recompute_plan
from ..model.costs import CostTable
from ..model.units import build_units
from .context import Candidate, PlanContext, allreduce_s, stage_peaks
from .results import SettingPrediction

SECONDS_PER_DAY = 86400.0


def gpu_days(samples: int, seconds_per_sample: float, gpus: int) -> float:
    """GPU-days of one epoch: ``samples * seconds per sample * gpus / 86400``."""
    return samples * seconds_per_sample * gpus / SECONDS_PER_DAY


def prediction_row(ctx: PlanContext, setting: str, batching: str, cand: Candidate, costs_mem: CostTable,
                   mean_shape: np.ndarray, samples: int, gpus: int) -> SettingPrediction:
    """The prediction of a simulated candidate; memory (and the side tensors' bytes per boundary) at ``costs_mem``'s
    shape, stage times at ``mean_shape``.

    samples: samples per epoch; gpus: GPUs in all (for GPU-days).  ``speedup`` is left at 1 (see
    :func:`with_speedups`).
    """
    units = build_units(ctx.spec)
    peaks = stage_peaks(ctx, costs_mem, cand.layout, cand.stages)
    stage_t = (mean_shape @ (cand.coefs[0] + cand.coefs[1])).reshape(ctx.pp, -1).sum(axis=1)  # per rank
    s = cand.sim
    return SettingPrediction(
        setting=setting, batching=batching, how=cand.how, layout_flag=cand.layout.to_flag(units),
        stage_units=tuple(int(x) for x in cand.layout.stage_units),
        recompute_flag=format_recompute_plan(cand.stages), stage_time_s=tuple(float(x) for x in stage_t),
        stage_peak_bytes=peaks, fits_memory=bool(max(peaks) <= ctx.budget), iteration_s=s.iteration_s,
        balanced_iteration_s=s.balanced_iteration_s, bubble_fraction=s.bubble_fraction,
        allreduce_s=allreduce_s(ctx, cand.layout), samples_per_iteration=s.samples_per_iteration,
        tokens_per_s=s.tokens_per_s, gpu_days=gpu_days(samples, s.seconds_per_sample, gpus), vpp=cand.vpp,
        boundary_side_bytes=boundary_side_bytes(costs_mem, cand.layout))


def boundary_side_bytes(costs: CostTable, layout) -> tuple[float, ...]:
    """Per boundary between the layout's stages: ``side_send_bytes`` of the unit before it (the side tensors live
    there, at ``costs``' shape)."""
    return tuple(float(costs.units[r.stop - 1].side_send_bytes) for r in layout.stage_slices()[:-1])


def with_speedups(rows: list[SettingPrediction]) -> list[SettingPrediction]:
    """The rows with ``speedup`` = the first (baseline) row's GPU-days / the row's."""
    return [dataclasses.replace(r, speedup=rows[0].gpu_days / r.gpu_days) for r in rows]
