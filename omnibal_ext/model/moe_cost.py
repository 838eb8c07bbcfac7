"""The cost component of an MoE decoder layer (``MoELayerCost``), the expert run it is priced under
(``ExpertRun``: EP / ETP sizes and the expert load) and the decoder's unit list with MoE and dense layers at their
own kinds (``llm_layer_units``).

An MoE layer is the dense layer's attention (``components.TextLayerCost``, unchanged) with the MLP replaced by
megatron-core's ``MoELayer``: the router (a linear H -> E), the routed experts (SwiGLU, each token through
``topk`` of them), an optional shared expert (a dense SwiGLU MLP, optionally behind a sigmoid gate H -> 1) and the
token dispatcher's all-to-alls over the EP group.

FLOPs (forward, one multiply-add = 2; ``T`` tokens of the micro-batch on one CP rank, ``R`` routed tokens):
router ``2*T*H*E``; experts ``6*R*H*F`` (gate, up, down; ``4*R*H*F`` without SwiGLU) with ``R = T*topk`` (no token
dropping; with a capacity factor ``cf``: at most ``E * ceil(cf*T*topk/E)``); shared expert ``6*T*H*Fs`` and its
gate ``2*T*H``. Every rank runs, on average, the routed tokens of its own tokens (what it sends over the EP
all-to-all it receives back in other ranks' tokens), so the per-rank work is the micro-batch's FLOPs / TP as for a
dense layer; the busiest EP rank runs ``imbalance`` times the mean of the experts' work (``ExpertRun.imbalance``,
measured or ``--moe-imbalance``), which ``rank_work`` (the time) counts and ``flops`` (the FLOPs) does not.

Dispatch (megatron-core's alltoall dispatcher): each rank routes its ``T_r`` tokens (``T / TP`` under sequence
parallelism) to ``topk`` experts each; two all-to-alls forward (dispatch, combine) and two backward, each sending
``T_r * topk * H * D * (EP - 1) / EP`` bytes per rank. They run at the device's intra-node rate
(``tp_bytes_per_s``) while the EP group (ETP x EP consecutive ranks in megatron-core's expert grid) fits in a node
of ``GPUS_PER_NODE``, else at its inter-node rate per GPU (``p2p_bytes_per_s``).

Expert weights: a rank runs its ``E / EP`` local experts, each a few GEMMs over the tokens routed to it; with many
small experts these are bound by moving the weights, not by their FLOPs (``expert_weight_bytes``: the local experts'
weights read once forward, and read again plus their fp32 gradient read and written backward), added at the
device's memory bandwidth. This is what EP buys beyond memory: fewer experts per rank, more tokens per expert.

Activations (what megatron-core 0.16's MoELayer with ``SequentialMLP`` experts saves, counted tensor by tensor on a
CPU, ``tests/test_moe_plan.py``): beyond the dense layer's replicated part (the router reads the pre-MLP norm output
that a dense layer's fc1 reads), per routed token on the rank ``(H*D + 12)`` (the permuted hidden state, its int64
permutation index and fp32 probability) and ``6*F*D/ETP`` of the expert (fc1 output 2F, the activation, the gated
linear half, their product and the product scaled by the probability, F each; ``3*F*D`` without SwiGLU); per
router token ``E*9 + topk*20`` bytes (fp32 scores and masked probabilities, the bool routing map, int64 top-k
indices twice, fp32 top-k probabilities) and ``8*E + 4`` bytes per layer; a shared expert keeps what a dense MLP of
its width keeps. The routed tokens on the busiest rank (``routed_tokens``): with a capacity factor, the capacity
(``EP * E_local * ceil(cf * T_r * topk / E)``); without, the measured load when ``ExpertRun.imbalance`` is given
(``imbalance * T_r * topk``), else the worst case (every token of the EP group on this rank's experts, each at most
``min(topk, E_local)`` times: ``EP * T_r * min(topk, E_local)``); times ETP (the tokens are all-gathered over ETP).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import UserError
from .components import ActBytes, FUSED_KERNELS, TextLayerCost, sp_tokens
from .moe import DENSE_GRID, ExpertGrid, MoESpec
from .shape import MicroBatchShape
from .spec import ModelSpec
from .unit_kind import UnitEntry, UnitKind

GPUS_PER_NODE = 8  # GPUs per node of the device presets (DGX / HGX A100, H100, H200)


@dataclass(frozen=True)
class ExpertRun:
    """How MoE layers run: grid: the EP / ETP sizes; imbalance: the busiest EP rank's routed tokens over the mean
    (>= 1; measured by ``omnibal profile`` or given as ``--moe-imbalance``), None = not known: the experts' time at
    the mean (1.0) and their memory at the worst case (see the module docstring)."""

    grid: ExpertGrid = DENSE_GRID
    imbalance: float | None = None

    def __post_init__(self):
        if self.imbalance is not None and not self.imbalance >= 1.0:
            raise UserError(f"--moe-imbalance must be >= 1 (the busiest EP rank's tokens over the mean), "
                            f"got {self.imbalance}")

    @property
    def time_factor(self) -> float:
        return 1.0 if self.imbalance is None else float(self.imbalance)


MEAN_RUN = ExpertRun()


def router_tokens(shape: MicroBatchShape, tp: int, sequence_parallel: bool) -> float:
    """Tokens one rank routes: the CP rank's tokens, split over TP under sequence parallelism."""
    T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)
    return T / tp if sequence_parallel else T


