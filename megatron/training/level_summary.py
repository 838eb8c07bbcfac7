"""The last lines of the trainer's log: what each OmniBal level did to the run, against Megatron's default.

* data: the Pad and Dist ratios the run's micro-batches had (the mean over its steps, as logged as "balance over the
  run") beside those of random batches of the same samples (each step's samples shuffled and dealt into the same
  number of padded micro-batches per data-parallel rank: ``omnibal_ext.data.metrics.random_rebatch_balance``), whether
  ISF was on or not;
* model: the layout the run trained with and its predicted stage times (from the run's unit costs) beside those of
  Megatron's default layout (the ViT and projector on the first stage, the LLM layers split evenly);
* memory: the recompute the run trained with, its predicted peak per stage against the budget, and its predicted
  bottleneck time beside that of full recompute on the same layout.

A level that is off says so and what the run did instead; its figures need the unit costs (a profile), which only a
run with ``--omnibal-partition auto``, ``--omnibal-recompute auto`` or ``--omnibal-profile`` has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from omnibal_ext.memory.recompute import RecomputePlan, evaluate_plan, full_recompute_plan
from omnibal_ext.model.costs import CostTable
from omnibal_ext.model.layout import LayoutError, PipelineLayout, default_layout
from omnibal_ext.model.partition import PartitionReport, evaluate_layout
from omnibal_ext.model.units import build_units


RATIOS = ("pad_ratio", "dist_ratio_llm", "dist_ratio_vit")


@dataclass(frozen=True)
class DataLevel:
    """isf: --omnibal-isf; measured / random: the run's mean ``RATIOS`` and those of random batches of its samples
    (None: no step logged a balance)."""

    isf: bool
    measured: Mapping[str, float] | None
    random: Mapping[str, float] | None


@dataclass(frozen=True)
class ModelLevel:
    """searched: --omnibal-partition auto; layout_flag / default_flag: the layout trained and Megatron's default;
    chosen / default: their predicted stage times (None without unit costs)."""

    searched: bool
    layout_flag: str
    default_flag: str
    chosen: PartitionReport | None
    default: PartitionReport | None


@dataclass(frozen=True)
class MemoryLevel:
    """adaptive: --omnibal-recompute auto; recompute_flag: the recompute trained (per stage); chosen / full: the
    predicted cost of that recompute and of full recompute on the same layout (None without unit costs)."""

    adaptive: bool
    recompute_flag: str
    chosen: RecomputePlan | None
    full: RecomputePlan | None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def data_line(level: DataLevel) -> str:
    how = "ISF groups" if level.isf else "off (random batches)"
    if not level.measured or not level.random:
        return f"data:   {how}; no step logged a balance"
    m, r = level.measured, level.random
    return (f"data:   {how}: pad ratio {m['pad_ratio']:.3f}, Dist ratio LLM {m['dist_ratio_llm']:.3f} / ViT "
            f"{m['dist_ratio_vit']:.3f}; random batches of the same samples: {r['pad_ratio']:.3f}, "
            f"{r['dist_ratio_llm']:.3f} / {r['dist_ratio_vit']:.3f}")


def model_line(level: ModelLevel) -> str:
    how = "searched layout" if level.searched else "off (the given or default layout)"
    if level.chosen is None or level.default is None:
        why = "no unit costs to predict its stage times" if level.chosen is None else \
            f"Megatron's default layout {level.default_flag}"
        return f"model:  {how} {level.layout_flag}; {why}"
    c, d = level.chosen, level.default
    return (f"model:  {how} {level.layout_flag}: predicted bottleneck {_ms(max(c.stage_times_s))} per micro-batch, "
            f"bottleneck/mean {c.bottleneck_over_mean:.3f}; Megatron's default layout {level.default_flag}: "
            f"{_ms(max(d.stage_times_s))}, {d.bottleneck_over_mean:.3f}")


def memory_line(level: MemoryLevel) -> str:
    how = "adaptive recompute" if level.adaptive else "off (the given recompute)"
    if level.chosen is None or level.full is None:
        return f"memory: {how} {level.recompute_flag}; no unit costs to predict its memory"
    c, f = level.chosen, level.full
    peaks = ", ".join(f"{b / 2**20:.1f}" for b in c.stage_peak_bytes)
    budget = (f" within a budget of {min(c.budget_bytes) / 2**20:.1f} MiB" if c.budget_bytes else "")
    return (f"memory: {how} {level.recompute_flag}: predicted peak per stage [{peaks}] MiB{budget}; predicted "
            f"bottleneck {_ms(c.bottleneck_s)} per micro-batch, full recompute {_ms(f.bottleneck_s)}")


def summary_lines(data: DataLevel, model: ModelLevel, memory: MemoryLevel) -> list[str]:
    """The log's closing block, one line per level."""
    return ["OmniBal, what each level did (against Megatron's default):", data_line(data), model_line(model),
            memory_line(memory)]


def model_level(spec, layout: PipelineLayout, pp: int, vpp: int, costs: CostTable | None,
                searched: bool) -> ModelLevel:
    """The model level of a run of ``spec`` at ``pp`` pipeline ranks (``vpp`` chunks each) trained on ``layout``;
    ``costs``: its unit costs (None: none measured)."""
    units = build_units(spec)
    try:
        default = default_layout(spec, pp * vpp)
    except LayoutError:  # too few LLM layers for Megatron's split at this many stages: a given layout only
        default = None
    flags = (layout.to_flag(units), default.to_flag(units) if default else "(none at this split)")
    if costs is None or default is None:
        return ModelLevel(searched, *flags, evaluate_layout(costs, layout, pp) if costs else None, None)
    return ModelLevel(searched, *flags, evaluate_layout(costs, layout, pp), evaluate_layout(costs, default, pp))


def memory_level(layout: PipelineLayout, chosen: RecomputePlan | None, given: str, costs: CostTable | None, pp: int,
                 tp: int, dp: int, microbatches: int, distributed_optimizer: bool, precision) -> MemoryLevel:
    """The memory level of a run on ``layout``: ``chosen``, the adaptive recompute (None: off, ``given`` says what
    the flags asked for), against full recompute of every layer on the same layout."""
    if chosen is None or costs is None:
        return MemoryLevel(chosen is not None, chosen.to_flag() if chosen else given, None, None)
    full = evaluate_plan(costs, layout, full_recompute_plan(layout, costs.units), pp, tp, dp, microbatches,
                         chosen.budget_bytes or float("inf"), distributed_optimizer=distributed_optimizer,
                         precision=precision)
    return MemoryLevel(True, chosen.to_flag(), chosen, full)
