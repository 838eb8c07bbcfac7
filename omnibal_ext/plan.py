"""One plan from all three levels: data (ISF), model (pipeline layout), memory (recompute).

:func:`make_plan` takes per-sample statistics, a model, a GPU count and the memory per GPU, and
returns a :class:`Plan`: the ISF thresholds, the parallel sizes, the pipeline layout and the
per-stage recompute plan the trainer runs (``trainer_flags``), plus predictions of four settings
side by side, the paper's ablation:

============  ==================  ============================  ==========================
setting       batching            pipeline layout               recompute
============  ==================  ============================  ==========================
baseline      random, padded      Megatron default              full, every layer
+data         ISF packed groups   Megatron default              full, every layer
+model        ISF packed groups   searched                      full, every layer
+memory       ISF packed groups   searched with the recompute   adaptive per stage
============  ==================  ============================  ==========================

How a prediction is made (tensor-free; every number comes from the existing planners)
--------------------------------------------------------------------------------------
*Costs per micro-batch are linear in its shape.*  The analytic cost model gives every unit's time
as a linear function of (ViT tiles, LLM tokens, sum of squared sample lengths): ViT, projector,
embedding and head are linear in tiles or tokens, a causal LLM layer adds attention FLOPs
proportional to ``sum(len_i^2)``.  So the per-stage forward, backward (with the recompute extra)
and send times of a layout are evaluated once for three unit shapes and combined per micro-batch
(:func:`stage_coefficients`); ``tests/test_plan.py`` checks this against the cost model directly.

*Micro-batches.*  Megatron's default: ``K`` random samples per micro-batch padded to the longest
of them: tiles = the K samples' tiles (the ViT runs no padding), LLM tokens = ``K * longest``,
attention ``K * longest^2`` (the padded sequences are computed in full).  ISF: one packed group
per micro-batch: its tiles, its tokens, ``sum(len_i^2)`` of its samples (packed attention stays
within a sample).  ``m = ceil(global batch / (dp * K))`` micro-batches per iteration.

*DP straggling (the model we chose).*  Not a scale factor: the iteration is simulated.  The epoch's
micro-batches are laid out as Megatron (random) or the balanced step assembly (ISF) serves them:
step ``s`` gives DP rank ``r`` micro-batch ``(s, r)``, an iteration takes ``m`` consecutive steps.
For ``sim_iterations`` iterations spread evenly over the epoch, every DP rank's own ``m``
micro-batches run through the 1F1B simulator (``simulate.simulate_pipeline``, per-micro-batch
stage times and send times); the iteration lasts as long as its slowest rank, plus the gradient
all-reduce (ring all-reduce of the fp32 gradients of the largest stage, ``2 (dp-1)/dp * 4 bytes *
params / p2p bandwidth``, not overlapped).  So the prediction holds the padding, the DP
imbalance (the slowest of N ranks per step, averaged over the iteration's micro-batches as the
real schedule averages them) and the pipeline stalls that uneven micro-batches cause.
``balanced_iteration_s`` is the same iteration with every micro-batch at the mean shape; the
ratio of the two is the straggling the data level removes.

*Throughput.*  time per sample = sum of the sampled iteration times / samples they hold;
``gpu_days = samples * time per sample * gpus / 86400`` for one epoch of ``samples`` samples;
``tokens_per_s`` counts real (unpadded) LLM tokens of the whole cluster.

*Memory.*  ``memory_model.stage_memory`` (1F1B, distributed optimizer) at a shape every
micro-batch stays under: ISF: the caps, tiles = Qv, tokens = Qt, attention ``min(Qt, longest
sample) * Qt`` (the largest ``sum(len_i^2)`` a group under the caps can reach); random: the
mean padded micro-batch of the epoch (Megatron's micro-batch varies; its largest is in
``shapes["random_worst_padded"]``; the baseline's ``fits_memory`` is judged at the mean).  The
budget is ``gpu_memory * (1 - memory_reserve)`` (the model leaves out the CUDA context,
fragmentation and buffers).  Memory planning uses the ISF caps: the searched layout and the
recompute plan fit any group the trainer can build.

*Choosing the layout and recompute.*  Each balanced setting gathers candidates and keeps the
one with the least simulated time on the same micro-batches: +model: the paper's search (anchor
+ radius, unit times with full recompute, each stage checked to fit under full recompute) and the
default layout; +memory: ``recompute.plan_layout_and_recompute`` (search + adaptive recompute,
one recompute-aware round) and the adaptive plan on the +model and default layouts.  +model and
+memory keep only candidates that fit the budget.  Since the adaptive plan never adds time to a
layout's full recompute (selective recompute costs less than full, per unit and at any shape) and
the simulator is monotone in op times, +memory is never predicted slower than +model, nor +model
than +data when the default layout fits memory (when it does not, +data could not run).

*Parallel sizes.*  When not given: every (tp, pp) with tp in {1, 2, 4, 8} dividing the GPUs and
the attention heads and key/value groups of both ViT and LLM (the trainer's rule), pp dividing
gpus/tp, the default layout possible; each is screened by the least memory any layout needs with
full recompute (an exact min-max over contiguous splits, :func:`memory_need`) and by the
balanced (+memory) iteration at the mean ISF group; the fastest per sample that fits wins.  If none
fits, :class:`PlanError` names the least demanding configuration, its stage and its need.
"""
from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .data.search import SearchConfig, plan_isf, random_baseline, random_group_totals, step_matrix_epoch0
from .data.stats import SampleStats
from .errors import UserError
from .memory.memory_model import (FP32_ADAM, GIB, MIXED_BF16_ADAM, MODE_FULL, MODE_NONE, Precision, in_flight_1f1b,
                                  stage_memory, unit_activation_bytes, unit_transient_bytes)
from .memory.recompute import (MemoryBudgetError, StageRecompute, format_recompute_plan, full_recompute_plan,
                               plan_layout_and_recompute, plan_recompute)
from .model import partition
from .model.cost_model import DeviceSpec, MicroBatchShape, analytic_costs, get_device
from .model.costs import CostTable
from .model.layout import LayoutError, PipelineLayout, default_layout
from .model.simulate import SimResult, allreduce_seconds, layout_stage_costs, simulate_pipeline
from .model.units import ModelSpec, build_units, get_preset

