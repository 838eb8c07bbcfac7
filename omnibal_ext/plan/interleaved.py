"""The interleaved pipeline in the plan: which V (model chunks per pipeline rank) a configuration allows, the
layout searched over V x PP virtual stages, and its recompute plan (full or none per chunk).

The memory level's adaptive recompute planner (``memory.recompute``) plans one chunk per rank under plain 1F1B.
For V > 1 the plan keeps to what the interleaved memory model (``memory_model.stage_memory`` with
``virtual_stages``: every rank holds its V chunks, in-flight micro-batches replayed per chunk) can check
directly: each chunk recomputes either every ViT/LLM layer it holds or none, chosen greedily per rank (the
chunk that lowers the rank's peak most per second of recompute first) until every rank fits.  No selective or
partial-layer recompute for V > 1: correct, not complete.
"""
from __future__ import annotations

import numpy as np

from ..memory.memory_model import GIB, stage_memory
from ..memory.recompute import MemoryBudgetError, StageRecompute, full_recompute_plan, no_recompute_plan
from ..model import partition
from ..model.layout import PipelineLayout
from ..model.spec import LAYER_ROLES
from .config import PlanError
from .context import Candidate, PlanContext
from .linear_costs import full_modes, stage_modes

RECOMPUTE_NOTE = ("interleaved (V > 1) plans recompute a chunk's layers fully or not at all (no selective or "
                  "partial recompute per chunk: the adaptive planner plans one chunk per rank)")


def vpp_problem(pp: int, m: int, v: int, n_units: int) -> str | None:
    """Why ``v`` model chunks per rank cannot run at ``pp`` stages and ``m`` micro-batches per pipeline, or None.

    megatron-core's interleaved schedule needs the micro-batches per pipeline to be at least PP and a multiple
    of it; every one of the V x PP virtual stages needs a unit."""
    if v <= 1:
        return None
    if pp < 2:
        return f"V={v} needs a pipeline (PP >= 2), PP is {pp}"
    if m < pp or m % pp:
        return f"V={v}: {m} micro-batches per pipeline are not a multiple of PP {pp} (at least PP)"
    if v * pp > n_units:
        return f"V={v}: {v} x {pp} virtual stages exceed the model's {n_units} pipeline units"
    return None


def vpp_values(vpp: int | None, max_vpp: int) -> list[int]:
    """The V values a request allows: ``vpp`` when given, else 1..``max_vpp``."""
    return [int(vpp)] if vpp is not None else list(range(1, max(1, int(max_vpp)) + 1))


def chunk_recompute(ctx: PlanContext, layout: PipelineLayout, v: int) -> list[StageRecompute]:
    """Per layout stage (chunk), full or no recompute, so that every rank fits the budget under the
    interleaved schedule; MemoryBudgetError when a rank does not fit even with all its chunks recomputed."""
    costs = ctx.costs_isf
    full = full_recompute_plan(layout, costs.units)
    plan = no_recompute_plan(layout)
    extra = [sum(costs.units[u].fwd_s for u in rng if costs.units[u].code in LAYER_ROLES)
             for rng in layout.stage_slices()]

    def peaks(p):
        return [x.peak_bytes for x in stage_memory(costs, layout, p, ctx.pp, ctx.tp, ctx.dp, ctx.m,
                                                   precision=ctx.precision, virtual_stages=v)]

    while True:
        now = peaks(plan)
        r = int(np.argmax(now))
        if now[r] <= ctx.budget:
            return plan
        options = [c for c in layout.rank_stages(r, ctx.pp) if plan[c] != full[c]]
        if not options:
            raise MemoryBudgetError(r, now[r], ctx.budget, message=(
                f"pipeline rank {r} needs {now[r] / GIB:.1f} GiB with all its {v} chunks fully recomputed "
                f"(budget {ctx.budget / GIB:.1f} GiB)"))

        def gain(c):
            trial = list(plan)
            trial[c] = full[c]
            return (now[r] - peaks(trial)[r]) / max(extra[c], 1e-12)

        best = max(options, key=gain)
        plan[best] = full[best]


def interleaved_candidates(ctx: PlanContext, v: int) -> tuple[list[Candidate], list[str]]:
    """V > 1 candidates of one configuration: the partition search over V x PP virtual stages (weights without
    and with full recompute), each with :func:`chunk_recompute`; and why the others failed."""
    costs = ctx.costs_isf
    out, failures, seen = [], [], set()
    for weights, modes in (("no-recompute", ["none"] * len(costs.units)), ("full-recompute", full_modes(costs))):
        try:
            rep = partition.search_partition(costs, ctx.pp, vpp=v, recompute=modes)
        except partition.PartitionError as e:
            failures.append(f"V={v} search ({weights} times): {e}")
            continue
        if rep.layout in seen:
            continue
        seen.add(rep.layout)
        try:
            stages = chunk_recompute(ctx, rep.layout, v)
        except MemoryBudgetError as e:
            failures.append(f"V={v} searched layout ({weights} times): {e}")
            continue
        out.append(Candidate(f"searched over {v} x {ctx.pp} virtual stages ({weights} times) + full/none "
                             f"recompute per chunk", rep.layout, stages, stage_modes(costs, rep.layout, stages),
                             vpp=v))
    return out, failures


def check_fixed_vpp(vpp: int | None, pp: int, m: int, n_units: int) -> None:
    """PlanError when a V > 1 asked for cannot run at the chosen configuration."""
    if vpp is not None and vpp > 1:
        problem = vpp_problem(pp, m, vpp, n_units)
        if problem:
            raise PlanError(f"--vpp {vpp}: {problem}")
