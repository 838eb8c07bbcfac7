"""Bounds from the memory model on the ratio of two runs' measured peak activation bytes (--log-activation-memory).

A run's peak on one pipeline stage is the bytes of its largest micro-batch, and two runs of the same data serve the
same micro-batches; so if the model's per-micro-batch ratio of the two settings lies in [lo, hi] for every shape the
data can give, the measured peaks' ratio lies there too, up to the model's error (``MODEL_ERROR``).
"""
from omnibal_ext.model.cost_model import DEVICES, MicroBatchShape, analytic_costs
from omnibal_ext.model.units import get_preset

# relative error of the activation model on the tiny model's layers: within 0.1% at TP 2 with and without sequence
# parallelism (tests/test_sequence_parallel.py), 1.5% at CP 1 and CP 2 (tests/test_cp_memory.py); the rest is margin
MODEL_ERROR = 0.05


def act_bytes(tp: int = 1, sequence_parallel: bool = False, cp: int = 1, tiles: int = 1, tokens: int = 128) -> float:
    """The tiny model's activation bytes per rank of one fp32 micro-batch, every unit on one stage."""
    shape = MicroBatchShape(tiles, tokens, dtype_bytes=4, cp=cp)
    costs = analytic_costs(get_preset("tiny"), shape, tp, DEVICES["cpu"], attention="flash",
                           sequence_parallel=sequence_parallel)
    return sum(u.act_bytes for u in costs.units)


def act_ratio_range(num: dict, den: dict, tiles=range(1, 17), tokens=(64, 128, 256, 512, 1024, 2048)) -> tuple:
    """(lo, hi) of act_bytes(**num) / act_bytes(**den) over micro-batches of ``tiles`` x ``tokens``, widened by
    ``MODEL_ERROR``."""
    ratios = [act_bytes(**num, tiles=v, tokens=t) / act_bytes(**den, tiles=v, tokens=t) for v in tiles for t in tokens]
    return min(ratios) * (1 - MODEL_ERROR), max(ratios) * (1 + MODEL_ERROR)