SETTINGS = ("baseline", "+data", "+model", "+memory")
DEFAULT_GLOBAL_BATCH = 1024  # samples per iteration (an assumption; see scripts/reproduce_paper.py)
TP_CHOICES = (1, 2, 4, 8)
SECONDS_PER_DAY = 86400.0
# (tiles, LLM tokens, sum of squared sample lengths) of the unit shapes the linear costs are read at
_BASIS = 1024.0


class PlanError(UserError):
    """No configuration fits, or the request cannot be planned (the message says why)."""


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SettingPrediction:
    """Prediction of one setting (see the module docstring).

    stage_time_s: per stage, forward + backward + recompute seconds of the mean micro-batch of this
        setting's batching (no communication).
    stage_peak_bytes: per stage, peak memory at the memory shape (bytes per GPU).
    iteration_s: mean simulated iteration, slowest DP rank + all-reduce, seconds.
    balanced_iteration_s: the same with every micro-batch at the mean shape, seconds.
    bubble_fraction: idle share of the slowest rank's pipeline (mean over sampled iterations).
    samples_per_iteration: mean samples per iteration; tokens_per_s: real LLM tokens per second,
    whole cluster; gpu_days: one epoch of the plan's ``samples``; speedup: baseline gpu_days / gpu_days.
    """

    setting: str
    batching: str  # "random" or "isf"
    how: str  # which candidate layout/recompute won
    layout_flag: str
    stage_units: tuple[int, ...]
    recompute_flag: str
    stage_time_s: tuple[float, ...]
    stage_peak_bytes: tuple[float, ...]
    fits_memory: bool
    iteration_s: float
    balanced_iteration_s: float
    bubble_fraction: float
    allreduce_s: float
    samples_per_iteration: float
    tokens_per_s: float
    gpu_days: float
    speedup: float = 1.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["stage_units"] = list(self.stage_units)
        d["stage_time_s"] = list(self.stage_time_s)
        d["stage_peak_bytes"] = list(self.stage_peak_bytes)
        d["stage_peak_gib"] = [b / GIB for b in self.stage_peak_bytes]
        d["straggle_factor"] = self.iteration_s / self.balanced_iteration_s if self.balanced_iteration_s else 1.0
        return d


@dataclass(frozen=True)
class Plan:
    """The whole plan; ``to_dict()`` is the JSON ``pretrain_vlm.py --omnibal-plan`` reads.

    Bytes are per GPU; ``budget_bytes = gpu_memory_bytes * (1 - memory_reserve)``.
    ``rows`` holds the four settings in SETTINGS order; the last (+memory) is the plan itself.
    """

    model: str
    device: str
    gpus: int
    tp: int
    pp: int
    dp: int
    gpu_memory_bytes: float
    budget_bytes: float
    samples: int
    samples_per_group: int
    global_batch_size: int
    num_microbatches: int
    attention: str
    isf: dict
    random: dict
    shapes: dict
    rows: tuple[SettingPrediction, ...]
    trainer_flags: dict
    configs_tried: tuple[dict, ...] = ()
    notes: tuple[str, ...] = ()
    timelines: dict = field(default_factory=dict, compare=False, repr=False)  # setting -> SimResult
    stage_time_bars: dict = field(default_factory=dict, compare=False, repr=False)  # setting -> stage times

    def row(self, setting: str) -> SettingPrediction:
        for r in self.rows:
            if r.setting == setting:
                return r
        raise KeyError(setting)

    @property
    def pipeline_layout(self) -> str:
        return self.row("+memory").layout_flag

    @property
    def recompute_plan(self) -> str:
        return self.row("+memory").recompute_flag

    @property
    def trainer_args(self) -> str:
        return trainer_command(self.trainer_flags)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "device": self.device, "gpus": self.gpus, "tp": self.tp, "pp": self.pp,
            "dp": self.dp, "gpu_memory_bytes": self.gpu_memory_bytes, "budget_bytes": self.budget_bytes,
            "samples": self.samples, "samples_per_group": self.samples_per_group,
            "global_batch_size": self.global_batch_size, "num_microbatches": self.num_microbatches,
            "attention": self.attention,
            "pipeline_layout": self.pipeline_layout, "recompute_plan": self.recompute_plan,
            "isf": self.isf, "random": self.random, "shapes": self.shapes,
            "rows": [r.to_dict() for r in self.rows],
            "trainer_flags": dict(self.trainer_flags), "trainer_args": self.trainer_args,
            "configs_tried": list(self.configs_tried), "notes": list(self.notes),
        }


def trainer_argv(flags: dict) -> list[str]:
    """Trainer arguments of a flag dict: True is a bare switch, False/None are left out, any other
    value is joined as ``--flag=value`` (so that a value starting with "-", such as the recompute
    plan ``-|t2``, is not taken for a flag by argparse)."""
    return [k if v is True else f"{k}={v}" for k, v in flags.items() if v is not None and v is not False]


def trainer_command(flags: dict) -> str:
    """Shell text of :func:`trainer_argv`, quoted for pasting."""
    return shlex.join(trainer_argv(flags))


# ------------------------------------------------------------------------------------------------
# Linear stage costs
# ------------------------------------------------------------------------------------------------
def basis_costs(spec: ModelSpec, tp: int, device: DeviceSpec, attention: str = "unfused") -> tuple[CostTable, ...]:
    """Cost tables at the unit shapes: tiles only, tokens only, tokens + attention (see stage_coefficients)."""
    b = int(_BASIS)
    return (analytic_costs(spec, MicroBatchShape(b, 0), tp, device, attention=attention),
            analytic_costs(spec, MicroBatchShape(0, b, llm_attn_tokens_sq=0.0), tp, device, attention=attention),
            analytic_costs(spec, MicroBatchShape(0, b, llm_attn_tokens_sq=_BASIS**2), tp, device, attention=attention))


