"""Analytic cost model: FLOPs, times and bytes of every pipeline unit for one micro-batch.

Everything here is for ONE micro-batch on ONE tensor-parallel rank (matching ``costs.UnitCost``).

Each unit's FLOPs, bytes and parameters come from its family's component (``components.py`` for
the GPT decoder every family shares, ``families/<name>.py`` for the ViT and projector); this module
turns them into times and cost tables, and calibrates them on a profile. The micro-batch
(``MicroBatchShape``) holds ``vision_items`` (the ViT's work in its family's unit: tiles, patches)
and ``llm_tokens`` LLM tokens (text plus image tokens).

FLOPs of the shared decoder (forward, one multiply-add = 2 FLOPs), ``T`` tokens, ``h`` hidden, ``f``
MLP hidden:

* LLM layer: ``2*T*h*(h + 2*g*d)`` (Q plus grouped K, V: ``g`` query groups of head size ``d``),
  ``2*T*h*h`` (out projection), ``6*T*h*f`` (SwiGLU: gate, up, down; 4*T*h*f without SwiGLU) and
  attention ``4*h*pairs`` with ``pairs = 0.5 * sum(len_i^2)`` over the packed samples (causal
  attention computes only the lower triangle, as FlashAttention does). ``MicroBatchShape``'s
  ``llm_attn_tokens_sq`` gives ``sum(len_i^2)``; when None the micro-batch is one sequence of
  ``llm_tokens`` (the upper bound).
* Output head: ``2*T*h*V``; LLM embedding: no FLOPs (a gather; timed as memory traffic
  ``2*T*h*dtype_bytes`` bytes).

Times: forward ``flops / tp / (peak * efficiency[kind])``, or ``bytes / mem_bytes_per_s`` for a
memory-bound kind; backward is
``device.bwd_over_fwd`` times the forward. The backward has twice the forward's FLOPs (gradients of
inputs and of weights), but its large matmuls run closer to peak: on A100 a Megatron transformer layer
measured 7.7 ms forward and 11.9 ms backward (Korthikanti et al. 2022, Table 4, 22B model), a ratio
of 1.55, and full recompute added 39% to the layer (7.7 ms more in the backward).  The A100 preset
uses that ratio; the Hopper presets use 1.79, our trainer's layers measured on an H200
(``profiles/h200``); a profile (``calibrated_costs``) fits its own. Tensor-parallel all-reduces are
added at the device's intra-node bus bandwidth (each component's ``tp_allreduce_bytes``); a ViT whose
heads TP does not divide (25, say) is built with them padded to a multiple of the TP size
(``padded_heads``), and its FLOPs, bytes and parameters count the padded heads.

Activation bytes of a pre-norm transformer layer per token (our generalisation of Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", which without sequence
parallelism gives ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes for fp16, dropout, MHA and f=4h).
With ``D = dtype_bytes``, ``t = tp`` and ``p`` = 1 with dropout (1-byte masks) else 0:

* replicated on every TP rank: two norm inputs ``2*h*D``, QKV input ``h*D``, MLP input ``h*D``,
  two dropout masks ``2*h*p``;
* split by TP: Q, K, V ``(h + 2*g*d)*D/t``, out-projection input ``h*D/t``, MLP: GELU input and
  second matmul input ``2*f*D/t`` (SwiGLU: gate+up outputs and down input ``3*f*D/t``);
* attention core (unfused attention keeps the softmax output, dropout mask and dropout output):
  ``a*S*(D + p + p*D)/t`` per token, ``S`` the attended length (per tile for the ViT; for the LLM
  ``sum(len_i^2)/T``).

With p=1, D=2, MHA, f=4h this is exactly Korthikanti's ``34 + 5*a*s/h`` at t=1. What our trainer's
layers keep beyond that (the norms' fp32 statistics, the fused QKV output and rotated query and key of
grouped attention, megatron-core's unfused GLU, rotary tables, per-sample attention outputs; what differs
by device, ``DeviceSpec.kernels``: a CPU's composite RMSNorm) is listed in ``layer_act_bytes_per_token``;
with it the model matches the saved tensors of our layers on a CPU and the H200 profiles in
``profiles/h200`` to 0.1%. ``act_bytes``
assumes unfused attention (``attention="unfused"``, the default) so that selective recompute
(``act_bytes_selective``: the same without the attention core) has something to save; with
``attention="flash"`` the core keeps only its output and log-sum-exp, and selective recompute
saves nothing. ``act_bytes_full`` is the layer input only (``T*h*D``, replicated).
``selective_recompute_s`` is the forward time of the attention core (scores, softmax, context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from .components import FUSED_KERNELS, CostComponent, LayerKernels
from .costs import CostTable, UnitCost
from .expert_load import measured_imbalance
from .moe import ExpertGrid
from .moe_cost import MEAN_RUN, ExpertRun, alltoall_seconds
from .shape import MicroBatchShape
from .side_bytes import with_side_bytes
from .spec import ModelSpec
from .units import build_units, spec_from_dict, unit_components


@dataclass(frozen=True)
class DeviceSpec:
    """A device for the analytic model.

    matmul_flops_per_s: PEAK dense matmul rate in the training dtype, FLOP/s (the achieved fraction
        is the per-kind ``efficiency`` of ``analytic_costs``).
    mem_bytes_per_s: achievable memory bandwidth, bytes/s.
    p2p_bytes_per_s: pipeline point-to-point bandwidth between neighbouring stages, bytes/s.
    memory_bytes: device memory, bytes.
    bwd_over_fwd: backward time / forward time of a unit (no recompute); 2.0 is the FLOP ratio.
    tp_bytes_per_s: all-reduce bus bandwidth among the GPUs of a node (tensor parallelism), bytes/s:
        an all-reduce of ``n`` bytes over ``t`` ranks takes ``2 (t-1)/t * n / tp_bytes_per_s``.
    kernels: what its kernels keep for backward where devices differ (``components.LayerKernels``).
    """

    name: str
    matmul_flops_per_s: float
    mem_bytes_per_s: float
    p2p_bytes_per_s: float
    memory_bytes: float
    bwd_over_fwd: float = 2.0
    tp_bytes_per_s: float = 100e9
    kernels: LayerKernels = FUSED_KERNELS


GiB = 2**30

# Peak bf16 dense rates from the vendors' data sheets. Memory bandwidth is ~80% of the data-sheet
# HBM rate (what STREAM-like copies reach). p2p is the inter-node rate per GPU (pipeline stages
# usually sit on different nodes): A100 with one HDR 200 Gb/s HCA per GPU (25 GB/s), H100/H200 with
# one NDR 400 Gb/s HCA per GPU (50 GB/s). Tensor-parallel all-reduces stay in a node: NCCL's
# all_reduce_perf reaches a bus bandwidth of about 230 GB/s on DGX A100 (NVLink 3) and about 450 GB/s
# on DGX H100/H200 (NVLink 4) for large messages. The CPU entry is a rough 2-core laptop-class machine
# (only used to sanity-check small runs; calibrate with a profile for real numbers).
# Backward/forward time of a transformer layer: on A100 as published (module docstring); on Hopper
# as measured here, our trainer's ViT and LLM layers of the 6B ViT + 20B LLM preset in bf16 on an H200 at 9 tiles
# and 4096 tokens (profiles/h200: 7.99/4.48 ms and 11.97/6.70 ms). H100 is the same chip.
A100_BWD_OVER_FWD = 11.9 / 7.7  # Korthikanti et al. 2022, Table 4: 22B layer on A100, ms
HOPPER_BWD_OVER_FWD = 1.79
DEVICES: dict[str, DeviceSpec] = {
    "a100-80g": DeviceSpec("a100-80g", 312e12, 0.8 * 2.039e12, 25e9, 80 * GiB, A100_BWD_OVER_FWD, 230e9),
    "h100-80g": DeviceSpec("h100-80g", 989e12, 0.8 * 3.35e12, 50e9, 80 * GiB, HOPPER_BWD_OVER_FWD, 450e9),
    "h200-141g": DeviceSpec("h200-141g", 989e12, 0.8 * 4.8e12, 50e9, 141e9, HOPPER_BWD_OVER_FWD, 450e9),
    "cpu": DeviceSpec("cpu", 100e9, 20e9, 5e9, 16 * GiB, 2.0, 5e9, LayerKernels(rms_norm="composite")),
}

def get_device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise UserError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None


# ----------------------------------------------------------------------------------------------
# Per-unit numbers (each unit's family component computes them)
# ----------------------------------------------------------------------------------------------
def unit_flops(spec: ModelSpec, shape: MicroBatchShape, tp: int = 1) -> list[float]:
    """Forward FLOPs of every unit of ``build_units(spec)`` for one micro-batch, summed over the TP
    ranks (``tp`` only adds the ViT's padded heads)."""
    return [c.flops(shape, tp)[0] for c in unit_components(spec)]


def unit_work(spec: ModelSpec, shape: MicroBatchShape, tp: int = 1, experts: ExpertRun = MEAN_RUN) -> list[float]:
    """What calibration divides time by: forward FLOPs per TP rank (an MoE layer's experts at the busiest EP rank's
    load of ``experts``), or memory bytes for memory-bound units (``CostComponent.rank_work``)."""
    return [c.with_experts(experts).rank_work(shape, tp) for c in unit_components(spec)]


def unit_param_counts(spec: ModelSpec, tp: int = 1) -> list[int]:
    """Parameters of every unit (weights, biases, norm weights, qk-norm weights, layer scales), whole
    model; at ``tp`` the ViT's padded heads included. A tied output layer is counted in the head too:
    it holds its own copy whenever E and L sit on different stages."""
    return [int(c.params(tp)) for c in unit_components(spec)]


# ----------------------------------------------------------------------------------------------
# Cost tables
# ----------------------------------------------------------------------------------------------
def _seconds_per_work(device: DeviceSpec, components: list[CostComponent],
                      efficiency: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds per unit of work of each kind of unit: per forward FLOP at the kind's efficiency (its
    component's, or ``efficiency[kind]``), per byte at the memory bandwidth for memory-bound kinds."""
    kinds = {c.kind: c for c in components}
    unknown = set(efficiency or {}) - set(kinds)
    if unknown:
        raise ValueError(f"efficiency: unknown unit kinds {sorted(unknown)}; kinds: {', '.join(kinds)}")
    rates = {}
    for kind, component in kinds.items():
        if component.memory_bound:
            rates[f"fwd:{kind}"] = rates[f"bwd:{kind}"] = 1.0 / device.mem_bytes_per_s
            continue
        eff = (efficiency or {}).get(kind, component.efficiency)
        if not eff > 0:
            raise ValueError(f"efficiency[{kind!r}] must be > 0, got {eff}")
        fwd = 1.0 / (device.matmul_flops_per_s * eff)
        rates[f"fwd:{kind}"], rates[f"bwd:{kind}"] = fwd, device.bwd_over_fwd * fwd
    return rates


def default_efficiency(spec: ModelSpec) -> dict[str, float]:
    """The analytic model's fraction of peak matmul rate of each kind of unit of ``spec``: ~0.5 is what
    large Megatron runs report as model FLOPs utilisation of the transformer layers; the components
    of units that reach less (a patch embedding's narrow reduction, a projector's few tokens) say so."""
    return {c.kind: c.efficiency for c in unit_components(spec)}


def tp_allreduce_s(nbytes: float, tp: int, device: DeviceSpec) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``tp`` ranks: ``2 (tp-1)/tp * nbytes / bus bandwidth``."""
    return 0.0 if tp == 1 else 2.0 * (tp - 1) / tp * nbytes / device.tp_bytes_per_s


def _costs_from_rates(spec, shape, tp, rates, dropout, attention, source, meta, comm_device=None,
                      sequence_parallel: bool = False, kernels: LayerKernels = FUSED_KERNELS,
                      experts: ExpertRun = MEAN_RUN, a2a_device=None) -> CostTable:
    """comm_device: add its TP all-reduce times (a profile's fitted rates already hold its own);
    sequence_parallel: the trainer's --sequence-parallel (components.py: activations and TP traffic);
    kernels: what the device's kernels keep (activation bytes); experts: how MoE layers run (``moe_cost``: EP /
    ETP, expert load); a2a_device: add its expert-parallel all-to-all times (None: the profile's hold them)."""
    if tp < 1:
        raise UserError(f"tensor-parallel size must be >= 1, got {tp}")
    sp = bool(sequence_parallel) and tp > 1
    units = build_units(spec)
    params = unit_param_counts(spec, tp)
    work = unit_work(spec, shape, tp, experts)
    rows = []
    components = [c.with_experts(experts) for c in unit_components(spec)]
    for u, c, w, n_param in zip(units, components, work, params):
        total, core = c.flops(shape, tp)
        fwd, bwd = w * rates[f"fwd:{u.kind}"], w * rates[f"bwd:{u.kind}"]
        core_s = fwd * (core / total) if total > 0 else 0.0  # the core's share of the forward time
        if comm_device is not None and tp > 1:
            # Megatron's tensor parallelism, with or without sequence parallelism (each component says its bytes)
            fwd_bytes, bwd_bytes = c.tp_allreduce_bytes(shape, sequence_parallel=sp, tp=tp)
            fwd += tp_allreduce_s(fwd_bytes, tp, comm_device)
            bwd += tp_allreduce_s(bwd_bytes, tp, comm_device)
        w_fwd, w_bwd = c.expert_weight_bytes(shape.dtype_bytes)
        if w_fwd and a2a_device is not None:  # the local experts' weight traffic (analytic rates only)
            fwd += w_fwd / a2a_device.mem_bytes_per_s
            bwd += w_bwd / a2a_device.mem_bytes_per_s
        if a2a_device is not None:  # expert parallelism: the token dispatcher's all-to-alls
            a2a_fwd, a2a_bwd = c.ep_alltoall_bytes(shape, tp, sequence_parallel=sp)
            fwd += alltoall_seconds(a2a_fwd, experts.grid, a2a_device)
            bwd += alltoall_seconds(a2a_bwd, experts.grid, a2a_device)
        b = c.act_bytes(shape, tp, dropout, attention, sequence_parallel=sp, kernels=kernels)
        rows.append(UnitCost(u.name, u.kind, fwd, bwd, float(b.act), float(b.full), float(b.selective),
                             float(core_s), float(b.send), n_param, u.code, expert_params=int(c.expert_params()),
                             expert_split=experts.grid.ep * experts.grid.etp if c.expert_params() else 1))
    meta = dict(meta)
    meta.update({"model": spec.name, "spec": spec.to_dict(), "shape": shape.to_dict(), "tp": tp,
                 "dropout": dropout, "attention": attention, "sequence_parallel": sp})
    if spec.language.moe is not None:
        meta.update({"ep": experts.grid.ep, "etp": experts.grid.etp, "moe_imbalance": experts.imbalance})

    return with_side_bytes(CostTable(tuple(rows), source, meta), spec, shape)


def analytic_costs(
    spec: ModelSpec,
    shape: MicroBatchShape,
    tp: int = 1,
    device: DeviceSpec = DEVICES["a100-80g"],
    efficiency: dict[str, float] | None = None,
    *,
    dropout: bool = False,
    attention: str = "unfused",
    sequence_parallel: bool = False,
    experts: ExpertRun = MEAN_RUN,
) -> CostTable:
    """Costs of every unit of ``spec`` for one micro-batch of ``shape`` on one TP rank of ``device``.

    efficiency: fraction of ``device.matmul_flops_per_s`` reached per unit kind (defaults:
    ``default_efficiency(spec)``). dropout: count 1-byte dropout masks (VLM fine-tuning usually uses none).
    attention: "unfused" (scores kept for backward) or "flash". With ``tp`` > 1 the units' times
    include their TP all-reduces (``tp_allreduce_bytes`` over ``device.tp_bytes_per_s``).
    sequence_parallel: with ``tp`` > 1, the trainer's --sequence-parallel (activations split, tokens padded).
    experts: how MoE layers run (``moe_cost.ExpertRun``: EP / ETP, the busiest EP rank's load); their dispatch
    all-to-alls are added at ``device``'s rates.
    """
    rates = _seconds_per_work(device, unit_components(spec), efficiency)
    return _costs_from_rates(spec, shape, tp, rates, dropout, attention, "analytic",
                             {"device": device.name, "efficiency": {**default_efficiency(spec), **(efficiency or {})}},
                             comm_device=device, sequence_parallel=sequence_parallel, kernels=device.kernels,
                             experts=experts, a2a_device=device)


def calibrate(profile: CostTable, spec: ModelSpec, shape: MicroBatchShape, tp: int = 1,
              experts: ExpertRun | None = None) -> dict[str, float]:
    """Fit seconds per unit of work, per kind, from a measured ``profile`` of ``spec`` at ``shape``.

    Returns ``{"fwd:<kind>": s, "bwd:<kind>": s}``: seconds per forward FLOP (per TP rank) for
    kinds with FLOPs, and seconds per memory byte for memory-bound kinds (the LLM embedding) (see ``unit_work``); the
    backward rate is also per FORWARD FLOP. Each is the least-squares fit through the origin,
    ``sum(t_i * w_i) / sum(w_i^2)`` over the profile's units of that kind. Kinds absent from the
    profile (or with zero measured time) are left out. Small models are dominated by per-kernel
    overhead, so profile a shape large enough for the layers to be compute-bound.
    """
    units = build_units(spec)
    if len(profile.units) != len(units):
        raise UserError(
            f"calibrate: the profile has {len(profile.units)} units but model {spec.name!r} has {len(units)}"
        )
    for i, (pu, u) in enumerate(zip(profile.units, units)):
        if pu.name != u.name:
            raise UserError(f"calibrate: profile unit {i} is {pu.name!r} but model {spec.name!r} has {u.name!r}")
    run = profile_expert_run(profile) if experts is None else experts
    work = np.asarray(unit_work(spec, shape, tp, run), dtype=float)
    fwd = np.asarray([u.fwd_s for u in profile.units], dtype=float)
    bwd = np.asarray([u.bwd_s for u in profile.units], dtype=float)
    kinds = np.asarray([u.kind for u in units])
    rates: dict[str, float] = {}
    for kind in dict.fromkeys(u.kind for u in units):
        sel = (kinds == kind) & (work > 0)
        if not sel.any():
            continue
        w2 = float(np.sum(work[sel] ** 2))
        for direction, t in (("fwd", fwd), ("bwd", bwd)):
            rate = float(np.sum(t[sel] * work[sel]) / w2)
            if rate > 0 and math.isfinite(rate):
                rates[f"{direction}:{kind}"] = rate
    return rates


def profile_expert_run(profile: CostTable) -> ExpertRun:
    """The expert run a profile was measured under: its meta's "ep", "etp" and "moe_imbalance" (the busiest EP
    rank's routed tokens over the mean a cost table assumed), else the expert load ``omnibal profile`` measured at
    that EP (``expert_load.measured_imbalance``); neither: unknown."""
    meta = profile.meta or {}
    grid = ExpertGrid(int(meta.get("ep", 1)), int(meta.get("etp", 1)))
    imbalance = meta.get("moe_imbalance")
    if imbalance is None:
        imbalance = measured_imbalance(meta, grid.ep)
    return ExpertRun(grid, None if imbalance is None else float(imbalance))


def calibrated_costs(
    spec: ModelSpec,
    shape: MicroBatchShape,
    profile: CostTable,
    tp: int = 1,
    *,
    profile_spec: ModelSpec | None = None,
    profile_shape: MicroBatchShape | None = None,
    profile_tp: int | None = None,
    device: DeviceSpec | None = None,
    dropout: bool = False,
    attention: str = "unfused",
    sequence_parallel: bool = False,
    experts: ExpertRun = MEAN_RUN,
) -> CostTable:
    """Analytic costs of ``spec`` at ``shape`` with times scaled by rates fitted on ``profile``.

    The profile's own model, shape and TP size come from ``profile.meta`` ("spec", "shape", "tp",
    as the profiler (``omnibal profile``, the trainer's launch profile) records them) unless given. Kinds the profile lacks fall back to
    the analytic rates of ``device`` (default: the profile's meta "device" if it names a preset,
    else a100-80g). Bytes are analytic. A profile taken at TP 1 holds no all-reduce, so ``device``'s
    TP all-reduce times are added; a profile at TP > 1 holds its own in the fitted rates.
    experts: how MoE layers run; an unknown load (``imbalance`` None) takes the one the profile measured on data at
    ``experts``' EP (``expert_load.measured_imbalance``), else its run's (``profile_expert_run``), else stays unknown (time at the mean, memory at the worst case). The all-to-alls are
    added at ``device``'s rates.
    """
    meta = profile.meta or {}
    if profile_spec is None:
        if "spec" not in meta:
            raise UserError("calibrated_costs: the profile's meta has no 'spec'; pass profile_spec")
        profile_spec = spec_from_dict(meta["spec"])
    if profile_shape is None:
        if "shape" not in meta:
            raise UserError("calibrated_costs: the profile's meta has no 'shape'; pass profile_shape")
        profile_shape = MicroBatchShape.from_dict(meta["shape"])
    profile_tp = int(profile_tp or meta.get("tp", 1))
    if device is None:
        device = DEVICES.get(str(meta.get("device", "")), DEVICES["a100-80g"])
    rates = _seconds_per_work(device, unit_components(spec))
    fitted = calibrate(profile, profile_spec, profile_shape, profile_tp)
    measured = measured_imbalance(meta, experts.grid.ep)  # the load measured on data at this EP
    if measured is None:
        measured = profile_expert_run(profile).imbalance
    if experts.imbalance is None and measured is not None and spec.language.moe is not None:
        experts = ExpertRun(experts.grid, measured)
    rates.update(fitted)
    # a TP-1 profile measured no all-reduce: add ``device``'s; a TP profile's rates already hold its own
    return _costs_from_rates(spec, shape, tp, rates, dropout, attention, "calibrated",
                             {"device": meta.get("device", device.name), "calibration": fitted,
                              "profile_model": profile_spec.name},
                             comm_device=device if profile_tp == 1 else None, sequence_parallel=sequence_parallel,
                             kernels=device.kernels, experts=experts, a2a_device=device)


def profile_report(profile: CostTable, device: DeviceSpec, attention: str | None = None) -> list[dict]:
    """Measured against analytic, per unit kind, for a profile written by the trainer's profiler.

    One row per kind (the first unit of each): ``fwd_ms``, ``bwd_ms``, ``bwd_over_fwd`` measured;
    ``efficiency``: analytic forward FLOPs per TP rank / (``fwd_s`` x ``device`` peak), the fraction
    of peak the unit reached; ``act_bytes``, ``act_bytes_full``, ``act_bytes_selective`` measured
    (bytes per micro-batch) beside the analytic ones (``analytic_*``) at the profile's shape and TP.
    attention: the cost model's attention ("flash" / "unfused"); default the profile's meta.
    """
    meta = profile.meta or {}
    missing = [k for k in ("spec", "shape") if k not in meta]
    if missing:
        raise UserError(f"profile_report: the profile's meta lacks {missing} (not written by the profiler?)")
    spec, shape = spec_from_dict(meta["spec"]), MicroBatchShape.from_dict(meta["shape"])
    tp = int(meta.get("tp", 1))
    attention = attention or meta.get("attention", "unfused")
    analytic = analytic_costs(spec, shape, tp, device, attention=attention,
                              sequence_parallel=bool(meta.get("sequence_parallel", False)))
    flops = unit_flops(spec, shape, tp)
    rows, seen = [], set()
    for pu, au, fl in zip(profile.units, analytic.units, flops):
        if pu.kind in seen:
            continue
        seen.add(pu.kind)
        row = {"kind": pu.kind, "fwd_ms": 1e3 * pu.fwd_s, "bwd_ms": 1e3 * pu.bwd_s,
               "bwd_over_fwd": pu.bwd_s / pu.fwd_s if pu.fwd_s > 0 else None,
               "efficiency": fl / tp / (pu.fwd_s * device.matmul_flops_per_s) if fl > 0 and pu.fwd_s > 0 else None}
        for field in ("act_bytes", "act_bytes_full", "act_bytes_selective"):
            row[field], row[f"analytic_{field}"] = getattr(pu, field), getattr(au, field)
        rows.append(row)
    return rows
