"""The model level (+model): the paper's layout search with full recompute, checked against memory."""
from __future__ import annotations

from ..memory.memory_model import GIB
from ..memory.recompute import full_recompute_plan
from ..model import partition
from ..model.layout import PipelineLayout
from ..model.units import build_units
from .context import Candidate, PlanContext, nothing_fits, stage_peaks
from .linear_costs import full_modes


def default_candidate(ctx: PlanContext, default: PipelineLayout) -> Candidate:
    """Megatron's default layout with full recompute on every layer."""
    return Candidate("default", default, full_recompute_plan(default, ctx.costs_isf.units), full_modes(ctx.costs_isf))


def stage_fits_full_recompute(ctx: PlanContext):
    """``stage_ok(stage, units range)`` for the partitioners: the stage fits the budget under full recompute."""
    def ok(stage: int, rng) -> bool:
        return bool(ctx.need[stage, rng.start, rng.stop] <= ctx.budget)
    return ok


def model_candidates(ctx: PlanContext, default: PipelineLayout) -> list[Candidate]:
    """+model: the paper's search (full recompute weights, memory-checked) and the default layout."""
    units = ctx.costs_isf.units
    modes = full_modes(ctx.costs_isf)
    out = []
    try:
        rep = partition.search_partition(ctx.costs_isf, ctx.pp, recompute=modes, stage_ok=stage_fits_full_recompute(ctx))
        how = "searched"
    except partition.PartitionError:
        rep = partition.optimal_partition(ctx.costs_isf, ctx.pp, recompute=modes,
                                          stage_ok=stage_fits_full_recompute(ctx))
        how = "optimal (no searched layout within the radius fits)"
    out.append(Candidate(how, rep.layout, full_recompute_plan(rep.layout, units), modes))
    if rep.layout != default:
        out.append(default_candidate(ctx, default))
    return out


def fitting_model_candidates(ctx: PlanContext, cands: list[Candidate]) -> list[Candidate]:
    """The +model candidates whose full-recompute peak fits the budget; PlanError naming each peak if none."""
    peaks = [max(stage_peaks(ctx, ctx.costs_isf, c.layout, c.stages)) for c in cands]
    fitting = [c for c, peak in zip(cands, peaks) if peak <= ctx.budget]
    if not fitting:
        units = build_units(ctx.spec)
        raise nothing_fits(ctx, "+model", [
            f"{c.how} layout {c.layout.to_flag(units)} needs {peak / GIB:.1f} GiB with full recompute"
            for c, peak in zip(cands, peaks)])
    return fitting