def routed_flops(moe: MoESpec, hidden: int, routed: float, swiglu: bool = True) -> float:
    """Forward FLOPs of the routed experts over ``routed`` (token, expert) pairs."""
    return (6.0 if swiglu else 4.0) * routed * hidden * moe.ffn_hidden_size


def capacity_routed(moe: MoESpec, tokens: float) -> float:
    """Routed (token, expert) pairs of ``tokens`` tokens: ``tokens * topk`` without dropping, at most the
    capacity of every expert with a capacity factor (``E * ceil(cf * tokens * topk / E)``)."""
    routed = tokens * moe.topk
    if moe.capacity_factor is None:
        return routed
    return min(routed, moe.num_experts * math.ceil(moe.capacity_factor * routed / moe.num_experts))


def moe_mlp_flops(spec: ModelSpec, tokens: float, routed: float | None = None) -> float:
    """Forward FLOPs of one MoE layer's MLP part over ``tokens`` tokens: router, routed experts (``routed`` pairs,
    default ``capacity_routed``), shared expert and its gate."""
    lm, moe = spec.language, spec.language.moe
    h = lm.hidden_size
    routed = capacity_routed(moe, tokens) if routed is None else routed
    shared = (6.0 if lm.swiglu else 4.0) * tokens * h * moe.shared_expert_ffn_hidden_size
    gate = 2.0 * tokens * h if moe.shared_expert_gate else 0.0
    return 2.0 * tokens * h * moe.num_experts + routed_flops(moe, h, routed, lm.swiglu) + shared + gate


def routed_tokens(moe: MoESpec, run: ExpertRun, tokens: float) -> float:
    """(token, expert) pairs the busiest rank's experts run when each rank routes ``tokens`` tokens (the module
    docstring: capacity, measured load or worst case), times ETP."""
    ep, etp = run.grid.ep, run.grid.etp
    local = moe.num_experts // ep
    mean = tokens * moe.topk
    if moe.capacity_factor is not None:
        cap = ep * local * math.ceil(moe.capacity_factor * mean / moe.num_experts)
        busiest = cap if run.imbalance is None else min(cap, run.imbalance * mean)
    elif run.imbalance is None:
        busiest = ep * tokens * min(moe.topk, local)
    else:
        busiest = run.imbalance * mean
    return busiest * etp


def moe_act_bytes_per_rank(spec: ModelSpec, run: ExpertRun, tokens: float, dtype_bytes: int, tp: int) -> float:
    """Bytes one rank's MoE MLP keeps for backward (the module docstring), ``tokens`` routed by the rank, beyond the
    dense layer's replicated part, with the busiest rank's routed tokens of ``run`` (``routed_tokens``)."""
    return moe_act_bytes(spec, tokens, routed_tokens(spec.language.moe, run, tokens), dtype_bytes, tp, run.grid.etp)


def moe_act_bytes(spec: ModelSpec, tokens: float, routed: float, dtype_bytes: int, tp: int = 1,
                  etp: int = 1) -> float:
    """Bytes an MoE MLP keeps for backward on a rank that routes ``tokens`` tokens and whose experts run ``routed``
    (token, expert) pairs (a measured routing, or ``routed_tokens``); the shared expert split over TP."""
    lm, moe, D = spec.language, spec.language.moe, dtype_bytes
    E, k, F = moe.num_experts, moe.topk, moe.ffn_hidden_size
    router = tokens * (9.0 * E + 20.0 * k) + 8.0 * E + 4.0
    experts = routed * (lm.hidden_size * D + 12.0 + (6 if lm.swiglu else 3) * F * D / etp)
    fs = moe.shared_expert_ffn_hidden_size
    shared = tokens * (5 if lm.swiglu else 2) * fs * D / tp if fs else 0.0
    gate = tokens * 2 * D if moe.shared_expert_gate else 0.0
    return router + experts + shared + gate


def alltoall_seconds(nbytes: float, grid: ExpertGrid, device) -> float:
    """Seconds of all-to-alls sending ``nbytes`` per rank over the EP group (module docstring)."""
    if grid.ep == 1 or nbytes == 0:
        return 0.0
    rate = device.tp_bytes_per_s if grid.ep * grid.etp <= GPUS_PER_NODE else device.p2p_bytes_per_s
    return nbytes / rate


