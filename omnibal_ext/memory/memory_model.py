"""Memory of each pipeline stage: static (weights, gradients, optimizer state) plus activations.

Tensor-free: reads a :class:`~omnibal_ext.model.costs.CostTable` (per-unit numbers for ONE
micro-batch on ONE tensor-parallel rank), a :class:`~omnibal_ext.model.layout.PipelineLayout` and
optionally a recompute plan (one ``StageRecompute`` per stage, see ``stage_recompute.py``).  All results
are bytes on one GPU (one TP rank of one pipeline stage of one DP replica).

Static bytes (Megatron mixed precision, bf16 training with Adam)
----------------------------------------------------------------
Per parameter held by the rank (``UnitCost.param_count / tp``; a frozen unit, ``UnitCost.frozen``, holds
only its weights: no gradient buffer, no optimizer state):

==========================  =====  ====================================================
bf16 parameter              2      the weights the forward and backward use
fp32 gradient (main_grad)   4      Megatron accumulates and all-reduces grads in fp32
fp32 master parameter       4      optimizer state ...
Adam exp_avg (m)            4      ...
Adam exp_avg_sq (v)         4      ... 12 bytes in all
==========================  =====  ====================================================

Mixture-of-experts layers: of a unit's ``param_count``, ``UnitCost.expert_params`` are its routed experts, split over
EP x ETP (``UnitCost.expert_split``) instead of TP; the distributed optimizer shards their state over expert DP =
TP x DP x CP / (EP x ETP), so a rank holds the same ``1 / (TP x DP x CP)`` of it as of the dense part
(``expert_static_bytes``). Their activations (the routed tokens on the busiest EP rank, the dispatcher's permuted
tokens) come with the unit's ``act_bytes`` (``omnibal_ext.model.moe_cost``).

LoRA adapters (``UnitCost.lora_params``, a frozen unit's trained adapters) count as trained parameters; a rank
holds ``(lora_params - lora_replicated) / tp + lora_replicated`` of them (``lora_rank_params``).

= 18 bytes/parameter.  With the distributed optimizer (ZeRO-1 style) the 12 optimizer bytes are
sharded over the ``dp`` data-parallel ranks: ``2 + 4 + 12 / dp`` bytes/parameter (the fp32 gradient
buffer stays whole: gradients are reduce-scattered inside it).  Other numbers go through
:class:`Precision`.

Activation bytes
----------------
A unit keeps, per micro-batch, ``act_bytes`` (no recompute), ``act_bytes_selective`` (core attention
recomputed) or ``act_bytes_full`` (only its input kept; the whole layer is recomputed in backward).
Only ViT and LLM layers can be recomputed; embeddings, projector and head always keep
``act_bytes``.  A stage's ``StageRecompute(vit_full_layers, vit_selective, llm_full_layers,
llm_selective)`` fully recomputes the FIRST ``vit_full_layers`` ViT layers of the stage (Megatron's
``recompute_method='block'``), applies selective recompute to its other ViT layers when
``vit_selective``, and likewise for the LLM layers.

Micro-batches in flight
-----------------------
1F1B (``virtual_stages=1``): stage ``i`` of ``P`` runs ``min(P - i - 1, m)`` warm-up forwards and then
one more forward before its first backward, so it holds the activations of
``min(P - i, m)`` micro-batches at its peak (stage 0 holds the most).

Interleaved (``virtual_stages=V > 1``, Megatron's schedule with micro-batch groups of ``P``): the
layout has ``P*V`` virtual stages, rank ``r`` holds model chunks ``c = 0..V-1`` = virtual stages
``c*P + r``.  Rank ``r`` runs ``W = min(2*(P - r - 1) + (V - 1)*P, m*V)`` warm-up forwards, then
alternates forward/backward, then drains.  The k-th forward runs chunk ``(k // P) % V`` and the k-th
backward chunk ``V - 1 - (k // P) % V``.  We replay that order and count, after every forward, how many
micro-batches of each chunk are alive: the peak activation bytes are
``max over time of sum_c live_c(t) * act_c`` (exact for that order); ``in_flight`` reports the
chunk-micro-batches alive at that peak.

Recompute working set
---------------------
While a recomputed layer runs its backward it re-creates its activations for one micro-batch:
``act_bytes - act_bytes_full`` (full) or ``act_bytes - act_bytes_selective`` (selective) on top of
what is stored.  A stage's ``transient_bytes`` is the largest such value among its recomputed layers
(layers are recomputed one at a time) and is added to the peak.

Stage outputs: the tensor a stage sends downstream is freed after the send (megatron-core's
``deallocate_pipeline_outputs=True``, set by the trainer): the schedule keeps only its ``.data``
shell (one element) and ``grad_fn`` until the backward, so in-flight micro-batches hold no stage
output beyond the tensors autograd saved, which ``act_bytes`` already counts.  Side tensors (DeepStack features)
travel packed with the hidden states; the receiving stage keeps the received tensor for its backward, so a
stage's activations per micro-batch include the side bytes live at its first boundary (``side_send_bytes`` of the
unit before it: ``omnibal_ext.model.side_bytes``).

Not modelled: the CUDA context, allocator fragmentation, communication buffers and temporary
workspaces — leave room for them in the budget.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import UserError
from ..model.costs import CostTable
from ..model.layout import PipelineLayout
from ..model.spec import TEXT_LAYER, VISION_LAYER

from .stage_recompute import StageRecompute

GIB = float(1 << 30)

# Per-unit recompute modes.
MODE_NONE, MODE_SELECTIVE, MODE_FULL = 0, 1, 2


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of static state (defaults: Megatron bf16 + fp32 Adam)."""

    param_bytes: float = 2.0  # bf16 weights
    grad_bytes: float = 4.0  # fp32 main_grad buffer
    optimizer_bytes: float = 12.0  # fp32 master weights + Adam m + Adam v

    def bytes_per_param(self, dp: int, distributed_optimizer: bool) -> float:
        """Static bytes per parameter on one rank; the optimizer part is sharded over ``dp``."""
        opt = self.optimizer_bytes / dp if distributed_optimizer else self.optimizer_bytes
        return self.param_bytes + self.grad_bytes + opt


