"""The memory level (+memory): layout search with adaptive per-stage recompute, and adaptive recompute
on given layouts."""
from __future__ import annotations

from ..memory.recompute import MemoryBudgetError, plan_layout_and_recompute, plan_recompute
from ..model import partition
from ..model.layout import PipelineLayout
from .context import Candidate, PlanContext, nothing_fits
from .linear_costs import stage_modes


def joint_plan(ctx: PlanContext, cache: dict | None):
    """``plan_layout_and_recompute`` at the ISF caps, memoised per configuration (screen, then plan)."""
    key = (ctx.tp, ctx.pp, ctx.dp, ctx.cp, ctx.experts, ctx.m, ctx.budget, ctx.attention,
           tuple(sorted(ctx.costs_isf.meta["shape"].items())))
    if cache is not None and key in cache:
        return cache[key]
    joint = plan_layout_and_recompute(ctx.costs_isf, ctx.pp, ctx.budget, ctx.tp, ctx.grad_ranks, ctx.m,
                                      precision=ctx.precision)
    if cache is not None:
        cache[key] = joint
    return joint


def joint_stage_modes(ctx: PlanContext, joint) -> list[str]:
    """Per-unit recompute mode names of a joint (layout + recompute) plan."""
    return stage_modes(ctx.costs_isf, joint.layout, joint.recompute.stages)


def memory_candidates(ctx: PlanContext, layouts: list[tuple[str, PipelineLayout]],
                      cache: dict | None = None) -> list[Candidate]:
    """+memory: layout search + adaptive recompute, and the adaptive plan on the given layouts.
    Raises PlanError, with each candidate's reason, when none fits."""
    out, failures = [], []
    try:
        joint = joint_plan(ctx, cache)
        out.append(Candidate(f"{joint.how} + adaptive recompute", joint.layout, list(joint.recompute.stages),
                             joint_stage_modes(ctx, joint)))
    except (MemoryBudgetError, partition.PartitionError) as e:
        failures.append(f"layout search + adaptive recompute: {e}")
    seen = {c.layout for c in out}
    for how, layout in layouts:
        if layout in seen:
            continue
        seen.add(layout)
        try:
            plan = plan_recompute(ctx.costs_isf, layout, ctx.budget, ctx.pp, ctx.tp, ctx.grad_ranks, ctx.m,
                                  precision=ctx.precision)
        except MemoryBudgetError as e:
            failures.append(f"{how} layout + adaptive recompute: {e}")
            continue
        out.append(Candidate(f"{how} layout + adaptive recompute", layout, list(plan.stages),
                             stage_modes(ctx.costs_isf, layout, plan.stages)))
    if not out:
        raise nothing_fits(ctx, "+memory", failures)
    return out
