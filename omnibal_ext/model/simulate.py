"""Pipeline schedule simulator: 1F1B and interleaved 1F1B, event by event.

Each stage runs its operations in the order of the schedule; an operation starts when the stage is
free and its input has arrived:

* forward of micro-batch ``mb``, chunk ``c`` on stage ``i`` needs the forward of (``i-1``, ``c``)
  plus the p2p time of that chunk's output (for ``i = 0, c > 0``: the forward of (``P-1``, ``c-1``));
* backward needs the backward of (``i+1``, ``c``) plus the p2p time of the gradient (same bytes as
  the forward output; for ``i = P-1, c < V-1``: the backward of (``0``, ``c+1``)); the last chunk's
  backward needs its own forward.

Sends are asynchronous (a stage does not wait for its send to finish) and a stage sending to
itself costs nothing. Schedules (Megatron's orders, written from their published description):

* 1F1B: stage ``i`` runs ``min(P-i-1, m)`` warm-up forwards, then alternates one forward and one
  backward, then the remaining backwards.
* interleaved 1F1B with V chunks (needs ``m % P == 0``): virtual micro-batch ``k`` is chunk
  ``(k // P) % V`` of micro-batch ``(k // (P*V)) * P + k % P`` (backward: chunk ``V-1-(k//P)%V``);
  stage ``i`` warms up with ``(P-i-1)*2 + (V-1)*P`` forwards (all of them when ``m == P``), then
  alternates forward and backward, then drains.

Times are seconds per micro-batch per stage (per chunk). Data-parallel ranks run the same schedule
on their own micro-batches; the iteration is the slowest rank plus the gradient all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .costs import CostTable
from .layout import PipelineLayout
from .partition import recompute_modes


@dataclass(frozen=True)
class SimEvent:
    stage: int
    microbatch: int
    chunk: int
    kind: str  # "fwd" or "bwd"
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """iteration_s: time from the first start to the last end, seconds.
    bubble_fraction: 1 - total busy time / (stages * iteration_s).
    per_stage_busy_s: seconds each stage computes."""

    iteration_s: float
    bubble_fraction: float
    per_stage_busy_s: tuple[float, ...]
    events: tuple[SimEvent, ...]
    num_stages: int = 1
    num_chunks: int = 1
    num_microbatches: int = 1

    def to_dict(self, with_events: bool = False) -> dict:
        d = {"iteration_s": self.iteration_s, "bubble_fraction": self.bubble_fraction,
             "per_stage_busy_s": list(self.per_stage_busy_s), "num_stages": self.num_stages,
             "num_chunks": self.num_chunks, "num_microbatches": self.num_microbatches}
        if with_events:
            d["events"] = [e.__dict__ for e in self.events]
        return d


@dataclass(frozen=True)
class DataParallelSimResult:
    """iteration_s = max over ranks of the pipeline time + allreduce_s."""

    iteration_s: float
    allreduce_s: float
    slowest_rank: int
    ranks: tuple[SimResult, ...]


def schedule_order(pp: int, stage: int, num_microbatches: int, vpp: int = 1) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, chunk) operations stage ``stage`` runs, in order."""
    m, P, V = num_microbatches, pp, vpp
    if V == 1:
        warm = min(P - stage - 1, m)
        fwd = [("fwd", mb, 0) for mb in range(m)]
        bwd = [("bwd", mb, 0) for mb in range(m)]
        total = m
    else:
        if m % P:
            raise ValueError(f"interleaved schedule: {m} micro-batches must be a multiple of pipeline size {P}")
        total = m * V

        def mb_of(k):
            return (k // (P * V)) * P + k % P

        fwd = [("fwd", mb_of(k), (k // P) % V) for k in range(total)]
        bwd = [("bwd", mb_of(k), V - 1 - (k // P) % V) for k in range(total)]
        warm = total if m == P else min((P - stage - 1) * 2 + (V - 1) * P, total)
    order = fwd[:warm]
    for j in range(total - warm):
        order += [fwd[warm + j], bwd[j]]
    order += bwd[total - warm :]
    return order


def _per_mb(x, m: int, P: int, V: int, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim == 0:
        a = np.full((P, V), float(a))
    if a.ndim == 1:
        if a.shape[0] != P:
            raise ValueError(f"{what}: {a.shape[0]} values for {P} stages")
        a = np.repeat(a[:, None], V, axis=1)
    if a.ndim == 2:
        if a.shape != (P, V):
            raise ValueError(f"{what}: shape {a.shape}, expected ({P}, {V}) = (stages, chunks)")
        a = np.broadcast_to(a, (m, P, V))
    if a.shape != (m, P, V):
        raise ValueError(f"{what}: shape {a.shape}, expected (micro-batches, stages, chunks) = ({m}, {P}, {V})")
    if (a < 0).any():
        raise ValueError(f"{what}: negative seconds")
    return a


def simulate_pipeline(fwd_s, bwd_s, num_microbatches: int, p2p_s=0.0, vpp: int = 1) -> SimResult:
    """Simulate one iteration.

    fwd_s, bwd_s: seconds per micro-batch, shape (P,), (P, V) or (m, P, V) (per micro-batch).
    p2p_s: seconds to send one chunk's output to the next chunk: scalar, (P,), (P, V) or (m, P, V).
    """
    m = int(num_microbatches)
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    a = np.asarray(fwd_s, dtype=float)
    P = a.shape[-2] if a.ndim >= 2 else (a.shape[0] if a.ndim == 1 else 1)
    V = int(vpp)
    if a.ndim >= 2 and a.shape[-1] != V:
        raise ValueError(f"fwd_s has {a.shape[-1]} chunks per stage but vpp is {V}")
    F = _per_mb(fwd_s, m, P, V, "fwd_s")
    B = _per_mb(bwd_s, m, P, V, "bwd_s")
    C = _per_mb(p2p_s, m, P, V, "p2p_s")
    orders = [schedule_order(P, i, m, V) for i in range(P)]
    done: dict[tuple[str, int, int, int], float] = {}
    pos = [0] * P
    free = [0.0] * P
    busy = [0.0] * P
    events: list[SimEvent] = []

    def ready(kind, i, c, mb):
        """Arrival time of the op's input, or None when its producer has not run yet."""
        if kind == "fwd":
            if i > 0:
                src, comm = ("fwd", i - 1, c, mb), C[mb, i - 1, c]
            elif c > 0:
                src, comm = ("fwd", P - 1, c - 1, mb), (C[mb, P - 1, c - 1] if P > 1 else 0.0)
            else:
                return 0.0
        else:
            if i < P - 1:
                src, comm = ("bwd", i + 1, c, mb), C[mb, i, c]
            elif c < V - 1:
                src, comm = ("bwd", 0, c + 1, mb), (C[mb, P - 1, c] if P > 1 else 0.0)
            else:
                src, comm = ("fwd", i, c, mb), 0.0
        t = done.get(src)
        return None if t is None else t + comm

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(P):
            while pos[i] < len(orders[i]):
                kind, mb, c = orders[i][pos[i]]
                arrival = ready(kind, i, c, mb)
                if arrival is None:
                    break
                dur = (F if kind == "fwd" else B)[mb, i, c]
                start = max(free[i], arrival)
                end = start + dur
                done[(kind, i, c, mb)] = end
                events.append(SimEvent(i, mb, c, kind, float(start), float(end)))
                free[i], busy[i] = end, busy[i] + dur
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline simulation deadlocked: the schedule orders are inconsistent")
    iteration = max(e.end_s for e in events) - min(e.start_s for e in events)
    bubble = 1.0 - sum(busy) / (P * iteration) if iteration > 0 else 0.0
    events.sort(key=lambda e: (e.start_s, e.stage))
    return SimResult(float(iteration), float(bubble), tuple(float(b) for b in busy), tuple(events), P, V, m)


def allreduce_seconds(grad_bytes: float, dp: int, bytes_per_s: float) -> float:
    """Ring all-reduce time: 2 (dp-1)/dp of the gradient bytes over ``bytes_per_s``."""
    if dp <= 1:
        return 0.0
    return 2.0 * (dp - 1) / dp * grad_bytes / bytes_per_s


def simulate_data_parallel(
    per_rank_fwd_s: Sequence, per_rank_bwd_s: Sequence, num_microbatches: int, p2p_s=0.0, vpp: int = 1,
    allreduce_s: float = 0.0,
) -> DataParallelSimResult:
    """Each DP rank runs its own micro-batch costs (shape (m, P, V) or less); iteration = slowest + all-reduce."""
    if len(per_rank_fwd_s) != len(per_rank_bwd_s) or not per_rank_fwd_s:
        raise ValueError("simulate_data_parallel: give forward and backward costs for the same (>= 1) ranks")
    ranks = tuple(simulate_pipeline(f, b, num_microbatches, p2p_s, vpp) for f, b in zip(per_rank_fwd_s, per_rank_bwd_s))
    slowest = int(np.argmax([r.iteration_s for r in ranks]))
    return DataParallelSimResult(ranks[slowest].iteration_s + allreduce_s, float(allreduce_s), slowest, ranks)


def layout_stage_costs(costs: CostTable, layout: PipelineLayout, pp: int, p2p_bytes_per_s: float, recompute=None):
    """(fwd (P, V), bwd (P, V), p2p (P, V)) seconds from a cost table and a layout of ``pp * vpp`` chunks.

    Recompute extra time is added to the backward (that is when it runs).
    """

    modes = recompute_modes(costs, recompute)
    n_chunks = layout.num_stages
    if n_chunks % pp:
        raise ValueError(f"layout has {n_chunks} chunks, not a multiple of pipeline size {pp}")
    if sum(layout.stage_units) != len(costs.units):
        raise ValueError(f"layout covers {sum(layout.stage_units)} units but the cost table has {len(costs.units)}")
    V = n_chunks // pp
    fwd, bwd, p2p = np.zeros((pp, V)), np.zeros((pp, V)), np.zeros((pp, V))
    for c, rng in enumerate(layout.stage_slices()):
        i, v = c % pp, c // pp
        for u in rng:
            cu, mode = costs.units[u], modes[u]
            fwd[i, v] += cu.fwd_s
            bwd[i, v] += cu.bwd_s + {"none": 0.0, "selective": cu.selective_recompute_s, "full": cu.fwd_s}[mode]
        last = costs.units[rng[-1]]  # its output and the side tensors live after it
        p2p[i, v] = (last.send_bytes + last.side_send_bytes) / p2p_bytes_per_s
    return fwd, bwd, p2p


def simulate_layout(costs: CostTable, layout: PipelineLayout, pp: int, num_microbatches: int,
                    p2p_bytes_per_s: float, recompute=None) -> SimResult:
    """Simulate ``layout`` (``pp * vpp`` chunks) with every micro-batch costing ``costs``."""
    fwd, bwd, p2p = layout_stage_costs(costs, layout, pp, p2p_bytes_per_s, recompute)
    return simulate_pipeline(fwd, bwd, num_microbatches, p2p, vpp=fwd.shape[1])