def stage_coefficients(basis: Sequence[CostTable], layout: PipelineLayout, pp: int, p2p_bytes_per_s: float,
                       recompute_modes: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fwd, bwd, p2p), each (3, pp): seconds per stage = [tiles, tokens, sum len^2] @ coefficients.

    bwd includes the recompute extra of ``recompute_modes`` (per-unit "none"/"selective"/"full").
    """
    per = [layout_stage_costs(c, layout, pp, p2p_bytes_per_s, recompute_modes) for c in basis]
    out = []
    for k in range(3):
        tiles, toks, toks_attn = (per[j][k][:, 0] for j in range(3))
        out.append(np.stack([tiles / _BASIS, toks / _BASIS, (toks_attn - toks) / _BASIS**2]))
    return tuple(out)


def full_modes(costs: CostTable) -> list[str]:
    """Per-unit mode names of full recompute on every ViT and LLM layer."""
    return ["full" if u.kind in ("vit_layer", "llm_layer") else "none" for u in costs.units]


def stage_modes(costs: CostTable, layout: PipelineLayout, stages: Sequence[StageRecompute]) -> list[str]:
    from .memory.memory_model import unit_modes

    names = {0: "none", 1: "selective", 2: "full"}
    return [names[int(m)] for m in unit_modes(costs, layout, stages)]


# ------------------------------------------------------------------------------------------------
# Memory need under full recompute (exact over contiguous layouts)
# ------------------------------------------------------------------------------------------------
def training_precision(device: DeviceSpec) -> Precision:
    """What the trainer runs with on that device: bf16 with fp32 Adam on GPUs (--bf16), fp32 on CPU."""
    return FP32_ADAM if device.name == "cpu" else MIXED_BF16_ADAM


def memory_need_table(costs: CostTable, pp: int, tp: int, dp: int, num_microbatches: int,
                      distributed_optimizer: bool = True, precision: Precision = MIXED_BF16_ADAM) -> np.ndarray:
    """need[k, i, j]: peak bytes of pipeline stage k holding units [i, j) with full recompute.

    Static bytes + in-flight micro-batches (1F1B) x kept activations + one layer's recompute
    working set, as ``memory_model.stage_memory`` counts them; inf where j <= i.
    """
    n = len(costs.units)
    modes = np.array([MODE_FULL if u.kind in ("vit_layer", "llm_layer") else MODE_NONE for u in costs.units],
                     dtype=np.int8)
    act = unit_activation_bytes(costs, modes)
    trans = unit_transient_bytes(costs, modes)
    params = np.array([u.param_count for u in costs.units], dtype=np.float64) / tp
    per_param = precision.bytes_per_param(dp, distributed_optimizer)
    pa = np.concatenate([[0.0], np.cumsum(act)])
    pp_ = np.concatenate([[0.0], np.cumsum(params)])
    act_sum = pa[None, :] - pa[:, None]
    static = (pp_[None, :] - pp_[:, None]) * per_param
    tmax = np.full((n + 1, n + 1), -np.inf)
    for i in range(n):
        tmax[i, i + 1:] = np.maximum.accumulate(trans[i:])
    valid = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]
    in_flight = in_flight_1f1b(pp, num_microbatches).astype(np.float64)
    need = static[None] + in_flight[:, None, None] * act_sum[None] + np.maximum(tmax, 0.0)[None]
    return np.where(valid[None], need, np.inf)


def memory_need(need: np.ndarray) -> tuple[float, int, tuple[int, ...]]:
    """(least possible largest stage peak, the stage holding it, the layout) over all contiguous splits."""
    pp, n1, _ = need.shape
    n = n1 - 1
    if pp > n:
        return float("inf"), 0, ()
    f = need[0, 0].copy()  # f[j]: best max over stages 0..k holding units [0, j)
    args = []
    for k in range(1, pp):
        cand = np.maximum(f[:, None], need[k])
        arg = np.argmin(cand, axis=0)
        f = cand[arg, np.arange(n1)]
        args.append(arg)
    best = float(f[n])
    if not np.isfinite(best):
        return best, 0, ()
    ends, j = [n], n
    for arg in reversed(args):
        j = int(arg[j])
        ends.append(j)
    edges = [0] + ends[::-1]
    counts = tuple(int(b - a) for a, b in zip(edges[:-1], edges[1:]))
    stage_need = [need[k, edges[k], edges[k + 1]] for k in range(pp)]
    return best, int(np.argmax(stage_need)), counts


# ------------------------------------------------------------------------------------------------
# Micro-batch loads
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loads:
    """Micro-batches of sampled iterations: ``shape[i, r, mb] = (tiles, LLM tokens, sum len^2)``
    (padded where the batching pads), ``real_tokens`` and ``samples`` (i, r, mb)."""

    shape: np.ndarray
    real_tokens: np.ndarray
    samples: np.ndarray

    @property
    def mean_shape(self) -> np.ndarray:
        return self.shape.reshape(-1, 3).mean(axis=0)


def _iteration_steps(num_steps: int, m: int, iterations: int) -> np.ndarray:
    """(iterations, m) step indices: ``iterations`` runs of m consecutive steps spread over the epoch
    (indices wrap around when the epoch holds fewer steps)."""
    starts = np.floor(np.arange(iterations) * num_steps / iterations).astype(np.int64)
    return (starts[:, None] + np.arange(m)[None, :]) % num_steps


def _loads(group_shape: np.ndarray, group_real: np.ndarray, group_samples: np.ndarray, steps: np.ndarray,
           m: int, iterations: int) -> Loads:
    """Loads of sampled iterations from per-group arrays and a (steps, dp) matrix of group ids."""
    if len(steps) == 0:
        raise PlanError(f"the data make no full step of {steps.shape[1]} data-parallel micro-batches; "
                        "give more samples or fewer GPUs")
    it = _iteration_steps(len(steps), m, iterations)  # (I, m)
    g = steps[it]  # (I, m, dp)
    g = np.transpose(g, (0, 2, 1))  # (I, dp, m)
    return Loads(group_shape[g].astype(np.float64), group_real[g].astype(np.float64),
                 group_samples[g].astype(np.float64))


def random_loads(stats: SampleStats, k: int, dp: int, m: int, iterations: int,
                 seed: int) -> tuple[Loads, np.ndarray, np.ndarray]:
    """Megatron's random batching: (loads of sampled iterations, mean and worst (tiles, padded tokens,
    padded sum len^2) over every micro-batch of the epoch)."""
    gt, gv, gmax, sizes = random_group_totals(stats.vit, stats.tokens, k, seed)
    padded = (sizes * gmax).astype(np.float64)
    shape = np.stack([gv.astype(np.float64), padded, sizes * gmax.astype(np.float64) ** 2], axis=1)
    full = len(gt) // dp
    steps = np.arange(full * dp).reshape(full, dp)
    return _loads(shape, gt, sizes, steps, m, iterations), shape.mean(axis=0), shape.max(axis=0)


def isf_loads(stats: SampleStats, data_plan, m: int, iterations: int, seed: int) -> Loads:
    """ISF: one packed group per micro-batch, steps in the balanced order the sampler serves."""
    g = data_plan.grouping
    tok = stats.tokens.astype(np.float64)
    sq = np.add.reduceat(tok[g.members] ** 2, g.offsets[:-1]) if len(g) else np.zeros(0)
    shape = np.stack([g.tiles.astype(np.float64), g.tokens.astype(np.float64), sq], axis=1)
    steps = step_matrix_epoch0(len(g), data_plan.assembly.width, data_plan.assembly.order, seed)
    return _loads(shape, g.tokens, g.sizes, steps, m, iterations)


# ------------------------------------------------------------------------------------------------
# Simulation of sampled iterations
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimSummary:
    iteration_s: float
    balanced_iteration_s: float
    bubble_fraction: float
    samples_per_iteration: float
    seconds_per_sample: float
    tokens_per_s: float
    timeline: SimResult | None = None


def simulate_loads(coefs, loads: Loads, allreduce_s: float, keep_timeline: bool = False) -> SimSummary:
    """Simulate every sampled iteration (each DP rank its own micro-batches; slowest rank + all-reduce)."""
    fwd_c, bwd_c, p2p_c = coefs
    F, B, C = (loads.shape @ c for c in (fwd_c, bwd_c, p2p_c))  # (I, R, m, P)
    I, R, m, _ = F.shape
    times, bubbles, timeline = [], [], None
    for i in range(I):
        worst = None
        for r in range(R):
            res = simulate_pipeline(F[i, r][..., None], B[i, r][..., None], m, C[i, r][..., None])
            if worst is None or res.iteration_s > worst.iteration_s:
                worst = res
        times.append(worst.iteration_s + allreduce_s)
        bubbles.append(worst.bubble_fraction)
        if keep_timeline and timeline is None:
            timeline = worst
    mean = loads.mean_shape
    bal = simulate_pipeline(mean @ fwd_c, mean @ bwd_c, m, mean @ p2p_c).iteration_s + allreduce_s
    total_t = float(np.sum(times))
    total_samples = float(loads.samples.sum())
    return SimSummary(float(np.mean(times)), float(bal), float(np.mean(bubbles)), total_samples / I,
                      total_t / total_samples, float(loads.real_tokens.sum()) / total_t, timeline)


# ------------------------------------------------------------------------------------------------
# One configuration
# ------------------------------------------------------------------------------------------------
@dataclass
class _Context:
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


def _context(spec, device, tp, pp, dp, m, budget, attention, cap_shape, random_shape) -> _Context:
    costs_isf = analytic_costs(spec, cap_shape, tp, device, attention=attention)
    costs_random = analytic_costs(spec, random_shape, tp, device, attention=attention)
    precision = training_precision(device)
    return _Context(spec, device, tp, pp, dp, m, budget, attention, basis_costs(spec, tp, device, attention),
                    costs_isf, costs_random, memory_need_table(costs_isf, pp, tp, dp, m, precision=precision),
                    precision)


def _allreduce(ctx: _Context, layout: PipelineLayout) -> float:
    params = np.array([u.param_count for u in ctx.costs_isf.units], dtype=np.float64) / ctx.tp
    largest = max(params[list(r)].sum() for r in layout.stage_slices())
    return allreduce_seconds(4.0 * largest, ctx.dp, ctx.device.p2p_bytes_per_s)


def _memory(ctx: _Context, costs: CostTable, layout: PipelineLayout, stages) -> tuple[float, ...]:
    mem = stage_memory(costs, layout, stages, ctx.pp, ctx.tp, ctx.dp, ctx.m, precision=ctx.precision)
    return tuple(float(x.peak_bytes) for x in mem)


@dataclass
class _Candidate:
    how: str
    layout: PipelineLayout
    stages: list
    modes: list
    coefs: tuple = ()
    sim: SimSummary | None = None


def _simulate_candidate(ctx: _Context, cand: _Candidate, loads: Loads, keep_timeline: bool) -> _Candidate:
    cand.coefs = stage_coefficients(ctx.basis, cand.layout, ctx.pp, ctx.device.p2p_bytes_per_s, cand.modes)
    cand.sim = simulate_loads(cand.coefs, loads, _allreduce(ctx, cand.layout), keep_timeline)
    return cand


def _best(cands: list[_Candidate]) -> _Candidate:
    return min(cands, key=lambda c: (c.sim.seconds_per_sample, c.sim.iteration_s))


def _stage_ok_full(ctx: _Context):
    def ok(stage: int, rng) -> bool:
        return bool(ctx.need[stage, rng.start, rng.stop] <= ctx.budget)
    return ok


def _model_candidates(ctx: _Context, default: PipelineLayout) -> list[_Candidate]:
    """+model: the paper's search (full recompute weights, memory-checked) and the default layout."""
    units = ctx.costs_isf.units
    modes = full_modes(ctx.costs_isf)
    out = []
    try:
        rep = partition.search_partition(ctx.costs_isf, ctx.pp, recompute=modes, stage_ok=_stage_ok_full(ctx))
        how = "searched"
    except partition.PartitionError:
        rep = partition.optimal_partition(ctx.costs_isf, ctx.pp, recompute=modes, stage_ok=_stage_ok_full(ctx))
        how = "optimal (no searched layout within the radius fits)"
    out.append(_Candidate(how, rep.layout, full_recompute_plan(rep.layout, units), modes))
    if rep.layout != default:
        out.append(_Candidate("default", default, full_recompute_plan(default, units), modes))
    return out


