"""What a training step reports: the data wait, the reduced loss reports, throughput and batch balance, and the
Megatron-style log (stdout, TensorBoard, JSON lines) they are written to."""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import numpy as np

from omnibal_ext.data.metrics import dist_ratio_one, random_rebatch_balance, step_balance_time

from .config import LogConfig


class DataWait:
    """Seconds this rank waited for data during one step: the loop makes one per step and reads ``seconds``
    after it (the wait for ``next`` on the iterators it wraps, and any block it times)."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def timed(self, data):
        """``data`` (an iterator), each ``next`` timed."""
        return _TimedIterator(data, self)


class _TimedIterator:
    def __init__(self, data, wait: DataWait):
        self.data, self.wait = data, wait

    def __iter__(self):
        return self

    def __next__(self):
        with self.wait.timing():
            return next(self.data)


@dataclass(frozen=True)
class StepResult:
    """What one training step produced on this rank.

    reports: the loss function's report of each micro-batch (last pipeline stage; else empty);
    grad_norm: the optimizer's gradient norm (None when it has none); learning_rate: the LR its optimizer step
    applied (the --lr parameter groups'); records: the data loader's record of each
    micro-batch (``tokens``, ``tiles``, ``ids``, ``packed``); data_wait_s: seconds spent waiting for data;
    elapsed_s: the step's wall time (s); act_peak_bytes: its activation peak (0 unless measured)."""
    reports: list
    grad_norm: float | None
    learning_rate: float
    records: list
    data_wait_s: float
    elapsed_s: float
    act_peak_bytes: int


@dataclass(frozen=True)
class MetricGroups:
    """The process groups the step metrics are reduced over: ``world_gloo`` (all ranks, gloo: None for the
    default group when it is gloo), ``dp_gloo`` (data-parallel, gloo), ``dp_cp`` (data x context parallel)."""
    world_gloo: object
    dp_gloo: object
    dp_cp: object

    @classmethod
    def build(cls, timeout) -> "MetricGroups":
        """Every rank must call it (it may create the gloo world group, with ``timeout``)."""
        world = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        return cls(world, parallel_state.get_data_parallel_group_gloo(),
                   parallel_state.get_data_parallel_group(with_context_parallel=True))


def reduce_reports(reports: list[dict], dp_cp) -> dict:
    """Sum the per-micro-batch reports over micro-batches and data- and context-parallel ranks (last stage only)."""
    if not reports:
        return {}
    totals = {k: sum(r[k] for r in reports) for k in reports[0]}
    for v in totals.values():
        dist.all_reduce(v, group=dp_cp)
    return totals


def step_metrics(step: StepResult, groups: MetricGroups, consumed_before: int, is_last: bool) -> dict:
    """The log line of a step (every rank takes part): samples consumed (all data-parallel ranks) up to and
    including it, its time, the learning rate it applied, the slowest rank's data wait, loss and answer accuracy
    (last stage), gradient norm, tokens and images per second."""
    wait = torch.tensor([step.data_wait_s], dtype=torch.float64)  # a stage that waits stalls the pipeline
    dist.all_reduce(wait, op=dist.ReduceOp.MAX, group=groups.world_gloo)
    totals = reduce_reports(step.reports, groups.dp_cp) if is_last else {}
    records = step.records
    samples_tokens = torch.tensor([sum(sum(r["tokens"]) for r in records), sum(sum(r["tiles"]) for r in records),
                                   sum(len(r["tokens"]) for r in records)], dtype=torch.float64)
    dist.all_reduce(samples_tokens, group=groups.dp_gloo)
    samples = int(samples_tokens[2])
    metrics = {
        "consumed samples": consumed_before + samples,
        "elapsed time per iteration (ms)": step.elapsed_s * 1000,
        "learning rate": step.learning_rate,
        "global batch size": samples,
        "data wait ms": float(wait[0]) * 1000,
    }
    if totals:
        metrics["lm loss"] = float(totals["lm loss"][0] / totals["lm loss"][1].clamp(min=1))
        metrics["answer acc"] = float(totals["answers"][0] / totals["answers"][1].clamp(min=1))
    metrics["grad norm"] = step.grad_norm
    metrics["tokens/s"] = float(samples_tokens[0]) / step.elapsed_s
    metrics["images/s"] = float(samples_tokens[1]) / step.elapsed_s
    return metrics


def batch_balance(records: list[dict], balance_fn, dp_gloo, sample_times=None) -> dict:
    """Pad/Dist ratios of the micro-batches this iteration trained, across data-parallel ranks; with
    ``sample_times`` (ViT, LLM) per sample id, the Dist ratios in predicted time too."""
    gathered = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(gathered, records, group=dp_gloo)
    per_step = []
    for j in range(len(records)):
        tokens = [rank_records[j]["tokens"] for rank_records in gathered]
        tiles = [rank_records[j]["tiles"] for rank_records in gathered]
        per_step.append(balance_fn(tokens, tiles, packed=records[j]["packed"]))
        if sample_times is not None:
            per_step[-1].update(step_balance_time([rank_records[j]["ids"] for rank_records in gathered], sample_times))
        elif all("vit_s" in rank_records[j] for rank_records in gathered):  # the samples' own predicted times
            per_step[-1].update(summed_time_balance([sum(r[j]["vit_s"]) for r in gathered],
                                                    [sum(r[j]["llm_s"]) for r in gathered]))
    keys = per_step[0].keys() if per_step else []
    return {k: sum(s[k] for s in per_step) / len(per_step) for k in keys}


def random_batch_balance(records: list[dict], dp_gloo, rng: np.random.Generator) -> dict:
    """Pad/Dist ratios that Megatron's default batching would have given on the samples this iteration trained: all
    data-parallel ranks' samples shuffled (``rng``, the same on every rank) and dealt into as many padded micro-batches
    per rank (``random_rebatch_balance``); {} when the iteration recorded none."""
    gathered = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(gathered, [(r["tokens"], r["tiles"]) for r in records], group=dp_gloo)
    if not records:
        return {}
    tokens = [[mb[0] for mb in rank] for rank in gathered]
    tiles = [[mb[1] for mb in rank] for rank in gathered]
    return random_rebatch_balance(tokens, tiles, rng)
def summed_time_balance(vit_per_rank: list[float], llm_per_rank: list[float]) -> dict:
    """{"dist_ratio_llm_time", "dist_ratio_vit_time"} of one micro-batch slot from each rank's summed predicted
    ViT and LLM seconds (as ``step_balance_time`` computes from sample ids)."""
    return {"dist_ratio_llm_time": dist_ratio_one(llm_per_rank), "dist_ratio_vit_time": dist_ratio_one(vit_per_rank)}


def sample_ids(records: list[dict], dp_gloo) -> list[list[list[int]]]:
    """This iteration's sample ids: [data-parallel rank][micro-batch][sample] (every rank of the group takes part)."""
    gathered = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(gathered, [r["ids"] for r in records], group=dp_gloo)
    return gathered


class BalanceMeans:
    """The run's mean of each step's batch balance (steps that report one)."""

    def __init__(self):
        self._sums: dict[str, float] = {}
        self._steps = 0

    def add(self, balance: dict) -> None:
        for k, v in balance.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        self._steps += bool(balance)

    def means(self) -> dict | None:
        return {k: v / self._steps for k, v in self._sums.items()} if self._steps else None


class MetricsLog:
    """Megatron-style log lines, optional TensorBoard and JSON lines, from the logging rank."""

    def __init__(self, log: LogConfig):
        self.is_logger = dist.get_rank() == dist.get_world_size() - 1  # a last-stage rank
        self.writer = None
        self.json = None
        if self.is_logger and log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional: needs the tensorboard package

            self.writer = SummaryWriter(log.tensorboard_dir)
        if self.is_logger and log.json_log:
            os.makedirs(os.path.dirname(os.path.abspath(log.json_log)), exist_ok=True)
            self.json = open(log.json_log, "a")

    def log(self, iteration: int, total: int, metrics: dict, prefix: str = "") -> None:
        if not self.is_logger:
            return
        parts = [f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] {prefix}iteration {iteration:8d}/{total:8d}"]
        fmt = {"consumed samples": "{:12d}", "elapsed time per iteration (ms)": "{:.1f}",
               "learning rate": "{:.6E}", "global batch size": "{:5d}", "lm loss": "{:.6E}", "token mean loss": "{:.6E}",
               "answer acc": "{:.4f}", "grad norm": "{:.4f}", "tokens/s": "{:.1f}", "images/s": "{:.1f}",
               "pad ratio": "{:.4f}", "data wait ms": "{:.1f}", "dist ratio llm": "{:.4f}", "dist ratio vit": "{:.4f}",
               "dist ratio llm time": "{:.4f}", "dist ratio vit time": "{:.4f}", "moe aux loss": "{:.6E}",
               "moe z loss": "{:.6E}", "expert load imbalance": "{:.4f}", "ep load imbalance": "{:.4f}",
               "generation acc": "{:.4f}", "generation tf acc": "{:.4f}"}
        for key, value in metrics.items():
            if value is None or isinstance(value, list):  # lists (sample ids) go to the JSON lines only
                continue
            parts.append(f"{key}: {fmt.get(key, '{}').format(value)}")
        print(" | ".join(parts), flush=True)
        if self.writer:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{prefix}{key}", value, iteration)
        if self.json:
            self.json.write(json.dumps({"iteration": iteration, "prefix": prefix, **metrics}) + "\n")
            self.json.flush()

    def close(self):
        if self.writer:
            self.writer.close()
        if self.json:
            self.json.close()
