"""Adaptive activation recompute: per pipeline stage, the fastest recompute plan that fits memory.

OmniBal's memory level starts from full recomputation everywhere, measures what memory each stage
has left, and switches recompute off where the time saved is worth the memory it costs.  Here the
per-stage choice is made exactly: a stage's plan is ``StageRecompute(vit_full_layers, vit_selective,
llm_full_layers, llm_selective)`` (the trainer's hook: full recompute of the FIRST n layers of the
stage's ViT block and of its LLM block, selective core-attention recompute of the rest when the flag
is set), so a stage with ``nv`` ViT and ``nl`` LLM layers has at most ``(2 nv + 1) * (2 nl + 1)``
plans; all of them are scored at once with numpy and the fastest one whose peak memory fits the
budget wins (ties: less memory).  Because stages do not share memory, the per-stage optimum also
minimises the slowest stage.

Stage time (seconds per micro-batch) = sum over its units of ``fwd_s + bwd_s`` plus the recompute
extra: ``fwd_s`` of each fully recomputed layer, ``selective_recompute_s`` of each selective one.
Stage memory is :func:`~omnibal_ext.memory.memory_model.stage_memory` (static + in-flight
activations + one layer's recompute working set).

Flag syntax of ``--recompute-plan`` (one entry per pipeline stage, separated by ``|``)::

    v2s,t3|t0s|-

Each stage lists up to two comma-separated items: ``v<N>`` = the first N ViT layers of the stage
fully recomputed, ``t<N>`` = the first N LLM layers fully recomputed; a trailing ``s`` on an item
turns on selective (core attention) recompute for that block's remaining layers.  An item left out
means 0 layers and no selective recompute; ``-`` (or an empty entry) means no recompute on that
stage.  The example: stage 0 recomputes 2 ViT layers fully and the rest selectively, plus 3 LLM
layers fully; stage 1 recomputes all its LLM layers selectively; stage 2 recomputes nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import UserError
from ..model import partition  # lazy: the model level is not needed for the memory model itself
from ..model.costs import CostTable, UnitArrays
from ..model.layout import PipelineLayout
from ..model.spec import LAYER_ROLES, TEXT_LAYER, VISION_LAYER
from ..model.units import Unit
from .memory_model import (GIB, MIXED_BF16_ADAM, MODE_FULL, MODE_NONE, MODE_SELECTIVE, MemoryModelError, Precision,
                           _check_layout, _check_parallel, in_flight_1f1b, stage_memory, stage_time_s,
                           unit_modes, unit_static_bytes)
from .stage_recompute import RecomputeFlagError, StageRecompute


class MemoryBudgetError(UserError):
    """No recompute plan lets a stage fit its memory budget."""

    def __init__(self, stage: int | None, need_bytes: float, budget_bytes: float, detail: str = "",
                 message: str | None = None):
        self.stage, self.need_bytes, self.budget_bytes = stage, need_bytes, budget_bytes
        self.shortfall_bytes = need_bytes - budget_bytes
        super().__init__(message or (
            f"pipeline stage {stage} needs {need_bytes / GIB:.2f} GiB even with its least-memory recompute plan"
            f"{detail} but the budget is {budget_bytes / GIB:.2f} GiB: short by {self.shortfall_bytes / GIB:.2f} GiB"))


def parse_recompute_plan(text: str, num_stages: int | None = None,
                         flag: str = "--recompute-plan") -> list[StageRecompute]:
    """Read the ``--recompute-plan`` syntax; ``num_stages`` (when given) must match."""
    stages = [StageRecompute.from_flag(part, s, flag) for s, part in enumerate(text.split("|"))]
    if num_stages is not None and len(stages) != num_stages:
        raise RecomputeFlagError(f"{flag}: {len(stages)} stages given in {text!r} but the pipeline has {num_stages}")
    return stages


def format_recompute_plan(stages: Sequence[StageRecompute]) -> str:
    """The ``--recompute-plan`` text of ``stages``."""
    return "|".join(s.to_flag() for s in stages)


def validate_recompute_plan(stages: Sequence[StageRecompute], layout: PipelineLayout, units: Sequence,
                            flag: str = "--recompute-plan") -> None:
    """Check each stage recomputes no more layers than it holds (``units``: Unit or UnitCost list)."""
    if len(stages) != layout.num_stages:
        raise RecomputeFlagError(f"{flag}: {len(stages)} stages but the layout has {layout.num_stages}")
    for s, (sr, (nv, nl)) in enumerate(zip(stages, _layer_counts(layout, units))):
        if sr.vit_full_layers > nv or sr.llm_full_layers > nl:
            raise RecomputeFlagError(
                f"{flag}: stage {s} fully recomputes {sr.vit_full_layers} ViT / {sr.llm_full_layers} LLM layers "
                f"but holds {nv} ViT / {nl} LLM layers")


def _layer_counts(layout: PipelineLayout, units: Sequence) -> list[tuple[int, int]]:
    codes = [u.code for u in units]
    return [(sum(codes[i] == VISION_LAYER for i in r), sum(codes[i] == TEXT_LAYER for i in r))
            for r in layout.stage_slices()]


def full_recompute_plan(layout: PipelineLayout, units: Sequence) -> list[StageRecompute]:
    """Baseline: every ViT and LLM layer fully recomputed (``units``: Unit or UnitCost list)."""
    return [StageRecompute(nv, False, nl, False) for nv, nl in _layer_counts(layout, units)]


def no_recompute_plan(layout: PipelineLayout, units: Sequence | None = None) -> list[StageRecompute]:
    """No recompute on any stage."""
    return [StageRecompute() for _ in range(layout.num_stages)]


@dataclass(frozen=True)
class RecomputePlan:
    """The planner's answer: one StageRecompute per stage plus what it costs (per micro-batch)."""

    stages: tuple[StageRecompute, ...]
    stage_time_s: tuple[float, ...]  # forward + backward + recompute per micro-batch, seconds
    stage_peak_bytes: tuple[float, ...]
    stage_static_bytes: tuple[float, ...]
    budget_bytes: tuple[float, ...] = ()  # per stage

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_time_s)

    def to_flag(self) -> str:
        return format_recompute_plan(self.stages)

    def to_dict(self) -> dict:
        return {"flag": self.to_flag(), "stages": [s.to_dict() for s in self.stages],
                "stage_time_s": list(self.stage_time_s), "stage_peak_bytes": list(self.stage_peak_bytes),
                "stage_static_bytes": list(self.stage_static_bytes), "budget_bytes": list(self.budget_bytes)}

    @classmethod
    def from_dict(cls, d: dict) -> "RecomputePlan":
        return cls(tuple(StageRecompute.from_dict(s) for s in d["stages"]), tuple(d["stage_time_s"]),
                   tuple(d["stage_peak_bytes"]), tuple(d["stage_static_bytes"]), tuple(d.get("budget_bytes", ())))


