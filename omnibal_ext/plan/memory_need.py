"""Least memory any layout needs with full recompute: an exact min-max over contiguous splits."""
from __future__ import annotations

import numpy as np

from ..model.spec import LAYER_ROLES
from ..memory.memory_model import (FP32_ADAM, MIXED_BF16_ADAM, MODE_FULL, MODE_NONE, Precision, in_flight_1f1b,
                                   lora_rank_params, rank_param_counts, unit_activation_bytes, unit_static_bytes,
                                   unit_transient_bytes)
from ..model.cost_model import DeviceSpec
from ..model.costs import CostTable


def training_precision(device: DeviceSpec) -> Precision:
    """What the trainer runs with on that device: bf16 with fp32 Adam on GPUs (--bf16), fp32 on CPU."""
    return FP32_ADAM if device.name == "cpu" else MIXED_BF16_ADAM


def unit_params(costs: CostTable, tp: int, trained_only: bool = False) -> np.ndarray:
    """Parameters of each unit held by one tensor-parallel rank (float64), LoRA adapters included;
    ``trained_only``: a frozen unit's adapters only."""
    frozen = np.array([trained_only and u.frozen for u in costs.units])
    return np.where(frozen, lora_rank_params(costs, tp), rank_param_counts(costs, tp))


def memory_need_table(costs: CostTable, pp: int, tp: int, dp: int, num_microbatches: int,
                      distributed_optimizer: bool = True, precision: Precision = MIXED_BF16_ADAM) -> np.ndarray:
    """need[k, i, j]: peak bytes of pipeline stage k holding units [i, j) with full recompute.

    Static bytes + in-flight micro-batches (1F1B) x kept activations + one layer's recompute
    working set, as ``memory_model.stage_memory`` counts them; inf where j <= i.
    """
    n = len(costs.units)
    modes = np.array([MODE_FULL if u.code in LAYER_ROLES else MODE_NONE for u in costs.units],
                     dtype=np.int8)
    act = unit_activation_bytes(costs, modes)
    trans = unit_transient_bytes(costs, modes)
    stat = unit_static_bytes(costs, tp, dp, distributed_optimizer, precision)
    pa = np.concatenate([[0.0], np.cumsum(act)])
    pp_ = np.concatenate([[0.0], np.cumsum(stat)])
    act_sum = pa[None, :] - pa[:, None]
    static = pp_[None, :] - pp_[:, None]
    tmax = np.full((n + 1, n + 1), -np.inf)
    for i in range(n):
        tmax[i, i + 1:] = np.maximum.accumulate(trans[i:])
    valid = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
    in_flight = in_flight_1f1b(pp, num_microbatches).astype(np.float64)
    need = static[None] + in_flight[:, None, None] * act_sum[None] + np.maximum(tmax, 0.0)[None]
    return np.where(valid[None], need, np.inf)


def memory_need(need: np.ndarray) -> tuple[float, int, tuple[int, ...]]:
    """(least possible largest stage peak in bytes, the stage holding it, the layout's units per stage)
    over all contiguous splits of a :func:`memory_need_table`."""
    pp, n1, _ = need.shape
    n = n1 - 1
    if pp > n:
        return float("inf"), 0, ()
    f = need[0, 0].copy()  # f[j]: best max over stages 0..k holding units [0, j)
    args = []
    for k in range(1, pp):
        cand = np.maximum(f[:, None], need[k])
        arg = np.argmin(cand, axis=0)
        f = cand[arg, np.arange(n1)]
        args.append(arg)
    best = float(f[n])
    if not np.isfinite(best):
        return best, 0, ()
    ends, j = [n], n
    for arg in reversed(args):
        j = int(arg[j])
        ends.append(j)
    edges = [0] + ends[::-1]
    counts = tuple(int(b - a) for a, b in zip(edges[:-1], edges[1:]))
    stage_need = [need[k, edges[k], edges[k + 1]] for k in range(pp)]
    return best, int(np.argmax(stage_need)), counts
