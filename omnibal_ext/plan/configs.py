"""Parallel sizes: the (tp, pp, dp) candidates, a quick screen of each, and the refusal when none fits."""
from __future__ import annotations

import math

import numpy as np

from ..memory.memory_model import GIB
from ..memory.recompute import MemoryBudgetError, full_recompute_plan
from ..model import partition
from ..model.cost_model import DeviceSpec, MicroBatchShape
from ..model.layout import LayoutError, default_layout
from ..model.moe_cost import MEAN_RUN, ExpertRun
from ..model.units import ModelSpec, build_units
from .config import PlanError
from .context import allreduce_s, build_context, stage_peaks
from .interleaved import interleaved_candidates, vpp_problem
from .linear_costs import full_modes, stage_coefficients
from .memory_level import joint_plan, joint_stage_modes
from .memory_need import memory_need
from .simulation import mean_shape_iteration_s
from .trainer_flags import tp_problem

TP_CHOICES = (1, 2, 4, 8)  # tensor-parallel sizes tried when --tp is not given


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def num_microbatches(global_batch: int, dp: int, k: int) -> int:
    """Micro-batches per iteration: ``ceil(global batch / (dp * K))``, at least 1."""
    return max(1, math.ceil(global_batch / (dp * k)))


def candidate_configs(spec: ModelSpec, gpus: int, tp=None, pp=None, dp=None,
                      min_pp: int = 1, cp: int = 1) -> tuple[list[tuple[int, int, int]], list[dict]]:
    """(tp, pp, dp) triples to try (pipeline depth at least ``min_pp``), and the skipped ones with a reason.

    cp: the context-parallel size (fixed, not searched): DP = gpus / (TP x PP x CP)."""
    n_units = len(build_units(spec))
    if gpus % cp:
        return [], [{"cp": cp, "reason": f"CP {cp} does not divide {gpus} GPUs"}]
    full_gpus = gpus
    gpus //= cp  # GPUs per CP rank: the (tp, pp, dp) grid of one CP slice
    tps = [tp] if tp is not None else [t for t in TP_CHOICES if gpus % t == 0]
    out, skipped = [], []
    for t in tps:
        if gpus % t:
            skipped.append({"tp": t, "reason": f"TP {t} does not divide {gpus} GPUs"
                            + (f" per CP rank ({full_gpus} / CP {cp})" if cp > 1 else "")})
            continue
        problem = tp_problem(spec, t)
        if problem:
            skipped.append({"tp": t, "reason": problem})
            continue
        pps = [pp] if pp is not None else divisors(gpus // t)
        for p in pps:
            if (gpus // t) % p:
                skipped.append({"tp": t, "pp": p, "reason": f"TP {t} x PP {p} does not divide {gpus} GPUs"
                                + (f" per CP rank ({full_gpus} / CP {cp})" if cp > 1 else "")})
                continue
            d = gpus // (t * p)
            if dp is not None and d != dp:
                skipped.append({"tp": t, "pp": p, "reason": f"gives DP {d}, not the DP {dp} asked for"})
                continue
            if p > n_units:
                skipped.append({"tp": t, "pp": p, "reason": f"PP {p} exceeds the model's {n_units} pipeline units"})
                continue
            if p < min_pp:
                skipped.append({"tp": t, "pp": p, "reason": f"PP {p} is below the {min_pp} stages asked for"})
                continue
            try:
                default_layout(spec, p)
            except LayoutError as e:
                skipped.append({"tp": t, "pp": p, "reason": f"no default layout to compare with: {e}"})
                continue
            out.append((t, p, d))
    return out, skipped


def screen_config(spec: ModelSpec, device: DeviceSpec, budget: float, attention: str, cfg: tuple[int, int, int],
                  k: int, global_batch: int, cap_shape: MicroBatchShape, random_shape: MicroBatchShape,
                  mean_isf: tuple[np.ndarray, float], mean_random: np.ndarray, baseline_needed: bool,
                  cache: dict | None = None, trainable=None, cp: int = 1, vpps=(1,), segments=None,
                  experts: ExpertRun = MEAN_RUN) -> dict:
    """Quick look at one (tp, pp, dp): least memory need, the baseline's memory, and the time per sample
    of the balanced (+memory) plan and of the baseline, each with every micro-batch at its mean shape.

    budget: bytes per GPU; k: samples per micro-batch; global_batch: samples per iteration; mean_isf:
    (mean ISF group shape, mean samples per group); mean_random: the mean padded random micro-batch shape;
    cp: the context-parallel size (the shapes carry it; ``rec["cp"]`` is written when > 1).
    vpps: the model chunks per rank V to try (V > 1: ``interleaved``; skipped where the micro-batches do not
    allow it); the fastest is ``vpp``. segments: the data's ViT segments per item (``build_context``).
    experts: the MoE layers' expert grid and load (``rec["ep"]``, ``rec["etp"]`` are written for an MoE model).
    """
    t, p, d = cfg
    m = num_microbatches(global_batch, d, k)
    ctx = build_context(spec, device, t, p, d, m, budget, attention, cap_shape, random_shape, trainable, cp,
                        segments, experts)
    need, stage, _ = memory_need(ctx.need)
    moe = {"ep": experts.grid.ep, "etp": experts.grid.etp} if spec.language.moe is not None else {}
    rec = {"tp": t, "pp": p, **({"cp": cp} if cp > 1 else {}), **moe, "dp": d, "micro_batches": m,
           "least_need_bytes": need, "need_stage": stage,
           "fits": bool(need <= budget)}
    default = default_layout(spec, p)
    full = full_recompute_plan(default, ctx.costs_random.units)
    rec["baseline_peak_bytes"] = max(stage_peaks(ctx, ctx.costs_random, default, full))
    rec["baseline_fits"] = bool(rec["baseline_peak_bytes"] <= budget)
    coefs = stage_coefficients(ctx.basis, default, p, device.p2p_bytes_per_s, full_modes(ctx.costs_random))
    it = mean_shape_iteration_s(coefs, mean_random, m)
    it += allreduce_s(ctx, default)
    rec["baseline_estimated_seconds_per_sample"] = it / (m * d * k)
    if not rec["fits"] or (baseline_needed and not rec["baseline_fits"]):
        return rec
    try:
        joint = joint_plan(ctx, cache)
    except (MemoryBudgetError, partition.PartitionError) as e:
        rec["fits"], rec["reason"] = False, str(e)
        return rec
    shape, group_samples = mean_isf
    per_sample = {}
    if 1 in vpps:
        coefs = stage_coefficients(ctx.basis, joint.layout, p, device.p2p_bytes_per_s, joint_stage_modes(ctx, joint))
        it = mean_shape_iteration_s(coefs, shape, m)
        it += allreduce_s(ctx, joint.layout)
        per_sample[1] = it / (m * d * group_samples)
    n_units = len(ctx.costs_isf.units)
    failures = []
    for v in vpps:
        if v == 1:
            continue
        problem = vpp_problem(p, m, v, n_units)
        if problem:
            failures.append(problem)
            continue
        cands, why = interleaved_candidates(ctx, v)
        failures += why
        for c in cands:
            coefs = stage_coefficients(ctx.basis, c.layout, p, device.p2p_bytes_per_s, c.modes)
            it = mean_shape_iteration_s(coefs, shape, m, v) + allreduce_s(ctx, c.layout)
            per_sample[v] = min(per_sample.get(v, np.inf), it / (m * d * group_samples))
    if not per_sample:
        rec["fits"], rec["reason"] = False, "; ".join(failures) or "no V to try"
        return rec
    v = min(per_sample, key=lambda x: (per_sample[x], x))
    rec["vpp"] = v
    rec["estimated_seconds_per_sample"] = per_sample[v]
    rec["estimated_seconds_per_sample_by_vpp"] = {str(x): float(s) for x, s in sorted(per_sample.items())}
    return rec


def _cp(rec: dict) -> str:
    """" CP=n" for a screened configuration with context parallelism, " EP=e ETP=t" for an MoE model's, else ""."""
    cp = f" CP={rec['cp']}" if rec.get("cp", 1) > 1 else ""
    return cp + (f" EP={rec['ep']} ETP={rec['etp']}" if "ep" in rec else "")


def refusal(spec: ModelSpec, gpus: int, gpu_memory: float, budget: float, tried: list[dict], skipped: list[dict],
            baseline_needed: bool) -> PlanError:
    """Why no configuration can be planned: the least demanding one, its stage and need (bytes per GPU)."""
    if not tried:
        why = "; ".join(sorted({s["reason"] for s in skipped})) or "no parallel configuration to try"
        return PlanError(f"{spec.name} on {gpus} GPUs: no usable (TP, PP, DP): {why}")
    best = min(tried, key=lambda r: r["least_need_bytes"])
    if best["least_need_bytes"] <= budget and baseline_needed:
        b = min(tried, key=lambda r: r["baseline_peak_bytes"])
        return PlanError(
            f"{spec.name} on {gpus} GPUs of {gpu_memory / GIB:.0f} GiB: the Megatron-default baseline fits no "
            f"configuration: the least demanding, TP={b['tp']} PP={b['pp']}{_cp(b)} DP={b['dp']}, needs "
            f"{b['baseline_peak_bytes'] / GIB:.1f} GiB against a budget of {budget / GIB:.1f} GiB per GPU")
    planner_failed = [r for r in tried if "reason" in r]
    if best["least_need_bytes"] <= budget and planner_failed:  # memory would do, the planner found no plan
        return PlanError(
            f"{spec.name} on {gpus} GPUs of {gpu_memory / GIB:.0f} GiB: no configuration has a plan that fits "
            f"{budget / GIB:.1f} GiB per GPU: " + "; ".join(
                f"TP={r['tp']} PP={r['pp']}{_cp(r)} DP={r['dp']}: {r['reason']}" for r in planner_failed))
    return PlanError(
        f"{spec.name} does not fit {gpus} GPUs of {gpu_memory / GIB:.0f} GiB: the least demanding configuration, "
        f"TP={best['tp']} PP={best['pp']}{_cp(best)} DP={best['dp']}, needs "
        f"{best['least_need_bytes'] / GIB:.1f} GiB on "
        f"pipeline stage {best['need_stage']} (full recompute, best layout) against a budget of "
        f"{budget / GIB:.1f} GiB per GPU")