# ------------------------------------------------------------------------------------------------
# The exact per-stage search
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageChoice:
    """Best plan of one stage (``plan`` None when nothing fits) and the least memory any plan needs."""

    plan: StageRecompute | None
    time_s: float  # of the chosen plan (inf when none fits)
    peak_bytes: float  # of the chosen plan (inf when none fits)
    min_peak_bytes: float  # least peak over all plans
    static_bytes: float


def _block_options(a: UnitArrays, idx: np.ndarray, allow_selective: bool):
    """All (full-prefix k, selective) options of one block: k, sel, act bytes, extra s, transient bytes."""
    n = len(idx)
    act, full, sel_b, fwd, sel_s = (a.act_bytes[idx], a.act_bytes_full[idx], a.act_bytes_selective[idx], a.fwd_s[idx],
                                    a.selective_recompute_s[idx])
    zero = np.zeros(1)
    pre_full = np.concatenate([zero, np.cumsum(full)])  # [k]: sum of act_full over layers < k
    pre_fwd = np.concatenate([zero, np.cumsum(fwd)])
    suf_act = np.concatenate([np.cumsum(act[::-1])[::-1], zero])  # [k]: sum over layers >= k
    suf_sel = np.concatenate([np.cumsum(sel_b[::-1])[::-1], zero])
    suf_sel_s = np.concatenate([np.cumsum(sel_s[::-1])[::-1], zero])
    pre_tr_full = np.concatenate([zero, np.maximum.accumulate(np.maximum(act - full, 0.0))]) if n else zero
    suf_tr_sel = (np.concatenate([np.maximum.accumulate(np.maximum(act - sel_b, 0.0)[::-1])[::-1], zero])
                  if n else zero)
    ks = np.arange(n + 1)
    sels = np.zeros(n + 1, dtype=bool)
    if allow_selective and n:  # selective with every layer fully recomputed is the same plan: left out
        ks = np.concatenate([ks, np.arange(n)])
        sels = np.concatenate([sels, np.ones(n, dtype=bool)])
    act_o = pre_full[ks] + np.where(sels, suf_sel[ks], suf_act[ks])
    extra_o = pre_fwd[ks] + np.where(sels, suf_sel_s[ks], 0.0)
    trans_o = np.maximum(pre_tr_full[ks], np.where(sels, suf_tr_sel[ks], 0.0))
    return ks, sels, act_o, extra_o, trans_o