def _joint(ctx: _Context, cache: dict | None):
    """``plan_layout_and_recompute`` at the ISF caps, memoised per configuration (screen, then plan)."""
    key = (ctx.tp, ctx.pp, ctx.dp, ctx.m, ctx.budget, ctx.attention, tuple(sorted(ctx.costs_isf.meta["shape"].items())))
    if cache is not None and key in cache:
        return cache[key]
    joint = plan_layout_and_recompute(ctx.costs_isf, ctx.pp, ctx.budget, ctx.tp, ctx.dp, ctx.m, precision=ctx.precision)
    if cache is not None:
        cache[key] = joint
    return joint


def _configuration(ctx: _Context) -> str:
    return (f"{ctx.spec.name} at TP={ctx.tp} PP={ctx.pp} DP={ctx.dp}, {ctx.m} micro-batches, budget "
            f"{ctx.budget / GIB:.1f} GiB per GPU")


def _nothing_fits(ctx: _Context, setting: str, failures: list[str]) -> PlanError:
    """The planner's refusal of a row: the configuration and why each candidate failed."""
    return PlanError(f"no {setting} plan fits {_configuration(ctx)}: " + "; ".join(failures))


def _memory_candidates(ctx: _Context, layouts: list[tuple[str, PipelineLayout]],
                       cache: dict | None = None) -> list[_Candidate]:
    """+memory: layout search + adaptive recompute, and the adaptive plan on the given layouts.
    Raises PlanError, with each candidate's reason, when none fits."""
    out, failures = [], []
    try:
        joint = _joint(ctx, cache)
        out.append(_Candidate(f"{joint.how} + adaptive recompute", joint.layout, list(joint.recompute.stages),
                              stage_modes(ctx.costs_isf, joint.layout, joint.recompute.stages)))
    except (MemoryBudgetError, partition.PartitionError) as e:
        failures.append(f"layout search + adaptive recompute: {e}")
    seen = {c.layout for c in out}
    for how, layout in layouts:
        if layout in seen:
            continue
        seen.add(layout)
        try:
            plan = plan_recompute(ctx.costs_isf, layout, ctx.budget, ctx.pp, ctx.tp, ctx.dp, ctx.m,
                                  precision=ctx.precision)
        except MemoryBudgetError as e:
            failures.append(f"{how} layout + adaptive recompute: {e}")
            continue
        out.append(_Candidate(f"{how} layout + adaptive recompute", layout, list(plan.stages),
                              stage_modes(ctx.costs_isf, layout, plan.stages)))
    if not out:
        raise _nothing_fits(ctx, "+memory", failures)
    return out


