"""What a layout serves at: the analytic time of generation's decode steps per pipeline stage, and the tokens per
second and time per token that follow (``omnibal plan``'s serving lines; the engine is ``megatron.vlm.inference``).

A decode step runs the LLM's units only (text embedding, layers, head; the ViT and projector work at the prefill)
on ``batch`` new tokens, one per sequence, each sequence holding ``context`` cached tokens. Per unit and TP rank:

* FLOPs: the unit's own for a micro-batch of ``batch`` one-token sequences (its component's ``flops``) plus what it
  spends on its cache (``CostComponent.decode_cache``: attention over ``context`` keys, ``4 * width * context`` per
  token; a recurrent state's update and read);
* bytes: its weights (every step reads them all; an MoE layer's routed experts only those its ``batch * topk``
  choices touch, ``E * (1 - (1 - topk/E)^batch)`` of ``E`` on average, split over EP) plus its cache (keys and
  values of ``context`` tokens; a recurrent state);
* time: ``max(FLOPs / TP / (peak * efficiency), bytes / memory bandwidth)`` (a decode step is a matrix-vector
  product per token: at small batches it reads weights, at large ones it computes), plus its TP all-reduces
  (``tp_allreduce_bytes`` over the bus bandwidth, and ``COLLECTIVE_LATENCY_S`` each: small messages are latency
  bound).

A stage's step is the sum of its units' plus the send of ``batch x hidden`` to the next stage (``p2p_bytes_per_s``
and ``COLLECTIVE_LATENCY_S``). The engine keeps as many groups of sequences in flight as the decode runs through
stages (``S``), each ``batch / S`` sequences: every ``tick`` (the slowest stage's step on ``batch / S``) each stage
works on one group, and each group gets a token every ``S`` ticks: ``tokens/s = batch / (S * tick)`` and the time
per token (between two tokens of one sequence) ``S * tick``. ``ttft_s``: a prompt's prefill through every stage
(the training forward of one sequence of ``prompt_tokens`` with ``vision_items``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .cost_model import DeviceSpec, analytic_costs, tp_allreduce_s
from .layout import PipelineLayout
from .shape import MicroBatchShape
from .spec import HEAD, TEXT_EMBED, TEXT_LAYER, ModelSpec
from .units import build_units, unit_components

DECODE_ROLES = (TEXT_EMBED, TEXT_LAYER, HEAD)
# one small-message collective or point-to-point send (NCCL within a node is about 10 us; an assumption, not a
# measurement of ours)
COLLECTIVE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class DecodeLoad:
    """What a decode step runs: ``batch`` sequences (one new token each), ``context`` cached tokens per sequence on
    average, ``dtype_bytes`` per weight and activation element."""

    batch: int
    context: float
    dtype_bytes: int = 2

    def __post_init__(self):
        if self.batch < 1 or self.context < 0 or self.dtype_bytes < 1:
            raise UserError(f"DecodeLoad: batch >= 1, context >= 0 and dtype_bytes >= 1, got {self}")


@dataclass(frozen=True)
class DecodeEstimate:
    """A layout's decode: seconds of one step per pipeline stage (on ``batch / groups`` sequences), the groups in
    flight, tokens per second (all sequences), seconds per token of one sequence, and the first token's time."""

    batch: int
    context: float
    stage_step_s: tuple[float, ...]
    groups: int
    tokens_per_s: float
    s_per_token: float
    ttft_s: float | None = None

    def to_dict(self) -> dict:
        return {"batch": self.batch, "context": self.context, "stage_step_s": list(self.stage_step_s),
                "groups": self.groups, "tokens_per_s": self.tokens_per_s, "ms_per_token": 1e3 * self.s_per_token,
                **({"ttft_ms": 1e3 * self.ttft_s} if self.ttft_s is not None else {})}


def touched_experts(num_experts: int, topk: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens choose ``topk`` each of ``num_experts`` (uniform routing)."""
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** tokens)


def unit_decode_seconds(spec: ModelSpec, device: DeviceSpec, tp: int, load: DecodeLoad, ep: int = 1) -> list[float]:
    """Seconds of one decode step of every unit of ``build_units(spec)`` on one TP rank (0 for the units a decode
    step skips); ``ep``: expert-parallel ranks the routed experts are split over."""
    if tp < 1 or ep < 1:
        raise UserError(f"unit_decode_seconds: tp and ep must be >= 1, got {tp}, {ep}")
    shape = MicroBatchShape(0, load.batch, load.dtype_bytes, llm_attn_tokens_sq=float(load.batch))
    moe = spec.language.moe
    out = []
    for unit, c in zip(build_units(spec), unit_components(spec)):
        if unit.code not in DECODE_ROLES:
            out.append(0.0)
            continue
        cache_flops, cache_bytes = c.decode_cache(load.batch, load.context, tp, load.dtype_bytes)
        flops = (c.flops(shape, tp)[0] + cache_flops) / tp
        experts = c.expert_params()
        weights = (c.params(tp) - experts) / tp
        if experts:
            weights += experts * touched_experts(moe.num_experts, moe.topk, load.batch) / moe.num_experts / (ep * tp)
        nbytes = weights * load.dtype_bytes + cache_bytes + (c.mem_bytes(shape) if c.memory_bound else 0.0)
        seconds = max(flops / (device.matmul_flops_per_s * c.efficiency), nbytes / device.mem_bytes_per_s)
        if tp > 1:
            fwd_bytes, _ = c.tp_allreduce_bytes(shape, tp=tp)
            token_bytes = load.batch * spec.language.hidden_size * load.dtype_bytes
            seconds += tp_allreduce_s(fwd_bytes, tp, device) + round(fwd_bytes / token_bytes) * COLLECTIVE_LATENCY_S
        out.append(seconds)
    return out


def decode_estimate(spec: ModelSpec, device: DeviceSpec, tp: int, layout: PipelineLayout, load: DecodeLoad,
                    ep: int = 1, prompt: MicroBatchShape | None = None) -> DecodeEstimate:
    """The decode of ``layout`` (one stage per pipeline rank) at ``load`` (module docstring); with ``prompt`` also
    the time of its prefill (the first token)."""
    units = build_units(spec)
    stages = [r for r in layout.stage_slices() if any(units[i].code in DECODE_ROLES for i in r)]
    groups = max(1, min(len(stages), load.batch))
    per_group = DecodeLoad(-(-load.batch // groups), load.context, load.dtype_bytes)
    seconds = unit_decode_seconds(spec, device, tp, per_group, ep)
    send = per_group.batch * spec.language.hidden_size * load.dtype_bytes / device.p2p_bytes_per_s + COLLECTIVE_LATENCY_S
    stage_s = tuple(sum(seconds[i] for i in r) + (send if k < len(stages) - 1 else 0.0) for k, r in enumerate(stages))
    tick = max(stage_s)
    per_token = len(stages) * tick if groups == len(stages) else sum(stage_s)
    ttft = None
    if prompt is not None:
        costs = analytic_costs(spec, prompt, tp, device)
        ttft = sum(u.fwd_s for u in costs.units) + (layout.num_stages - 1) * (
            prompt.llm_tokens * spec.language.hidden_size * prompt.dtype_bytes / device.p2p_bytes_per_s)
    return DecodeEstimate(load.batch, load.context, stage_s, groups, load.batch / per_token, per_token, ttft)