def best_stage_plan(costs: CostTable, unit_range: range, in_flight: int, static: float, budget_bytes: float,
                    allow_selective: bool = True, block_cache: dict | None = None) -> StageChoice:
    """The fastest plan of the stage holding ``unit_range`` whose peak fits ``budget_bytes``.

    ``block_cache`` (a dict kept by the caller, for one cost table) saves work when many ranges of one table are
    asked.
    """
    a = costs.arrays
    idx = np.arange(unit_range.start, unit_range.stop)
    block = a.block[idx]
    vit, llm, other = idx[block == 1], idx[block == 2], idx[block == 0]
    base_act = a.act_bytes[other].sum()
    base_time = (a.fwd_s[idx] + a.bwd_s[idx]).sum()
    def options(layers):
        if block_cache is None:
            return _block_options(a, layers, allow_selective)
        key = (int(layers[0]), int(layers[-1]), allow_selective) if len(layers) else (0, -1, allow_selective)
        if key not in block_cache:
            block_cache[key] = _block_options(a, layers, allow_selective)
        return block_cache[key]

    vk, vs, vact, vextra, vtr = options(vit)
    lk, ls, lact, lextra, ltr = options(llm)
    peak = static + in_flight * (base_act + vact[:, None] + lact[None, :]) + np.maximum(vtr[:, None], ltr[None, :])
    time = base_time + vextra[:, None] + lextra[None, :]
    min_peak = float(peak.min())
    ok = peak <= budget_bytes
    if not ok.any():
        return StageChoice(None, float("inf"), float("inf"), min_peak, static)
    t = np.where(ok, time, np.inf).ravel()
    order = np.lexsort((peak.ravel(), t))  # by time, then by peak
    i, j = np.unravel_index(order[0], peak.shape)
    plan = StageRecompute(int(vk[i]), bool(vs[i]), int(lk[j]), bool(ls[j]))
    return StageChoice(plan, float(time[i, j]), float(peak[i, j]), min_peak, static)


def _budgets(budget_bytes, n: int) -> list[float]:
    if np.ndim(budget_bytes) == 0:
        return [float(budget_bytes)] * n
    b = [float(x) for x in budget_bytes]
    if len(b) != n:
        raise MemoryModelError(f"recompute planner: {len(b)} budgets given for {n} stages")
    return b


def plan_recompute(costs: CostTable, layout: PipelineLayout, budget_bytes: float | Sequence[float], pp: int,
                   tp: int, dp: int, num_microbatches: int, distributed_optimizer: bool = True,
                   precision: Precision = MIXED_BF16_ADAM, allow_selective: bool = True) -> RecomputePlan:
    """Per stage, the fastest recompute plan whose peak memory (1F1B) fits ``budget_bytes``.

    ``budget_bytes``: one number for every stage or one per stage.  Raises MemoryBudgetError naming
    the first stage that no plan fits.
    """
    _check_parallel(pp, tp, dp, num_microbatches)
    _check_layout(costs, layout, pp)
    budgets = _budgets(budget_bytes, pp)
    in_flight = in_flight_1f1b(pp, num_microbatches)
    choices = []
    for s, rng in enumerate(layout.stage_slices()):
        stat = float(unit_static_bytes(costs, tp, dp, distributed_optimizer, precision)[rng.start:rng.stop].sum())
        ch = best_stage_plan(costs, rng, int(in_flight[s]), stat, budgets[s], allow_selective)
        if ch.plan is None:
            raise MemoryBudgetError(s, ch.min_peak_bytes, budgets[s],
                                    f" (static {stat / GIB:.2f} GiB, {int(in_flight[s])} micro-batches in flight)")
        choices.append(ch)
    stages = [c.plan for c in choices]
    mem = stage_memory(costs, layout, stages, pp, tp, dp, num_microbatches, distributed_optimizer, precision)
    return RecomputePlan(tuple(stages), tuple(float(x) for x in stage_time_s(costs, layout, stages)),
                         tuple(m.peak_bytes for m in mem), tuple(m.static_bytes for m in mem), tuple(budgets))