class MoELayerCost(TextLayerCost):
    """One GPT decoder layer whose MLP is a mixture of experts (``spec.language.moe``), under ``run``."""

    def __init__(self, spec: ModelSpec, unit_kind: UnitKind, run: ExpertRun = MEAN_RUN):
        if spec.language.moe is None:
            raise UserError(f"model {spec.name!r}: an MoE layer needs LanguageSpec.moe")
        super().__init__(spec, unit_kind)
        self.run = run

    def with_experts(self, run):
        return type(self)(self.spec, self.unit_kind, run)

    def _dense_mlp_flops(self, tokens: float) -> float:
        lm = self.spec.language
        return (6.0 if lm.swiglu else 4.0) * tokens * lm.hidden_size * lm.ffn_hidden_size

    def expert_flops(self, shape: MicroBatchShape) -> float:
        """Forward FLOPs of the routed experts over the micro-batch (one CP rank's tokens, all TP ranks)."""
        lm = self.spec.language
        return routed_flops(lm.moe, lm.hidden_size, capacity_routed(lm.moe, shape.rank_llm_tokens), lm.swiglu)

    def flops(self, shape, tp):
        total, core = super().flops(shape, tp)
        T = shape.rank_llm_tokens
        return total - self._dense_mlp_flops(T) + moe_mlp_flops(self.spec, T), core

    def rank_work(self, shape, tp):
        extra = (self.run.time_factor - 1.0) * self.expert_flops(shape)
        return (self.flops(shape, tp)[0] + extra) / tp

    def params(self, tp):
        lm, moe = self.spec.language, self.spec.language.moe
        h = lm.hidden_size
        mats = 3 if lm.swiglu else 2
        dense_mlp = mats * h * lm.ffn_hidden_size
        shared = mats * h * moe.shared_expert_ffn_hidden_size + (h if moe.shared_expert_gate else 0)
        return super().params(tp) - dense_mlp + moe.num_experts * h + self.expert_params() + shared

    def expert_params(self):
        lm = self.spec.language
        return lm.moe.num_experts * (3 if lm.swiglu else 2) * lm.hidden_size * lm.moe.ffn_hidden_size

    def linears(self, tp):
        return {k: v for k, v in super().linears(tp).items() if k in ("qkv", "proj")}  # no LoRA on experts

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        dense = super().act_bytes(shape, tp, dropout, attention, sequence_parallel, kernels)
        lm, D = self.spec.language, shape.dtype_bytes
        T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)
        mlp = T * (5 if lm.swiglu else 2) * lm.ffn_hidden_size * D / tp  # the dense MLP's split part
        moe = moe_act_bytes_per_rank(self.spec, self.run, router_tokens(shape, tp, sequence_parallel), D, tp)
        delta = moe - mlp
        return ActBytes(dense.act + delta, dense.full, dense.selective + delta, dense.send)

    def expert_weight_bytes(self, dtype_bytes):
        """Forward: every local expert's weights read once (``expert_params / (EP x ETP)`` x D); backward: read again
        for the input gradient, and the fp32 weight gradient read and written (``D + 8`` bytes per parameter)."""
        local = self.expert_params() / (self.run.grid.ep * self.run.grid.etp)
        return local * dtype_bytes, local * (dtype_bytes + 8.0)

    def ep_alltoall_bytes(self, shape, tp, sequence_parallel=False):
        lm, ep = self.spec.language, self.run.grid.ep
        one = router_tokens(shape, tp, sequence_parallel) * lm.moe.topk * lm.hidden_size * shape.dtype_bytes
        sent = 2.0 * one * (ep - 1) / ep
        return sent, sent


def llm_layer_units(spec: ModelSpec, dense: UnitKind, moe: UnitKind | None = None) -> list[UnitEntry]:
    """The decoder's layer units (name, kind, layer): the layers ``LanguageSpec.moe`` makes MoE of kind ``moe`` (its
    cost a ``MoELayerCost``), the others ``dense``. ``moe`` None: the family has no MoE layers, and a model with
    experts is refused."""
    lm = spec.language
    if lm.moe is not None and moe is None:
        raise UserError(f"model {spec.name!r}: model family {spec.family} has no mixture-of-experts layers "
                        "(--num-experts)")
    return [(f"llm.layer.{i}", moe if lm.is_moe_layer(i) else dense, i) for i in range(lm.num_layers)]


def run_for(moe: MoESpec | None, grid: ExpertGrid, imbalance: float | None) -> ExpertRun:
    """The expert run of a plan's configuration (a dense model: the mean run on the dense grid)."""
    return MEAN_RUN if moe is None else dataclasses.replace(MEAN_RUN, grid=grid, imbalance=imbalance)
