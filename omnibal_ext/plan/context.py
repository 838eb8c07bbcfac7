"""One (tp, pp, dp) configuration: its cost tables and memory table, and the candidates simulated on it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..memory.memory_model import GIB, Precision, stage_memory
from ..model.cost_model import DeviceSpec, MicroBatchShape, analytic_costs
from ..model.costs import CostTable
from ..model.layout import PipelineLayout
from ..model.moe_cost import MEAN_RUN, ExpertRun
from ..model.simulate import allreduce_seconds
from ..model.trainable import Trainable
from ..model.units import ModelSpec
from .config import PlanError
from .data_level import Loads
from .linear_costs import basis_costs, stage_coefficients
from .memory_need import memory_need_table, training_precision, unit_params
from .simulation import SimSummary, simulate_loads
from .trainer_flags import sequence_parallel


@dataclass
class PlanContext:
    """What every candidate of one configuration shares.

    m: micro-batches per iteration; budget: bytes per GPU; basis: ``linear_costs.basis_costs``.
    """

    spec: ModelSpec
    device: DeviceSpec
    tp: int
    pp: int
    dp: int
    m: int
    budget: float
    attention: str
    basis: tuple
    costs_isf: CostTable  # at the ISF caps (memory and the layout search)
    costs_random: CostTable  # at the mean padded random micro-batch (memory of the baseline)
    need: np.ndarray  # memory_need_table of costs_isf
    precision: Precision  # static bytes per parameter (the distributed optimizer is assumed)
    trainable: Trainable | None = None  # frozen units (None: every unit trains); the cost tables above include it
    cp: int = 1  # context-parallel size: the cost tables are one CP rank's; gradients are reduced over DP x CP
    experts: ExpertRun = MEAN_RUN  # how MoE layers run (EP / ETP, expert load); the cost tables above are at it

    @property
    def grad_ranks(self) -> int:
        """Ranks holding one copy of the model: DP x CP (gradient all-reduce, distributed optimizer shards)."""
        return self.dp * self.cp


def build_context(spec: ModelSpec, device: DeviceSpec, tp: int, pp: int, dp: int, m: int, budget: float,
                  attention: str, cap_shape: MicroBatchShape, random_shape: MicroBatchShape,
                  trainable: Trainable | None = None, cp: int = 1, segments=None,
                  experts: ExpertRun = MEAN_RUN) -> PlanContext:
    """The context of one configuration: costs at the ISF caps and at the mean padded random micro-batch, with
    ``trainable``'s frozen units applied (omnibal_ext.model.trainable; linear in the shape, so the basis too).
    With TP > 1 the plan runs sequence parallelism (``trainer_flags.sequence_parallel``, with or without CP), and
    its costs count it (under CP the shapes hold the samples padded to 2 x CP x TP).  cp: the context-parallel
    size; the shapes carry it (``MicroBatchShape.cp``) and the costs and memory are one CP rank's; the optimizer
    state is sharded over DP x CP (megatron-core's distributed optimizer). segments: the data's ViT segments per item for the basis (``linear_costs``).
    experts: the MoE layers' expert grid and load (``moe_cost.ExpertRun``): their all-to-alls, busiest-rank time and
    expert memory (experts split over EP x ETP, their optimizer state over expert DP)."""
    frozen = trainable.apply if trainable is not None else (lambda c: c)
    sp = sequence_parallel(tp)
    for shape in (cap_shape, random_shape):
        if shape.cp != cp:
            raise ValueError(f"build_context: a shape split over CP {shape.cp}, the configuration's CP is {cp}")
    kw = dict(attention=attention, sequence_parallel=sp, experts=experts)
    costs_isf = frozen(analytic_costs(spec, cap_shape, tp, device, **kw))
    costs_random = frozen(analytic_costs(spec, random_shape, tp, device, **kw))
    basis = tuple(frozen(c) for c in basis_costs(spec, tp, device, attention, sequence_parallel=sp, cp=cp,
                                                    segments=segments, experts=experts))
    precision = training_precision(device)
    return PlanContext(spec, device, tp, pp, dp, m, budget, attention, basis,
                       costs_isf, costs_random, memory_need_table(costs_isf, pp, tp, dp * cp, m, precision=precision),
                       precision, trainable, cp, experts)


def allreduce_s(ctx: PlanContext, layout: PipelineLayout) -> float:
    """Ring all-reduce of the fp32 gradients of the layout's largest pipeline rank (all its chunks), seconds
    (frozen units: none)."""
    params = unit_params(ctx.costs_isf, ctx.tp, trained_only=True)
    per_stage = np.array([params[list(r)].sum() for r in layout.stage_slices()])
    largest = per_stage.reshape(-1, ctx.pp).sum(axis=0).max()  # layout stage c runs on rank c % pp
    return allreduce_seconds(4.0 * largest, ctx.grad_ranks, ctx.device.p2p_bytes_per_s)


def stage_peaks(ctx: PlanContext, costs: CostTable, layout: PipelineLayout, stages) -> tuple[float, ...]:
    """Per pipeline rank, peak bytes per GPU of ``memory_model.stage_memory`` (1F1B, distributed optimizer; a
    layout of ``pp * V`` stages: the interleaved schedule, each rank holding its V chunks)."""
    mem = stage_memory(costs, layout, stages, ctx.pp, ctx.tp, ctx.grad_ranks, ctx.m, precision=ctx.precision,
                       virtual_stages=layout.num_stages // ctx.pp)
    return tuple(float(x.peak_bytes) for x in mem)


@dataclass
class Candidate:
    """A layout and per-stage recompute plan; ``coefs`` and ``sim`` are set by :func:`simulate_candidate`."""

    how: str  # which search or fallback produced it
    layout: PipelineLayout
    stages: list  # per-stage StageRecompute
    modes: list  # per-unit recompute mode names
    coefs: tuple = ()
    sim: SimSummary | None = None
    vpp: int = 1  # model chunks per pipeline rank (the layout has pp * vpp stages; > 1: interleaved)


def simulate_candidate(ctx: PlanContext, cand: Candidate, loads: Loads, keep_timeline: bool) -> Candidate:
    """Fill in the candidate's linear stage costs and its simulation on ``loads``; returns it."""
    cand.coefs = stage_coefficients(ctx.basis, cand.layout, ctx.pp, ctx.device.p2p_bytes_per_s, cand.modes)
    cand.sim = simulate_loads(cand.coefs, loads, allreduce_s(ctx, cand.layout), keep_timeline, cand.vpp)
    return cand


def best_candidate(cands: list[Candidate]) -> Candidate:
    """The candidate with the least simulated time per sample (then per iteration)."""
    return min(cands, key=lambda c: (c.sim.seconds_per_sample, c.sim.iteration_s))


def nothing_fits(ctx: PlanContext, setting: str, failures: list[str]) -> PlanError:
    """The planner's refusal of a row: the configuration and why each candidate failed."""
    cp = f" CP={ctx.cp}" if ctx.cp > 1 else ""
    if ctx.spec.language.moe is not None:
        cp += f" EP={ctx.experts.grid.ep} ETP={ctx.experts.grid.etp}"
    configuration = (f"{ctx.spec.name} at TP={ctx.tp} PP={ctx.pp}{cp} DP={ctx.dp}, {ctx.m} micro-batches, budget "
                     f"{ctx.budget / GIB:.1f} GiB per GPU")
    return PlanError(f"no {setting} plan fits {configuration}: " + "; ".join(failures))