def evaluate_plan(costs: CostTable, layout: PipelineLayout, stages: Sequence[StageRecompute], pp: int, tp: int,
                  dp: int, num_microbatches: int, budget_bytes: float | Sequence[float] = float("inf"),
                  distributed_optimizer: bool = True, precision: Precision = MIXED_BF16_ADAM) -> RecomputePlan:
    """Times and memory of a given plan (e.g. the full-recompute baseline), without a fit check."""
    mem = stage_memory(costs, layout, stages, pp, tp, dp, num_microbatches, distributed_optimizer, precision)
    return RecomputePlan(tuple(stages), tuple(float(x) for x in stage_time_s(costs, layout, stages)),
                         tuple(m.peak_bytes for m in mem), tuple(m.static_bytes for m in mem),
                         tuple(_budgets(budget_bytes, layout.num_stages)))


def layer_tradeoffs(costs: CostTable, layout: PipelineLayout, pp: int, num_microbatches: int) -> list[dict]:
    """Per ViT/LLM layer: memory switching full recompute off costs and the time it saves.

    ``memory_bytes = (act_bytes - act_bytes_full) * in_flight`` of the layer's stage and
    ``time_saved_s = fwd_s`` (per micro-batch), plus ``bytes_per_s`` = their ratio (lower is a better deal).
    """
    _check_layout(costs, layout, pp)
    in_flight = in_flight_1f1b(pp, num_microbatches)
    out = []
    for s, rng in enumerate(layout.stage_slices()):
        for i in rng:
            u = costs.units[i]
            if u.code not in LAYER_ROLES:
                continue
            mem = (u.act_bytes - u.act_bytes_full) * int(in_flight[s])
            out.append({"unit": u.name, "stage": s, "memory_bytes": mem, "time_saved_s": u.fwd_s,
                        "bytes_per_s": mem / u.fwd_s if u.fwd_s > 0 else float("inf")})
    return out


# ------------------------------------------------------------------------------------------------
# Layout + recompute together
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutAndRecompute:
    layout: PipelineLayout
    recompute: RecomputePlan
    how: str  # which candidate won: "searched", "recompute-aware", "joint-optimal"
    candidates: tuple[tuple[str, tuple[int, ...], float], ...] = ()  # (how, stage units, bottleneck s)

    def to_dict(self, units: Sequence[Unit] | None = None) -> dict:
        d = {"stage_units": list(self.layout.stage_units), "how": self.how, "recompute": self.recompute.to_dict(),
             "candidates": [{"how": h, "stage_units": list(c), "bottleneck_s": b} for h, c, b in self.candidates]}
        if units is not None:
            d["layout_flag"] = self.layout.to_flag(list(units))
        return d


def stage_ok_for_budget(costs: CostTable, budget_bytes: float, pp: int, tp: int, dp: int, num_microbatches: int,
                        distributed_optimizer: bool = True, precision: Precision = MIXED_BF16_ADAM,
                        allow_selective: bool = True) -> Callable[[int, range], bool]:
    """``stage_ok(stage_index, unit_range)`` for the partition search: True when some plan fits."""
    cache = _StageCache(costs, budget_bytes, pp, tp, dp, num_microbatches, distributed_optimizer, precision,
                        allow_selective)

    def stage_ok(stage: int, unit_range) -> bool:
        if not isinstance(unit_range, range):
            raise ValueError("recompute planner: stage_ok handles one contiguous range per stage "
                             "(virtual pipeline stages are not supported by the memory level)")
        return cache(stage, unit_range).plan is not None

    stage_ok.cache = cache  # shared with joint_optimal_layout
    return stage_ok