MIXED_BF16_ADAM = Precision()
FP32_ADAM = Precision(param_bytes=4.0, grad_bytes=4.0, optimizer_bytes=8.0)  # fp32 weights, Adam m + v


@dataclass(frozen=True)
class StageMemory:
    """Memory of one pipeline stage (one rank), bytes.

    ``peak_bytes = static_bytes + activation_peak_bytes + transient_bytes``; under 1F1B
    ``activation_peak_bytes = in_flight * act_bytes_per_mb``.
    """

    static_bytes: float  # parameters + gradients + optimizer state
    act_bytes_per_mb: float  # activations one micro-batch leaves on this stage (under the plan)
    in_flight: int  # micro-batches (interleaved: chunk micro-batches) alive at the peak
    peak_bytes: float
    transient_bytes: float = 0.0  # one recomputed layer's re-created activations
    activation_peak_bytes: float = 0.0  # stored activations at the peak
    param_count: float = 0.0  # parameters on this rank (after the TP split)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class MemoryModelError(UserError):
    """Inputs of the memory model that do not fit together (layout, plan, parallel sizes)."""


def _check_parallel(pp: int, tp: int, dp: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    for name, value in (("pp", pp), ("tp", tp), ("dp", dp), ("num_microbatches", num_microbatches),
                        ("virtual_stages", virtual_stages)):
        if int(value) != value or value < 1:
            raise MemoryModelError(f"memory model: {name} must be an integer >= 1, got {value!r}")


def _check_layout(costs: CostTable, layout: PipelineLayout, stages_expected: int) -> None:
    if layout.num_stages != stages_expected:
        raise MemoryModelError(
            f"memory model: layout has {layout.num_stages} stages but pp x virtual stages is {stages_expected}")
    if sum(layout.stage_units) != len(costs.units):
        raise MemoryModelError(
            f"memory model: layout covers {sum(layout.stage_units)} units but the cost table has {len(costs.units)}")
    if any(n <= 0 for n in layout.stage_units):
        raise MemoryModelError(f"memory model: every stage needs a unit, got counts {list(layout.stage_units)}")


def stage_layer_counts(costs: CostTable, layout: PipelineLayout) -> list[tuple[int, int]]:
    """(ViT layers, LLM layers) of each stage."""
    codes = [u.code for u in costs.units]
    return [(sum(codes[i] == VISION_LAYER for i in rng), sum(codes[i] == TEXT_LAYER for i in rng))
            for rng in layout.stage_slices()]


def unit_modes(costs: CostTable, layout: PipelineLayout, plan: Sequence[StageRecompute] | None) -> np.ndarray:
    """Recompute mode of every unit (MODE_NONE / MODE_SELECTIVE / MODE_FULL) under ``plan``."""
    modes = np.full(len(costs.units), MODE_NONE, dtype=np.int8)
    if plan is None:
        return modes
    if len(plan) != layout.num_stages:
        raise MemoryModelError(f"recompute plan has {len(plan)} stages but the layout has {layout.num_stages}")
    counts = stage_layer_counts(costs, layout)
    for s, (rng, sr) in enumerate(zip(layout.stage_slices(), plan)):
        nv, nl = counts[s]
        if sr.vit_full_layers > nv or sr.llm_full_layers > nl or sr.vit_full_layers < 0 or sr.llm_full_layers < 0:
            raise MemoryModelError(
                f"recompute plan stage {s}: {sr.vit_full_layers} ViT / {sr.llm_full_layers} LLM layers fully "
                f"recomputed but the stage holds {nv} ViT / {nl} LLM layers")
        seen = {VISION_LAYER: 0, TEXT_LAYER: 0}
        full = {VISION_LAYER: sr.vit_full_layers, TEXT_LAYER: sr.llm_full_layers}
        sel = {VISION_LAYER: sr.vit_selective, TEXT_LAYER: sr.llm_selective}
        for i in rng:
            code = costs.units[i].code
            if code not in seen:
                continue
            if seen[code] < full[code]:
                modes[i] = MODE_FULL
            elif sel[code]:
                modes[i] = MODE_SELECTIVE
            seen[code] += 1
    return modes


def unit_activation_bytes(costs: CostTable, modes: np.ndarray) -> np.ndarray:
    """Bytes each unit keeps per micro-batch under ``modes``."""
    a = costs.arrays
    return np.select([modes == MODE_FULL, modes == MODE_SELECTIVE], [a.act_bytes_full, a.act_bytes_selective],
                     a.act_bytes)


def unit_transient_bytes(costs: CostTable, modes: np.ndarray) -> np.ndarray:
    """Bytes a unit re-creates while it is recomputed in backward (0 when not recomputed)."""
    a = costs.arrays
    t = np.select([modes == MODE_FULL, modes == MODE_SELECTIVE],
                  [a.act_bytes - a.act_bytes_full, a.act_bytes - a.act_bytes_selective], 0.0)
    return np.maximum(t, 0.0)


def unit_time_s(costs: CostTable, modes: np.ndarray) -> np.ndarray:
    """Seconds per micro-batch of each unit: forward + backward + recompute under ``modes``."""
    a = costs.arrays
    extra = np.select([modes == MODE_FULL, modes == MODE_SELECTIVE], [a.fwd_s, a.selective_recompute_s], 0.0)
    return a.fwd_s + a.bwd_s + extra


def stage_time_s(costs: CostTable, layout: PipelineLayout, plan: Sequence[StageRecompute] | None) -> np.ndarray:
    """Seconds per micro-batch of each stage (forward + backward + recompute), no communication."""
    t = unit_time_s(costs, unit_modes(costs, layout, plan))
    return np.array([t[list(r)].sum() for r in layout.stage_slices()])


def static_bytes(param_count: float, dp: int, distributed_optimizer: bool = True,
                 precision: Precision = MIXED_BF16_ADAM) -> float:
    """Static bytes of ``param_count`` parameters held by one rank."""
    return float(param_count) * precision.bytes_per_param(dp, distributed_optimizer)


def unit_static_bytes(costs: CostTable, tp: int, dp: int, distributed_optimizer: bool = True,
                      precision: Precision = MIXED_BF16_ADAM) -> np.ndarray:
    """Static bytes of each unit on one rank: a frozen unit (``UnitCost.frozen``) holds its weights only (no
    gradient buffer, no optimizer state), the others ``precision.bytes_per_param`` per parameter; LoRA
    adapters (trained) ``precision.bytes_per_param`` each."""
    a = costs.arrays
    trained = precision.bytes_per_param(dp, distributed_optimizer)
    per = np.where(a.frozen, precision.param_bytes, trained)
    dense = (a.param_count - a.expert_params) / tp * per + lora_rank_params(costs, tp) * trained
    return dense + expert_static_bytes(costs, tp, dp, distributed_optimizer, precision)


def expert_static_bytes(costs: CostTable, tp: int, dp: int, distributed_optimizer: bool = True,
                        precision: Precision = MIXED_BF16_ADAM) -> np.ndarray:
    """Static bytes of each unit's routed experts on one rank (MoE layers; 0 elsewhere): a rank holds
    ``expert_params / (EP x ETP)`` (``UnitCost.expert_split``) with their gradients; the distributed optimizer shards
    their state over expert DP = TP x DP / (EP x ETP) (``dp``: the ranks holding one copy of the dense part, DP x CP),
    so a rank holds ``expert_params / (TP x DP)`` of it, as of the dense part. Frozen experts: weights only."""
    a = costs.arrays
    local = a.expert_params / a.expert_split
    opt = a.expert_params / (tp * dp) if distributed_optimizer else local
    trained = local * (precision.param_bytes + precision.grad_bytes) + opt * precision.optimizer_bytes
    return np.where(a.frozen, local * precision.param_bytes, trained)


def rank_param_counts(costs: CostTable, tp: int) -> np.ndarray:
    """Parameters of each unit on one rank: the dense part / TP, the routed experts / (EP x ETP), LoRA adapters."""
    a = costs.arrays
    return (a.param_count - a.expert_params) / tp + a.expert_params / a.expert_split + lora_rank_params(costs, tp)


def lora_rank_params(costs: CostTable, tp: int) -> np.ndarray:
    """LoRA adapter parameters of each unit on one TP rank: the split part / tp plus the replicated part."""
    a = costs.arrays
    return (a.lora_params - a.lora_replicated) / tp + a.lora_replicated


def in_flight_1f1b(pp: int, num_microbatches: int) -> np.ndarray:
    """Micro-batches whose activations stage i (0..pp-1) holds at its peak under 1F1B: min(pp - i, m)."""
    return np.minimum(pp - np.arange(pp), num_microbatches)


@functools.lru_cache(maxsize=4096)
def interleaved_live_counts(pp: int, virtual_stages: int, num_microbatches: int, rank: int) -> np.ndarray:
    """Micro-batches alive per model chunk on ``rank`` after each forward of the interleaved schedule.

    Returns a read-only int array of shape (forwards, virtual_stages) (kept: the planner asks for the same schedules
    many times); see the module docstring for the order.
    """
    p, v, m = pp, virtual_stages, num_microbatches
    total = m * v
    if not 0 <= rank < p:
        raise MemoryModelError(f"memory model: rank {rank} outside 0..{p - 1}")
    # v == 1 is plain 1F1B (p - rank - 1 warm-up forwards).
    warmup = min(p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p, total)
    k = np.arange(total)
    fwd_chunk = (k // p) % v
    bwd_chunk = v - 1 - (k // p) % v
    fwd_done = np.zeros((total, v), dtype=np.int64)
    fwd_done[k, fwd_chunk] = 1
    fwd_done = np.cumsum(fwd_done, axis=0)  # row j: forwards 0..j done
    bwd_done = np.zeros((total + 1, v), dtype=np.int64)
    bwd_done[k + 1, bwd_chunk] = 1
    bwd_done = np.cumsum(bwd_done, axis=0)  # row i: backwards 0..i-1 done
    # Forward j runs after backwards 0..(j - warmup - 1) in the steady phase (none during warm-up).
    bwd_before = np.clip(k - warmup, 0, total)
    live = fwd_done - bwd_done[bwd_before]
    live.flags.writeable = False
    return live


def stage_memory(costs: CostTable, layout: PipelineLayout, plan: Sequence[StageRecompute] | None,
                 pp: int, tp: int, dp: int, num_microbatches: int, distributed_optimizer: bool = True,
                 precision: Precision = MIXED_BF16_ADAM, virtual_stages: int = 1) -> list[StageMemory]:
    """Memory of each pipeline rank (``pp`` entries) under ``plan`` (None: no recompute).

    ``layout`` has ``pp * virtual_stages`` stages; with ``virtual_stages > 1`` entry ``r`` sums
    the chunks ``c*pp + r`` (see the module docstring) and ``plan`` has one entry per virtual stage.
    """
    _check_parallel(pp, tp, dp, num_microbatches, virtual_stages)
    _check_layout(costs, layout, pp * virtual_stages)
    modes = unit_modes(costs, layout, plan)
    act = unit_activation_bytes(costs, modes)
    trans = unit_transient_bytes(costs, modes)
    params = rank_param_counts(costs, tp)
    stat_u = unit_static_bytes(costs, tp, dp, distributed_optimizer, precision)
    slices = [list(r) for r in layout.stage_slices()]
    side = costs.arrays.side_send_bytes
    st_act = np.array([act[s].sum() + (side[s[0] - 1] if s[0] > 0 else 0.0) for s in slices])
    st_trans = np.array([trans[s].max() for s in slices])
    st_params = np.array([params[s].sum() for s in slices])
    st_static = np.array([stat_u[s].sum() for s in slices])
    out = []
    if virtual_stages == 1:
        for i, n in enumerate(in_flight_1f1b(pp, num_microbatches)):
            stat = float(st_static[i])
            act_peak = float(n * st_act[i])
            out.append(StageMemory(stat, float(st_act[i]), int(n), float(stat + act_peak + st_trans[i]),
                                   float(st_trans[i]), act_peak, float(st_params[i])))
        return out
    for r in range(pp):
        chunks = [c * pp + r for c in range(virtual_stages)]
        live = interleaved_live_counts(pp, virtual_stages, num_microbatches, r)
        per_time = live @ st_act[chunks]
        t = int(np.argmax(per_time))
        stat = float(st_static[chunks].sum())
        act_peak = float(per_time[t])
        tr = float(st_trans[chunks].max())
        out.append(StageMemory(stat, float(st_act[chunks].sum()), int(live[t].sum()), float(stat + act_peak + tr),
                               tr, act_peak, float(st_params[chunks].sum())))
    return out
