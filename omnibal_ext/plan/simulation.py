"""Simulation of sampled iterations: every DP rank's micro-batches through the 1F1B simulator."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.simulate import SimResult, simulate_pipeline
from .data_level import Loads


@dataclass(frozen=True)
class SimSummary:
    """Sampled iterations of one candidate.

    iteration_s: mean iteration (slowest DP rank + all-reduce), seconds; balanced_iteration_s: the same
    with every micro-batch at the mean shape, seconds; bubble_fraction: idle share of the slowest rank's
    pipeline; samples_per_iteration: mean samples; seconds_per_sample: summed iteration time / samples;
    tokens_per_s: real LLM tokens per second, whole cluster; timeline: the first iteration's slowest rank.
    """

    iteration_s: float
    balanced_iteration_s: float
    bubble_fraction: float
    samples_per_iteration: float
    seconds_per_sample: float
    tokens_per_s: float
    timeline: SimResult | None = None


def simulate_loads(coefs, loads: Loads, allreduce_s: float, keep_timeline: bool = False,
                   vpp: int = 1) -> SimSummary:
    """Simulate every sampled iteration (each DP rank its own micro-batches; slowest rank + all-reduce).

    coefs: (fwd, bwd, p2p) of ``linear_costs.stage_coefficients``; allreduce_s: gradient all-reduce, seconds;
    vpp: model chunks per pipeline rank (> 1: the interleaved schedule; coefs then have pp * vpp columns).
    """
    fwd_c, bwd_c, p2p_c = coefs
    F, B, C = (loads.shape @ c for c in (fwd_c, bwd_c, p2p_c))  # (I, R, m, P * V)
    I, R, m, cols = F.shape
    F, B, C = (x.reshape(I, R, m, cols // vpp, vpp) for x in (F, B, C))
    times, bubbles, timeline = [], [], None
    for i in range(I):
        worst = None
        for r in range(R):
            res = simulate_pipeline(F[i, r], B[i, r], m, C[i, r], vpp=vpp)
            if worst is None or res.iteration_s > worst.iteration_s:
                worst = res
        times.append(worst.iteration_s + allreduce_s)
        bubbles.append(worst.bubble_fraction)
        if keep_timeline and timeline is None:
            timeline = worst
    bal = mean_shape_iteration_s(coefs, loads.mean_shape, m, vpp) + allreduce_s
    total_t = float(np.sum(times))
    total_samples = float(loads.samples.sum())
    return SimSummary(float(np.mean(times)), float(bal), float(np.mean(bubbles)), total_samples / I,
                      total_t / total_samples, float(loads.real_tokens.sum()) / total_t, timeline)


def mean_shape_iteration_s(coefs, mean_shape: np.ndarray, m: int, vpp: int = 1) -> float:
    """One pipeline iteration (no all-reduce), seconds, with every one of ``m`` micro-batches at ``mean_shape``
    (``vpp`` model chunks per rank)."""
    f, b, c = ((mean_shape @ x).reshape(-1, vpp) for x in coefs)
    return simulate_pipeline(f, b, m, c, vpp=vpp).iteration_s