def _modes_as_names(costs: CostTable, layout: PipelineLayout, stages: Sequence[StageRecompute]) -> list[str]:
    names = {MODE_NONE: "none", MODE_SELECTIVE: "selective", MODE_FULL: "full"}
    return [names[int(m)] for m in unit_modes(costs, layout, stages)]


def joint_optimal_layout(costs: CostTable, pp: int, budget_bytes: float | Sequence[float], tp: int = 1,
                         dp: int = 1, num_microbatches: int = 1, distributed_optimizer: bool = True,
                         precision: Precision = MIXED_BF16_ADAM, allow_selective: bool = True,
                         _cache: "_StageCache | None" = None) -> PipelineLayout:
    """The exact optimum of layout and recompute together (1F1B, per-micro-batch stage times).

    A stage's time under its best plan depends only on (stage index, unit range), so the smallest
    possible slowest stage over all contiguous splits is a min-max dynamic program over those
    costs; among the splits reaching it, the one with the smallest total time is returned.
    Evaluates every (stage, range) once: O(pp * n^2) exact per-stage searches.
    """
    _check_parallel(pp, tp, dp, num_microbatches)
    cache = _cache or _StageCache(costs, budget_bytes, pp, tp, dp, num_microbatches, distributed_optimizer,
                                  precision, allow_selective)
    n = len(costs.units)
    if n < pp:
        raise MemoryModelError(f"joint layout: {n} units cannot fill {pp} pipeline stages")
    cost = np.full((pp, n + 1, n + 1), np.inf)  # cost[k, i, j]: stage k holding units [i, j)
    for k in range(pp):
        starts = [0] if k == 0 else range(k, n - pp + k + 1)
        for i in starts:
            ends = [n] if k == pp - 1 else range(i + 1, n - pp + k + 2)
            for j in ends:
                cost[k, i, j] = cache(k, range(i, j)).time_s

    def dp_pass(limit: float):
        """Per stage count k and end j: best (max, sum) prefix under ``limit``; returns argmin table."""
        big = np.inf
        f = np.full((pp + 1, n + 1), big)  # min-max (limit=inf) or min-sum (stage costs <= limit)
        f[0, 0] = 0.0
        arg = np.zeros((pp + 1, n + 1), dtype=int)
        for k in range(1, pp + 1):
            c = cost[k - 1]  # [i, j]
            if np.isfinite(limit):
                c = np.where(c <= limit, c, np.inf)
                cand = f[k - 1][:, None] + c
            else:
                cand = np.maximum(f[k - 1][:, None], c)
            arg[k] = np.argmin(cand, axis=0)
            f[k] = cand[arg[k], np.arange(n + 1)]
        return f, arg

    f, _ = dp_pass(np.inf)
    best = f[pp, n]
    if not np.isfinite(best):
        budget = min(_budgets(budget_bytes, pp))
        raise MemoryBudgetError(None, float("nan"), budget, message=(
            f"no split of the {n} units into {pp} pipeline stages lets every stage fit {budget / GIB:.2f} GiB "
            f"with any recompute plan; raise the budget, TP or PP"))
    f, arg = dp_pass(best * (1 + 1e-12))
    ends, j = [], n
    for k in range(pp, 0, -1):
        ends.append(j)
        j = int(arg[k, j])
    bounds = [0] + ends[::-1]
    return PipelineLayout(tuple(int(b - a) for a, b in zip(bounds[:-1], bounds[1:])))