def _fitting_model_candidates(ctx: _Context, cands: list[_Candidate]) -> list[_Candidate]:
    """The +model candidates whose full-recompute peak fits the budget; PlanError naming each peak if none."""
    peaks = [max(_memory(ctx, ctx.costs_isf, c.layout, c.stages)) for c in cands]
    fitting = [c for c, peak in zip(cands, peaks) if peak <= ctx.budget]
    if not fitting:
        units = build_units(ctx.spec)
        raise _nothing_fits(ctx, "+model", [
            f"{c.how} layout {c.layout.to_flag(units)} needs {peak / GIB:.1f} GiB with full recompute"
            for c, peak in zip(cands, peaks)])
    return fitting


def _row(ctx: _Context, setting: str, batching: str, cand: _Candidate, costs_mem: CostTable,
         mean_shape: np.ndarray, samples: int, gpus: int) -> SettingPrediction:
    units = build_units(ctx.spec)
    peaks = _memory(ctx, costs_mem, cand.layout, cand.stages)
    stage_t = mean_shape @ (cand.coefs[0] + cand.coefs[1])
    s = cand.sim
    return SettingPrediction(
        setting=setting, batching=batching, how=cand.how, layout_flag=cand.layout.to_flag(units),
        stage_units=tuple(int(x) for x in cand.layout.stage_units),
        recompute_flag=format_recompute_plan(cand.stages), stage_time_s=tuple(float(x) for x in stage_t),
        stage_peak_bytes=peaks, fits_memory=bool(max(peaks) <= ctx.budget), iteration_s=s.iteration_s,
        balanced_iteration_s=s.balanced_iteration_s, bubble_fraction=s.bubble_fraction,
        allreduce_s=_allreduce(ctx, cand.layout), samples_per_iteration=s.samples_per_iteration,
        tokens_per_s=s.tokens_per_s, gpu_days=samples * s.seconds_per_sample * gpus / SECONDS_PER_DAY)


