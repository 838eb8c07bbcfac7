"""All DP ranks of the online ISF in one process: each rank's stream through its look-ahead buffer, step by step.

What a training job does with one ``OnlineISF`` per rank and a real all-gather, done here with the ranks' summary
vectors stacked in place of the all-gather (``OnlineISF.propose`` on every rank, then ``settle`` on every rank with
the stacked matrix).  The benchmark (``scripts/bench_online_isf.py``) and the tests drive the algorithm through it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .online_isf import BufferCosts, OnlineISF, OnlineISFConfig


@dataclass(frozen=True)
class SimulatedRun:
    """The steps of a simulated run.

    groups: per step, per rank, the groups served (each an int64 array of stream indices of that rank: the n-th
    sample the rank's stream yielded); plan_s: per step, per rank, the planning seconds of ``propose`` + ``settle``;
    max_buffered: the most samples a rank held at once.
    """

    groups: list[list[list[np.ndarray]]]
    plan_s: np.ndarray
    max_buffered: int

    @property
    def steps(self) -> int:
        return len(self.groups)


def simulate(streams: list[BufferCosts], config: OnlineISFConfig, max_steps: int | None = None,
             stop_at_first_end: bool = False) -> SimulatedRun:
    """Run ``config.ranks`` online ISF ranks over their ``streams`` (rank r reads ``streams[r]`` in order, keeping
    its buffer ``config.buffer_size`` full while the stream lasts).  Stops when every rank has served its whole
    stream, after ``max_steps`` steps, or (``stop_at_first_end``) at the first step some rank's stream has ended
    (the steady state, without the stream's tail)."""
    if len(streams) != config.ranks:
        raise ValueError(f"simulate: {len(streams)} streams for {config.ranks} ranks")
    ranks = [OnlineISF(config) for _ in streams]
    read = [0] * config.ranks  # samples of each stream read into the buffer
    held: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in streams]  # stream index of each buffered sample
    tables = [streams[r].take(held[r]) for r in range(config.ranks)]
    steps, plan_s, most = [], [], 0
    while max_steps is None or len(steps) < max_steps:
        for r, stream in enumerate(streams):
            new = np.arange(read[r], min(len(stream), read[r] + config.buffer_size - len(held[r])))
            if len(new):
                held[r] = np.concatenate([held[r], new])
                tables[r] = tables[r].concat(stream.take(new))
                read[r] += len(new)
            most = max(most, len(held[r]))
        ended = [read[r] == len(streams[r]) for r in range(config.ranks)]
        if stop_at_first_end and any(ended):
            break
        seconds = np.zeros(config.ranks)
        rows = []
        for r, isf in enumerate(ranks):
            t0 = time.process_time()
            rows.append(isf.propose(tables[r], ended[r]))
            seconds[r] += time.process_time() - t0
        gathered = np.stack(rows)
        step = []
        for r, isf in enumerate(ranks):
            t0 = time.process_time()
            groups = isf.settle(gathered)
            seconds[r] += time.process_time() - t0
            served = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups]) if groups else np.zeros(0, int)
            keep = np.ones(len(held[r]), dtype=bool)
            keep[served] = False
            step.append([held[r][np.asarray(g, dtype=np.int64)] for g in groups])
            held[r] = held[r][keep]
            tables[r] = tables[r].take(np.flatnonzero(keep))
        steps.append(step)
        plan_s.append(seconds)
        if ranks[0].done:
            break
    return SimulatedRun(steps, np.array(plan_s).reshape(-1, config.ranks), most)