def plan_layout_and_recompute(costs: CostTable, pp: int, budget_bytes: float | Sequence[float], tp: int = 1,
                              dp: int = 1, num_microbatches: int = 1, *, method: str = "searched",
                              radius: int = 2, iterations: int = 2, distributed_optimizer: bool = True,
                              precision: Precision = MIXED_BF16_ADAM,
                              allow_selective: bool = True) -> LayoutAndRecompute:
    """Partition search and recompute planning together (1F1B, no virtual stages).

    Round 1 ("searched"): the partition search (``method``: "searched" = the paper's anchor + radius
    search, "optimal" = exact min-max) on plain forward + backward times, with ``stage_ok`` rejecting
    any stage that no recompute plan fits into the budget; then the adaptive plan for that layout.
    Rounds 2..``iterations`` ("recompute-aware"): the search again on unit times that include the
    recompute the previous round's plan chose (per unit: full -> + fwd_s, selective -> +
    selective_recompute_s), then the adaptive plan for the new layout.  The candidate with the
    smallest slowest-stage time (recompute included; ties: smaller peak memory) is returned.
    ``method="joint"``: the rounds above plus :func:`joint_optimal_layout` (the exact optimum of
    layout and recompute together; slower: one per-stage search per (stage, range)).
    """

    if method not in ("searched", "optimal", "joint"):
        raise ValueError(
            f"plan_layout_and_recompute: method must be 'searched', 'optimal' or 'joint', got {method!r}")
    if iterations < 1:
        raise ValueError(f"plan_layout_and_recompute: iterations must be >= 1, got {iterations}")
    _check_parallel(pp, tp, dp, num_microbatches)
    stage_ok = stage_ok_for_budget(costs, budget_bytes, pp, tp, dp, num_microbatches, distributed_optimizer,
                                   precision, allow_selective)

    def search(recompute):
        if method != "optimal":
            try:
                return partition.search_partition(costs, pp, radius=radius, recompute=recompute, stage_ok=stage_ok)
            except partition.PartitionError:  # nothing fits near the anchor: look at every split
                pass
        try:
            return partition.optimal_partition(costs, pp, recompute=recompute, stage_ok=stage_ok)
        except partition.PartitionError as e:
            budget = min(_budgets(budget_bytes, pp))
            raise MemoryBudgetError(None, float("nan"), budget, message=(
                f"no split of the {len(costs.units)} units into {pp} pipeline stages lets every stage fit "
                f"{budget / GIB:.2f} GiB with any recompute plan ({e}); raise the budget, TP or PP")) from e

    candidates: list[LayoutAndRecompute] = []
    recompute = None
    for it in range(iterations):
        layout = search(recompute).layout
        if candidates and layout == candidates[-1].layout:
            break  # the recompute-aware search settled on the same split
        plan = plan_recompute(costs, layout, budget_bytes, pp, tp, dp, num_microbatches, distributed_optimizer,
                              precision, allow_selective)
        candidates.append(LayoutAndRecompute(layout, plan, "searched" if it == 0 else "recompute-aware"))
        recompute = _modes_as_names(costs, layout, plan.stages)
    if method == "joint":
        layout = joint_optimal_layout(costs, pp, budget_bytes, tp, dp, num_microbatches, distributed_optimizer,
                                      precision, allow_selective, _cache=stage_ok.cache)
        plan = plan_recompute(costs, layout, budget_bytes, pp, tp, dp, num_microbatches, distributed_optimizer,
                              precision, allow_selective)
        candidates.append(LayoutAndRecompute(layout, plan, "joint-optimal"))
    best = min(candidates, key=lambda c: (c.recompute.bottleneck_s, max(c.recompute.stage_peak_bytes)))
    summary = tuple((c.how, c.layout.stage_units, c.recompute.bottleneck_s) for c in candidates)
    return dataclasses.replace(best, candidates=summary)


class _StageCache:
    def __init__(self, costs, budget_bytes, pp, tp, dp, m, distributed_optimizer, precision, allow_selective):
        self.costs, self.budgets, self.tp, self.dp = costs, _budgets(budget_bytes, pp), tp, dp
        self.opt, self.precision, self.sel = distributed_optimizer, precision, allow_selective
        self.in_flight = in_flight_1f1b(pp, m)
        self.static = unit_static_bytes(costs, tp, dp, distributed_optimizer, precision)
        self.memo: dict = {}
        self.blocks: dict = {}

    def __call__(self, stage: int, rng) -> StageChoice:
        key = (stage, rng.start, rng.stop)
        if key not in self.memo:
            stat = float(self.static[rng.start:rng.stop].sum())
            self.memo[key] = best_stage_plan(self.costs, range(rng.start, rng.stop), int(self.in_flight[stage]),
                                             stat, self.budgets[stage], self.sel, self.blocks)
        return self.memo[key]
