""":func:`make_plan`: the three levels together, the parallel sizes chosen, the four settings predicted."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.stats import SampleStats
from ..memory.memory_model import GIB, MIXED_BF16_ADAM
from ..model.cp_split import cp_multiple
from ..model.decode_cost import DecodeLoad, decode_estimate
from ..model.layout import default_layout, parse_layout
from ..model.moe import ExpertGrid, expert_grids
from ..model.moe_cost import ExpertRun, run_for
from ..model.sample_time import vision_segments
from ..model.shape import MicroBatchShape
from ..model.units import family_of
from .config import PlanConfig, check_request
from .configs import candidate_configs, num_microbatches, refusal, screen_config
from .context import PlanContext, best_candidate, build_context, nothing_fits, simulate_candidate
from .interleaved import RECOMPUTE_NOTE, check_fixed_vpp, interleaved_candidates, vpp_problem, vpp_values
from .data_level import (cap_shape, isf_loads, isf_for_ranks, mean_isf_group, sample_work_of, random_loads, random_metrics,
                         shape_dict, shape_of)
from .memory_level import memory_candidates
from .memory_need import memory_need
from .model_level import default_candidate, fitting_model_candidates, model_candidates
from .predictions import prediction_row, with_speedups
from .results import Plan
from .trainer_flags import moe_trainer_flags, plan_trainer_flags, sp_tp

SCREEN_DP = 8  # DP size of the provisional ISF thresholds when several configurations are screened


@dataclass
class _Chosen:
    """The configuration chosen by screening, with its final ISF plan and context."""

    ctx: PlanContext
    data: object  # data.search's ISF plan at the chosen DP size
    cap: object  # MicroBatchShape at the ISF caps
    worst_random: np.ndarray  # largest padded random micro-batch (tiles, tokens, sum len^2)
    tried: list[dict]
    skipped: list[dict]
    usable: int  # configurations that fit


def _choose_configuration(stats: SampleStats, config: PlanConfig, cache: dict, segments=None, work=None) -> _Chosen:
    """Screen every candidate (tp, pp, dp) and keep the fastest that fits; PlanError when none does (``work``:
    ``data_level.sample_work_of``'s, where ISF groups in time)."""
    spec, dev, budget, k = config.spec, config.device_spec, config.budget_bytes, int(config.samples_per_group)
    gpus, gpu_memory = config.gpus, config.gpu_memory_bytes
    cp = int(config.cp)
    moe = spec.language.moe
    configs, skipped = candidate_configs(spec, gpus, config.tp, config.pp, config.dp, config.min_pp, cp)
    if not configs:
        raise refusal(spec, gpus, gpu_memory, budget, [], skipped, config.require_baseline_fit)
    # Provisional ISF thresholds for screening: caps depend on K, hardly on the DP size.
    first_dp = config.dp if config.dp is not None else (configs[0][2] if len(configs) == 1 else SCREEN_DP)
    data_at: dict = {}  # (data_key(TP), DP) -> ISF plan
    shapes: dict = {}  # data_key(TP) -> shapes

    def data_key(tp: int) -> tuple[int, int]:
        """(TP of the samples' predicted times, padding TP): the data level depends on TP where ISF groups in
        predicted time (the times are one TP rank's) and under CP with sequence parallelism (every sample padded to
        2 x CP x TP, the ISF search counting the padded tokens); else on neither."""
        return (tp if work is not None else 1, sp_tp(tp) if cp > 1 else 1)

    def isf_at(tp: int, dp: int):
        """The ISF plan for ``dp`` ranks at ``tp``."""
        key = data_key(tp)
        if (key, dp) not in data_at:
            data_at[key, dp] = isf_for_ranks(stats, dp, config, key[1], key[0], work)
        return data_at[key, dp]

    def shapes_at(tp: int) -> tuple:
        """(ISF caps, random shape, mean ISF group, mean and worst random micro-batch) of the provisional ISF
        plan at ``tp``."""
        key = data_key(tp)
        if key not in shapes:
            s = key[1]
            data = isf_at(tp, first_dp)
            _, mean_random, worst = random_loads(stats, k, 1, 1, 1, config.seed, cp, s)
            shapes[key] = (cap_shape(data.params, stats, cp, s, segments), shape_of(mean_random, cp, segments),
                           mean_isf_group(stats, data.grouping, cp, s), mean_random, worst)
        return shapes[key]

    vpps = vpp_values(config.vpp, config.max_vpp)

    def screen(cfg, caps, baseline_needed, cache=None, experts: ExpertRun = run_for(None, ExpertGrid(), None)):
        _, random_shape, mean_isf, mean_random, _ = shapes_at(cfg[0])
        return screen_config(spec, dev, budget, config.attention, cfg, k, config.global_batch_size, caps,
                             random_shape, mean_isf, mean_random, baseline_needed, cache, config.trainable, cp, vpps,
                             segments, experts)

    tried = []
    for c in configs:  # every (TP, PP, DP) at every expert grid megatron-core allows there (dense: one)
        grids, why = expert_grids(moe, c[0], cp, c[2], config.ep, config.etp)
        skipped += [{"tp": c[0], "pp": c[1], "dp": c[2], "reason": w} for w in why]
        tried += [screen(c, shapes_at(c[0])[0], config.require_baseline_fit, cache,
                         run_for(moe, g, config.imbalance_at(g.ep))) for g in grids]
    if not tried:
        raise refusal(spec, gpus, gpu_memory, budget, [], skipped, config.require_baseline_fit)
    usable = [r for r in tried if r["fits"] and "estimated_seconds_per_sample" in r]
    if not usable:
        raise refusal(spec, gpus, gpu_memory, budget, tried, skipped, config.require_baseline_fit)
    speed_key = ("estimated_seconds_per_sample" if config.choose_for == "omnibal"
                 else "baseline_estimated_seconds_per_sample")
    chosen = min(usable, key=lambda r: (r[speed_key], r["tp"], r["pp"], r.get("ep", 1), r.get("etp", 1)))
    t, p, d = chosen["tp"], chosen["pp"], chosen["dp"]
    grid = ExpertGrid(chosen.get("ep", 1), chosen.get("etp", 1))
    run = run_for(moe, grid, config.imbalance_at(grid.ep))
    _, random_shape, _, _, worst = shapes_at(t)
    data = isf_at(t, d)
    cap = cap_shape(data.params, stats, cp, sp_tp(t), segments)
    m = num_microbatches(config.global_batch_size, d, k)
    ctx = build_context(spec, dev, t, p, d, m, budget, config.attention, cap, random_shape, config.trainable, cp,
                        segments, run)
    if memory_need(ctx.need)[0] > budget:  # the final thresholds moved the caps: say so plainly
        raise refusal(spec, gpus, gpu_memory, budget, [screen((t, p, d), cap, False, None, run)], skipped, False)
    return _Chosen(ctx, data, cap, worst, tried, skipped, len(usable))


def _notes(config: PlanConfig, ctx: PlanContext, k: int, usable: int, baseline, plan_vpp: int = 1,
           tried_vpp: list[int] = (), vpp_skipped: str = "") -> list[str]:
    """The report's notes: budget, micro-batches, simulation, choice, and a baseline over the budget."""
    budget = config.budget_bytes
    notes = [f"budget = {config.gpu_memory_bytes / GIB:.1f} GiB x (1 - {config.memory_reserve}) = "
             f"{budget / GIB:.1f} GiB per GPU",
             f"{ctx.m} micro-batches per iteration = ceil({config.global_batch_size} / ({ctx.dp} DP x {k} samples))",
             *([f"context parallel over {ctx.cp} ranks: samples padded to a multiple of "
                f"{cp_multiple(ctx.cp, sp_tp(ctx.tp))} tokens (2 x CP"
                f"{' x TP: sequence parallelism' if sp_tp(ctx.tp) > 1 else ''}), stage times and memory per CP rank"]
               if ctx.cp > 1 else []),
             f"{config.sim_iterations} iterations simulated per setting (every DP rank; slowest rank + all-reduce)",
             f"configuration chosen for the fastest "
             f"{'balanced plan' if config.choose_for == 'omnibal' else 'Megatron default'} among {usable} that fit"]
    if plan_vpp > 1:
        notes.append(f"interleaved pipeline: V={plan_vpp} model chunks per rank ({plan_vpp} x {ctx.pp} virtual "
                     f"stages), predicted faster than V=1; {RECOMPUTE_NOTE}")
    elif tried_vpp:
        notes.append(f"interleaved pipeline: V in {tried_vpp} tried; V=1 predicted fastest")
    elif vpp_skipped:
        notes.append(f"interleaved pipeline not considered: {vpp_skipped}")
    if not baseline.fits_memory:
        notes.append(f"the Megatron-default baseline exceeds the budget at its mean padded micro-batch "
                     f"({max(baseline.stage_peak_bytes) / GIB:.1f} GiB); its time is predicted as if it ran")
    return notes


def make_plan(stats: SampleStats, config: PlanConfig) -> Plan:
    """Plan data, model and memory balance together (see the package docstring).

    stats: per-sample tiles and tokens (and, for a family counting patches, each sample's images: the plan then
    counts patches as its ViT items, groups them in predicted time as the trainer does (``data_level``; the ISF
    thresholds, the micro-batch shapes and the step times are those of the time groups), and its micro-batch
    shapes carry the data's ViT attention segments per patch, ``model.sample_time.VisionSegments``); config: the
    request (:class:`PlanConfig`).
    Raises PlanError when nothing fits.
    """
    spec, dev = config.spec, config.device_spec
    segments = vision_segments(stats, spec)
    stats = stats.in_vision_items(family_of(spec).vision_item)
    check_request(config, stats)
    k, samples, gpus, seed = int(config.samples_per_group), config.epoch_samples(stats), config.gpus, config.seed
    cache: dict = {}
    work = sample_work_of(stats, config)
    chosen = _choose_configuration(stats, config, cache, segments, work)
    ctx, data = chosen.ctx, chosen.data
    t, p, d, m = ctx.tp, ctx.pp, ctx.dp, ctx.m

    loads_r, _, _ = random_loads(stats, k, d, m, config.sim_iterations, seed, ctx.cp, sp_tp(t))
    loads_i = isf_loads(stats, data, m, config.sim_iterations, seed, ctx.cp, sp_tp(t))
    default = default_layout(spec, p)

    base = simulate_candidate(ctx, default_candidate(ctx, default), loads_r, True)
    plus_data = simulate_candidate(ctx, default_candidate(ctx, default), loads_i, True)
    model_c = [simulate_candidate(ctx, c, loads_i, True) for c in model_candidates(ctx, default)]
    # +model must fit memory with full recompute (the default layout may not)
    plus_model = best_candidate(fitting_model_candidates(ctx, model_c))
    n_units = len(ctx.costs_isf.units)
    check_fixed_vpp(config.vpp, p, m, n_units)
    vpps = vpp_values(config.vpp, config.max_vpp)
    mem_c, vpp_failures, tried_vpp, skipped = [], [], [], []
    if 1 in vpps:
        mem_c = [simulate_candidate(ctx, c, loads_i, True)
                 for c in memory_candidates(ctx, [("+model", plus_model.layout), ("default", default)], cache)]
    for v in vpps:
        if v == 1:
            continue
        problem = vpp_problem(p, m, v, n_units)
        if problem:
            skipped.append(problem)
            continue
        tried_vpp.append(v)
        cands, why = interleaved_candidates(ctx, v)
        vpp_failures += why
        mem_c += [simulate_candidate(ctx, c, loads_i, True) for c in cands]
    if not mem_c:
        raise nothing_fits(ctx, "+memory", vpp_failures or ["no V to try"])
    plus_memory = best_candidate(mem_c)

    rows = with_speedups([
        prediction_row(ctx, "baseline", "random", base, ctx.costs_random, loads_r.mean_shape, samples, gpus),
        prediction_row(ctx, "+data", "isf", plus_data, ctx.costs_isf, loads_i.mean_shape, samples, gpus),
        prediction_row(ctx, "+model", "isf", plus_model, ctx.costs_isf, loads_i.mean_shape, samples, gpus),
        prediction_row(ctx, "+memory", "isf", plus_memory, ctx.costs_isf, loads_i.mean_shape, samples, gpus),
    ])

    final = rows[-1]
    flags = plan_trainer_flags(spec.name, t, p, final.layout_flag, final.recompute_flag, data.params, k, m * d * k,
                               bf16=ctx.precision == MIXED_BF16_ADAM, freeze_flags=config.freeze.flags(), cp=ctx.cp,
                               vpp=final.vpp, time_device=dev.name)
    flags.update(moe_trainer_flags(spec.language.moe, ctx.experts.grid))
    shapes = {
        "isf_caps": chosen.cap.to_dict(),
        "isf_mean": shape_dict(loads_i.mean_shape),
        "random_mean_padded": shape_dict(loads_r.mean_shape),
        "random_worst_padded": shape_dict(chosen.worst_random),
    }
    isf = {"params": data.params.to_dict(), "metrics": dict(data.metrics), "groups": int(len(data.grouping)),
           "search_seconds": float(data.seconds_search), "samples_per_group": float(data.grouping.sizes.mean())}
    return Plan(
        serving=serving_rows(config, stats, t, ctx.experts.grid.ep, {r.setting: r for r in rows}),
        model=spec.name, device=dev.name, gpus=gpus, tp=t, pp=p, dp=d, cp=ctx.cp,
        ep=ctx.experts.grid.ep, etp=ctx.experts.grid.etp, moe=spec.language.moe is not None,
        gpu_memory_bytes=float(config.gpu_memory_bytes), budget_bytes=config.budget_bytes, samples=samples,
        samples_per_group=k, global_batch_size=m * d * k, num_microbatches=m, attention=config.attention, isf=isf,
        random=dict(random_metrics(stats, config, d, t, sp_tp(t) if ctx.cp > 1 else 1, work)), shapes=shapes,
        rows=tuple(rows),
        trainer_flags=flags, configs_tried=tuple(chosen.tried + chosen.skipped),
        notes=tuple(_notes(config, ctx, k, chosen.usable, rows[0], final.vpp, tried_vpp, "; ".join(skipped))),
        timelines={r.setting: c.sim.timeline for r, c in zip(rows, (base, plus_data, plus_model, plus_memory))},
        stage_time_bars={r.setting: list(r.stage_time_s) for r in rows},
    )


def serving_rows(config: PlanConfig, stats: SampleStats, tp: int, ep: int, rows: dict) -> tuple[dict, ...]:
    """What each setting's layout (each layout once, by its first setting) serves at (``decode_cost.decode_estimate``)
    at ``config.serve_batches``, with the data's mean sample as the prompt and its tokens as the cached context (or
    ``config.serve_context``); an interleaved layout (generation runs one stage per rank) is left out."""
    spec = config.spec
    tokens = float(np.mean(stats.tokens)) if len(stats) else 0.0
    prompt = MicroBatchShape(int(round(float(np.mean(stats.vit)))) if len(stats) else 0, max(1, int(round(tokens))))
    context = float(config.serve_context) if config.serve_context is not None else tokens
    out, seen = [], set()
    for setting, row in rows.items():
        if row.vpp > 1 or row.layout_flag in seen:
            continue
        seen.add(row.layout_flag)
        layout = parse_layout(row.layout_flag, spec, len(row.stage_units))
        for batch in config.serve_batches:
            est = decode_estimate(spec, config.device_spec, tp, layout, DecodeLoad(batch, context), ep, prompt)
            out.append({"setting": setting, "layout": row.layout_flag, **est.to_dict()})
    return tuple(out)