# ------------------------------------------------------------------------------------------------
# Configurations
# ------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot split this model's attention (the trainer's rule), or None.

    The ViT's heads are padded to a multiple of ``tp`` (``VisionSpec.padded_heads``); the LLM's heads
    and key-value groups must divide."""
    heads, groups = spec.language.num_attention_heads, spec.language.kv_groups
    if heads % tp or groups % tp:
        return f"TP {tp} does not divide the LLM's {heads} attention heads / {groups} key-value groups"
    return None


def candidate_configs(spec: ModelSpec, gpus: int, tp=None, pp=None, dp=None,
                      min_pp: int = 1) -> tuple[list[tuple[int, int, int]], list[dict]]:
    """(tp, pp, dp) triples to try (pipeline depth at least ``min_pp``), and the skipped ones with a reason."""
    n_units = len(build_units(spec))
    tps = [tp] if tp is not None else [t for t in TP_CHOICES if gpus % t == 0]
    out, skipped = [], []
    for t in tps:
        if gpus % t:
            skipped.append({"tp": t, "reason": f"TP {t} does not divide {gpus} GPUs"})
            continue
        problem = tp_problem(spec, t)
        if problem:
            skipped.append({"tp": t, "reason": problem})
            continue
        pps = [pp] if pp is not None else _divisors(gpus // t)
        for p in pps:
            if (gpus // t) % p:
                skipped.append({"tp": t, "pp": p, "reason": f"TP {t} x PP {p} does not divide {gpus} GPUs"})
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


def _num_microbatches(global_batch: int, dp: int, k: int) -> int:
    return max(1, math.ceil(global_batch / (dp * k)))


def _cap_shape(params, stats: SampleStats) -> MicroBatchShape:
    longest = int(stats.tokens.max()) if len(stats) else 0
    return MicroBatchShape(int(params.qv), int(params.qt), llm_attn_tokens_sq=float(min(params.qt, longest)) * params.qt)


def _shape_of(v: np.ndarray) -> MicroBatchShape:
    tiles, tokens = int(round(v[0])), int(round(v[1]))
    return MicroBatchShape(tiles, tokens, llm_attn_tokens_sq=float(min(v[2], float(tokens) ** 2)))


def _screen(spec, device, gpus, budget, attention, cfg, k, global_batch, cap_shape, random_shape,
            mean_isf, mean_random, baseline_needed, cache: dict | None = None) -> dict:
    """Quick look at one (tp, pp, dp): least memory need, the baseline's memory, and the time per sample
    of the balanced (+memory) plan and of the baseline, each with every micro-batch at its mean shape."""
    t, p, d = cfg
    m = _num_microbatches(global_batch, d, k)
    ctx = _context(spec, device, t, p, d, m, budget, attention, cap_shape, random_shape)
    need, stage, _ = memory_need(ctx.need)
    rec = {"tp": t, "pp": p, "dp": d, "micro_batches": m, "least_need_bytes": need, "need_stage": stage,
           "fits": bool(need <= budget)}
    default = default_layout(spec, p)
    full = full_recompute_plan(default, ctx.costs_random.units)
    rec["baseline_peak_bytes"] = max(_memory(ctx, ctx.costs_random, default, full))
    rec["baseline_fits"] = bool(rec["baseline_peak_bytes"] <= budget)
    coefs = stage_coefficients(ctx.basis, default, p, device.p2p_bytes_per_s, full_modes(ctx.costs_random))
    it = simulate_pipeline(mean_random @ coefs[0], mean_random @ coefs[1], m, mean_random @ coefs[2]).iteration_s
    it += _allreduce(ctx, default)
    rec["baseline_estimated_seconds_per_sample"] = it / (m * d * k)
    if not rec["fits"] or (baseline_needed and not rec["baseline_fits"]):
        return rec
    try:
        joint = _joint(ctx, cache)
    except (MemoryBudgetError, partition.PartitionError) as e:
        rec["fits"], rec["reason"] = False, str(e)
        return rec
    coefs = stage_coefficients(ctx.basis, joint.layout, p, device.p2p_bytes_per_s,
                               stage_modes(ctx.costs_isf, joint.layout, joint.recompute.stages))
    shape, group_samples = mean_isf
    it = simulate_pipeline(shape @ coefs[0], shape @ coefs[1], m, shape @ coefs[2]).iteration_s
    it += _allreduce(ctx, joint.layout)
    rec["estimated_seconds_per_sample"] = it / (m * d * group_samples)
    return rec


def _refusal(spec: ModelSpec, gpus: int, gpu_memory: float, budget: float, tried: list[dict], skipped: list[dict],
             baseline_needed: bool) -> PlanError:
    if not tried:
        why = "; ".join(sorted({s["reason"] for s in skipped})) or "no parallel configuration to try"
        return PlanError(f"{spec.name} on {gpus} GPUs: no usable (TP, PP, DP): {why}")
    best = min(tried, key=lambda r: r["least_need_bytes"])
    if best["least_need_bytes"] <= budget and baseline_needed:
        b = min(tried, key=lambda r: r["baseline_peak_bytes"])
        return PlanError(
            f"{spec.name} on {gpus} GPUs of {gpu_memory / GIB:.0f} GiB: the Megatron-default baseline fits no "
            f"configuration: the least demanding, TP={b['tp']} PP={b['pp']} DP={b['dp']}, needs "
            f"{b['baseline_peak_bytes'] / GIB:.1f} GiB against a budget of {budget / GIB:.1f} GiB per GPU")
    planner_failed = [r for r in tried if "reason" in r]
    if best["least_need_bytes"] <= budget and planner_failed:  # memory would do, the planner found no plan
        return PlanError(
            f"{spec.name} on {gpus} GPUs of {gpu_memory / GIB:.0f} GiB: no configuration has a plan that fits "
            f"{budget / GIB:.1f} GiB per GPU: " + "; ".join(
                f"TP={r['tp']} PP={r['pp']} DP={r['dp']}: {r['reason']}" for r in planner_failed))
    return PlanError(
        f"{spec.name} does not fit {gpus} GPUs of {gpu_memory / GIB:.0f} GiB: the least demanding configuration, "
        f"TP={best['tp']} PP={best['pp']} DP={best['dp']}, needs {best['least_need_bytes'] / GIB:.1f} GiB on "
        f"pipeline stage {best['need_stage']} (full recompute, best layout) against a budget of "
        f"{budget / GIB:.1f} GiB per GPU")


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------
def _isf_plan(stats: SampleStats, dp: int, k: int, max_seq_length, seed, max_candidates, search_samples):
    cfg = SearchConfig(dp_size=dp, samples_per_group=float(k), max_seq_len=max_seq_length, seed=seed,
                       max_candidates=max_candidates, search_samples=search_samples)
    return plan_isf(stats.vit, stats.tokens, cfg)


def make_plan(stats: SampleStats, spec: ModelSpec | str, gpus: int, gpu_memory_bytes: float, tp: int | None = None,
              pp: int | None = None, dp: int | None = None, device: str | DeviceSpec = "a100-80g", *,
              samples: int | None = None, samples_per_group: int = 4, max_seq_length: int | None = None,
              global_batch_size: int = DEFAULT_GLOBAL_BATCH, memory_reserve: float = 0.1,
              attention: str = "unfused", sim_iterations: int = 8, isf_max_candidates: int = 20,
              isf_search_samples: int = 40_000, require_baseline_fit: bool = False, choose_for: str = "omnibal",
              min_pp: int = 1, seed: int = 0) -> Plan:
    """Plan data, model and memory balance together (see the module docstring).

    stats: per-sample tiles and tokens; spec: a ModelSpec or preset name; gpu_memory_bytes: memory of
    one GPU (bytes); tp/pp/dp: fixed sizes (None: chosen); samples: dataset size for GPU-days
    (default ``len(stats)``); samples_per_group: K, samples per micro-batch (random batching) and
    the target per ISF group; max_seq_length: fixed ISF token cap Qt (tokens); global_batch_size:
    samples per iteration (rounded up to whole micro-batches); memory_reserve: fraction of GPU memory
    left out of the budget; attention: "unfused" or "flash" (cost model); sim_iterations: iterations
    simulated per setting; require_baseline_fit: only configurations where the Megatron default
    also fits memory; choose_for: which setting's speed picks the parallel sizes among those where the
    balanced plan fits: "omnibal" (the fastest plan, default) or "baseline" (the configuration a
    Megatron user would run: the fastest Megatron default; the ablation then holds it fixed); min_pp:
    consider only pipelines of at least this many stages (an ablation of the model level needs 2).
    Raises PlanError when nothing fits.
    """
    spec = get_preset(spec) if isinstance(spec, str) else spec
    dev = get_device(device) if isinstance(device, str) else device
    if gpus < 1 or int(gpus) != gpus:
        raise PlanError(f"--gpus must be a positive integer, got {gpus}")
    if not gpu_memory_bytes > 0:
        raise PlanError(f"--gpu-memory must be > 0, got {gpu_memory_bytes / GIB:g} GiB")
    if not 0 <= memory_reserve < 1:
        raise PlanError(f"memory_reserve must be in [0, 1), got {memory_reserve}")
    if samples_per_group < 1 or int(samples_per_group) != samples_per_group:
        raise PlanError(f"--samples-per-group must be a positive integer (the trainer's --micro-batch-size), "
                        f"got {samples_per_group}")
    if global_batch_size < 1 or sim_iterations < 1:
        raise PlanError("global_batch_size and sim_iterations must be >= 1")
    for name, v in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if v is not None and v < 1:
            raise PlanError(f"{name} must be >= 1, got {v}")
    if tp is not None and pp is not None and dp is not None and tp * pp * dp != gpus:
        raise PlanError(f"--tp {tp} x --pp {pp} x --dp {dp} = {tp * pp * dp} but --gpus is {gpus}")
    if len(stats) == 0:
        raise PlanError("the stats hold no samples")
    if choose_for not in ("omnibal", "baseline"):
        raise PlanError(f"choose_for must be 'omnibal' or 'baseline', got {choose_for!r}")
    if attention not in ("unfused", "flash"):
        raise PlanError(f"--attention must be 'unfused' or 'flash', got {attention!r}")
    k = int(samples_per_group)
    samples = int(samples if samples is not None else len(stats))
    if samples < 1:
        raise PlanError(f"--samples must be >= 1, got {samples}")
    budget = float(gpu_memory_bytes) * (1.0 - memory_reserve)
    opts = dict(max_seq_length=max_seq_length, seed=seed, max_candidates=isf_max_candidates,
                search_samples=isf_search_samples)

    configs, skipped = candidate_configs(spec, gpus, tp, pp, dp, min_pp)
    if not configs:
        raise _refusal(spec, gpus, gpu_memory_bytes, budget, [], skipped, require_baseline_fit)
    # Provisional ISF thresholds for screening: caps depend on K, hardly on the DP size.
    first_dp = dp if dp is not None else (configs[0][2] if len(configs) == 1 else 8)
    data = _isf_plan(stats, first_dp, k, **opts)
    cap = _cap_shape(data.params, stats)
    _, mean_random, worst = random_loads(stats, k, 1, 1, 1, seed)
    random_shape = _shape_of(mean_random)
    g = data.grouping
    mean_isf = (np.array([g.tiles.mean(), g.tokens.mean(),
                          float(np.mean(np.add.reduceat(stats.tokens.astype(float)[g.members] ** 2, g.offsets[:-1])))]),
                float(g.sizes.mean()))
    cache: dict = {}
    tried = [_screen(spec, dev, gpus, budget, attention, c, k, global_batch_size, cap, random_shape, mean_isf,
                     mean_random, require_baseline_fit, cache) for c in configs]
    usable = [r for r in tried if r["fits"] and "estimated_seconds_per_sample" in r]
    if not usable:
        raise _refusal(spec, gpus, gpu_memory_bytes, budget, tried, skipped, require_baseline_fit)
    speed_key = "estimated_seconds_per_sample" if choose_for == "omnibal" else "baseline_estimated_seconds_per_sample"
    chosen = min(usable, key=lambda r: (r[speed_key], r["tp"], r["pp"]))
    t, p, d = chosen["tp"], chosen["pp"], chosen["dp"]
    if d != first_dp:
        data = _isf_plan(stats, d, k, **opts)
        cap = _cap_shape(data.params, stats)
    m = _num_microbatches(global_batch_size, d, k)
    ctx = _context(spec, dev, t, p, d, m, budget, attention, cap, random_shape)
    if memory_need(ctx.need)[0] > budget:  # the final thresholds moved the caps: say so plainly
        raise _refusal(spec, gpus, gpu_memory_bytes, budget,
                       [_screen(spec, dev, gpus, budget, attention, (t, p, d), k, global_batch_size, cap,
                                random_shape, mean_isf, mean_random, False)], skipped, False)

    loads_r, _, _ = random_loads(stats, k, d, m, sim_iterations, seed)
    loads_i = isf_loads(stats, data, m, sim_iterations, seed)
    units = build_units(spec)
    default = default_layout(spec, p)
    fm = full_modes(ctx.costs_isf)

    base = _simulate_candidate(ctx, _Candidate("default", default, full_recompute_plan(default, units), fm),
                               loads_r, True)
    plus_data = _simulate_candidate(ctx, _Candidate("default", default, full_recompute_plan(default, units), fm),
                                    loads_i, True)
    model_c = [_simulate_candidate(ctx, c, loads_i, True) for c in _model_candidates(ctx, default)]
    # +model must fit memory with full recompute (the default layout may not)
    plus_model = _best(_fitting_model_candidates(ctx, model_c))
    mem_c = [_simulate_candidate(ctx, c, loads_i, True)
             for c in _memory_candidates(ctx, [("+model", plus_model.layout), ("default", default)], cache)]
    plus_memory = _best(mem_c)

    rows = [
        _row(ctx, "baseline", "random", base, ctx.costs_random, loads_r.mean_shape, samples, gpus),
        _row(ctx, "+data", "isf", plus_data, ctx.costs_isf, loads_i.mean_shape, samples, gpus),
        _row(ctx, "+model", "isf", plus_model, ctx.costs_isf, loads_i.mean_shape, samples, gpus),
        _row(ctx, "+memory", "isf", plus_memory, ctx.costs_isf, loads_i.mean_shape, samples, gpus),
    ]
    rows = [dataclasses.replace(r, speedup=rows[0].gpu_days / r.gpu_days) for r in rows]

    final = rows[-1]
    flags = {
        "--model": spec.name,
        "--tensor-model-parallel-size": t,
        "--pipeline-model-parallel-size": p,
        "--pipeline-layout": final.layout_flag,
        "--recompute-plan": final.recompute_flag,
        "--omnibal-isf": True,
        "--omnibal-isf-qv": int(data.params.qv),
        "--omnibal-isf-qt": int(data.params.qt),
        "--omnibal-isf-qv-min": int(data.params.qv_min),
        "--omnibal-isf-qt-min": int(data.params.qt_min),
        "--micro-batch-size": k,
        "--global-batch-size": m * d * k,
        # the memory plan assumes both: optimizer state sharded over DP, and bf16 on a GPU
        "--use-distributed-optimizer": True,
        "--bf16": ctx.precision == MIXED_BF16_ADAM,
    }
    rand_metrics = random_baseline(stats.vit, stats.tokens, d, k, seed)
    notes = [f"budget = {gpu_memory_bytes / GIB:.1f} GiB x (1 - {memory_reserve}) = {budget / GIB:.1f} GiB per GPU",
             f"{m} micro-batches per iteration = ceil({global_batch_size} / ({d} DP x {k} samples))",
             f"{sim_iterations} iterations simulated per setting (every DP rank; slowest rank + all-reduce)"]
    notes.append(f"configuration chosen for the fastest {'balanced plan' if choose_for == 'omnibal' else 'Megatron default'}"
                 f" among {len(usable)} that fit")
    if not rows[0].fits_memory:
        notes.append(f"the Megatron-default baseline exceeds the budget at its mean padded micro-batch "
                     f"({max(rows[0].stage_peak_bytes) / GIB:.1f} GiB); its time is predicted as if it ran")
    shapes = {
        "isf_caps": cap.to_dict(),
        "isf_mean": dict(zip(("tiles", "llm_tokens", "llm_attn_tokens_sq"), loads_i.mean_shape.tolist())),
        "random_mean_padded": dict(zip(("tiles", "llm_tokens", "llm_attn_tokens_sq"), loads_r.mean_shape.tolist())),
        "random_worst_padded": dict(zip(("tiles", "llm_tokens", "llm_attn_tokens_sq"), worst.tolist())),
    }
    isf = {"params": data.params.to_dict(), "metrics": dict(data.metrics), "groups": int(len(data.grouping)),
           "search_seconds": float(data.seconds_search), "samples_per_group": float(data.grouping.sizes.mean())}
    by_name = {"baseline": base, "+data": plus_data, "+model": plus_model, "+memory": plus_memory}
    return Plan(
        model=spec.name, device=dev.name, gpus=gpus, tp=t, pp=p, dp=d, gpu_memory_bytes=float(gpu_memory_bytes),
        budget_bytes=budget, samples=samples, samples_per_group=k, global_batch_size=m * d * k,
        num_microbatches=m, attention=attention, isf=isf, random=dict(rand_metrics), shapes=shapes,
        rows=tuple(rows), trainer_flags=flags, configs_tried=tuple(tried + skipped), notes=tuple(notes),
        timelines={s: c.sim.timeline for s, c in by_name.items()},
        stage_time_bars={r.setting: list(r.stage_time_s) for r in rows},
    )


# ------------------------------------------------------------------------------------------------
# Text and figures
# ------------------------------------------------------------------------------------------------
def format_plan(plan: Plan) -> str:
    """The plain-text report ``omnibal plan`` prints."""
    g = lambda b: b / GIB  # noqa: E731
    p = plan.isf["params"]
    lines = [
        f"{plan.model} on {plan.gpus} x {plan.device} ({plan.gpu_memory_bytes / GIB:.0f} GiB, budget "
        f"{g(plan.budget_bytes):.1f} GiB/GPU): TP={plan.tp} PP={plan.pp} DP={plan.dp}, "
        f"{plan.num_microbatches} micro-batches x {plan.samples_per_group} samples, global batch "
        f"{plan.global_batch_size}, {plan.samples} samples per epoch",
        f"ISF: Qv={p['qv']} Qt={p['qt']} Q'v={p['qv_min']} Q't={p['qt_min']} T={p['iters']}; "
        f"{plan.isf['groups']} groups of {plan.isf['samples_per_group']:.2f} samples; "
        f"DistRatio llm {plan.isf['metrics']['dist_ratio_llm']:.4f} vit {plan.isf['metrics']['dist_ratio_vit']:.4f} "
        f"(random: PadRatio {plan.random['pad_ratio']:.3f}, DistRatio llm {plan.random['dist_ratio_llm']:.3f} "
        f"vit {plan.random['dist_ratio_vit']:.3f})",
        "",
        f"{'setting':<9} {'batch':<6} {'slowest s':>9} {'peak GiB':>8} {'fits':>4} {'iter s':>8} {'straggle':>8} "
        f"{'bubble':>6} {'tokens/s':>9} {'GPU-days':>9} {'speed-up':>8}",
    ]
    for r in plan.rows:
        lines.append(
            f"{r.setting:<9} {r.batching:<6} {max(r.stage_time_s):9.3f} {g(max(r.stage_peak_bytes)):8.1f} "
            f"{'yes' if r.fits_memory else 'NO':>4} {r.iteration_s:8.2f} {r.iteration_s / r.balanced_iteration_s:8.3f} "
            f"{r.bubble_fraction:6.1%} {r.tokens_per_s:9.0f} {r.gpu_days:9.2f} {r.speedup:7.2f}x")
    lines.append("")
    for r in plan.rows:
        lines.append(f"{r.setting:<9} layout ({r.how}): {r.layout_flag}   recompute: {r.recompute_flag}")
    lines.append("")
    base, final = plan.row("baseline"), plan.row("+memory")
    lines.append(f"{'stage':>5} {'default s':>9} {'GiB':>6} {'+memory s':>9} {'GiB':>6}  recompute")
    rc = final.recompute_flag.split("|")
    for s in range(plan.pp):
        lines.append(f"{s:>5} {plan.row('+data').stage_time_s[s]:9.3f} {g(plan.row('+data').stage_peak_bytes[s]):6.1f} "
                     f"{final.stage_time_s[s]:9.3f} {g(final.stage_peak_bytes[s]):6.1f}  {rc[s]}")
    lines.append(f"(stage seconds per mean ISF micro-batch; baseline mean padded micro-batch: slowest stage "
                 f"{max(base.stage_time_s):.3f} s)")
    lines.append("")
    lines.append("trainer: pretrain_vlm.py " + plan.trainer_args)
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def plot_plan(plan: Plan, prefix: str) -> list[str]:
    """PREFIX_stages.png (stage times, default vs balanced) and PREFIX_timeline.png (+memory pipeline)."""
    from .plots import plot_stage_times, plot_timeline

    bars = {"+data (default layout)": plan.stage_time_bars["+data"], "+model": plan.stage_time_bars["+model"],
            "+memory": plan.stage_time_bars["+memory"]}
    out = [plot_stage_times(bars, f"{prefix}_stages.png",
                            title=f"{plan.model} TP={plan.tp} PP={plan.pp}: stage time per mean ISF micro-batch")]
    tl = plan.timelines.get("+memory")
    if tl is not None:
        out.append(plot_timeline(tl, f"{prefix}_timeline.png",
                                 title=f"+memory: slowest DP rank, iteration {tl.iteration_s:.2f} s, "
                                       f"bubble {tl.bubble_fraction:.1%}"))
    return out
