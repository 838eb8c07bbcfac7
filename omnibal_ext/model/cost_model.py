"""Analytic cost model: FLOPs, times and bytes of every pipeline unit for one micro-batch.

Everything here is for ONE micro-batch on ONE tensor-parallel rank (matching ``costs.UnitCost``).

Micro-batch: ``tiles`` ViT tiles (each runs ``spec.vision.seq_per_tile`` tokens: patches + class
token; attention is within a tile) and ``llm_tokens`` LLM tokens (text plus image-context tokens).

FLOPs (forward, one multiply-add = 2 FLOPs), ``s`` tokens, ``h`` hidden, ``f`` MLP hidden:

* ViT layer, per tile: ``2*s*(4*h^2 + 2*h*f)`` (QKV + out projection, 2-matrix GELU MLP) plus
  attention scores and context ``4*s^2*h`` (full, non-causal attention within the tile).
* LLM layer: ``2*T*h*(h + 2*g*d)`` (Q plus grouped K, V: ``g`` query groups of head size ``d``),
  ``2*T*h*h`` (out projection), ``6*T*h*f`` (SwiGLU: gate, up, down; 4*T*h*f without SwiGLU) and
  attention ``4*h*pairs`` with ``pairs = 0.5 * sum(len_i^2)`` over the packed samples (causal
  attention computes only the lower triangle, as FlashAttention does). ``MicroBatchShape``'s
  ``llm_attn_tokens_sq`` gives ``sum(len_i^2)``; when None the micro-batch is one sequence of
  ``llm_tokens`` (the upper bound).
* Output head: ``2*T*h*V``; projector: ``2*n*(h_in*h_llm + h_llm^2)`` over ``n = tiles *
  tokens_per_tile`` tokens; patch embedding: ``2*patches*(C*p^2)*h`` per tile; LLM embedding: no
  FLOPs (a gather; timed as memory traffic ``2*T*h*dtype_bytes`` bytes).

Times: forward ``flops / tp / (peak * efficiency[kind]) + bytes / mem_bytes_per_s``; backward is
``device.bwd_over_fwd`` times the forward. The backward has twice the forward's FLOPs (gradients of
inputs and of weights), but its large matmuls run closer to peak: on A100 a Megatron transformer layer
measured 7.7 ms forward and 11.9 ms backward (Korthikanti et al. 2022, Table 4, 22B model), a ratio
of 1.55, and full recompute added 39% to the layer (7.7 ms more in the backward).  The A100 preset
uses that ratio; the Hopper presets use 1.79, our trainer's layers measured on an H200
(``profiles/h200``); a profile (``calibrated_costs``) fits its own. Tensor-parallel all-reduces are
added at the device's intra-node bus bandwidth (``tp_allreduce_bytes``); InternViT-6B's 25 heads are
padded to a multiple of the TP size (``VisionSpec.padded_heads``), and its FLOPs, bytes and
parameters count the padded heads.

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
layers keep beyond that (GQA keys and values repeated to every head, megatron-core's unfused GLU,
rotary tables, per-sample attention outputs) is listed in ``layer_act_bytes_per_token``; with it the
model matches the H200 profiles in ``profiles/h200`` to 0.1%. ``act_bytes``
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
from .costs import CostTable, UnitCost
from .units import KIND_CODES, ModelSpec, Unit, build_units


@dataclass(frozen=True)
class MicroBatchShape:
    """What one micro-batch holds.

    tiles: ViT tiles (448px crops) in the micro-batch; each runs ``spec.vision.seq_per_tile`` tokens.
    llm_tokens: LLM sequence tokens, image-context tokens included.
    dtype_bytes: bytes per activation element (2 for bf16/fp16).
    llm_attn_tokens_sq: sum of squared lengths of the packed samples (tokens^2); None = one
        sequence of ``llm_tokens``.
    """

    tiles: int
    llm_tokens: int
    dtype_bytes: int = 2
    llm_attn_tokens_sq: float | None = None

    def __post_init__(self):
        if self.tiles < 0 or self.llm_tokens < 0 or self.dtype_bytes <= 0:
            raise UserError(f"MicroBatchShape: tiles and llm_tokens must be >= 0 and dtype_bytes > 0, got {self}")
        if self.llm_attn_tokens_sq is not None and not (
            0 <= self.llm_attn_tokens_sq <= float(self.llm_tokens) ** 2 + 1e-6
        ):
            raise UserError(
                f"MicroBatchShape: llm_attn_tokens_sq={self.llm_attn_tokens_sq} must lie in [0, llm_tokens^2]"
            )

    @property
    def attn_tokens_sq(self) -> float:
        """sum(len_i^2) over the packed LLM samples, tokens^2."""
        if self.llm_attn_tokens_sq is None:
            return float(self.llm_tokens) ** 2
        return float(self.llm_attn_tokens_sq)

    def to_dict(self) -> dict:
        return {"tiles": self.tiles, "llm_tokens": self.llm_tokens, "dtype_bytes": self.dtype_bytes,
                "llm_attn_tokens_sq": self.llm_attn_tokens_sq}

    @classmethod
    def from_dict(cls, d: dict) -> "MicroBatchShape":
        return cls(int(d["tiles"]), int(d["llm_tokens"]), int(d.get("dtype_bytes", 2)), d.get("llm_attn_tokens_sq"))


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
    """

    name: str
    matmul_flops_per_s: float
    mem_bytes_per_s: float
    p2p_bytes_per_s: float
    memory_bytes: float
    bwd_over_fwd: float = 2.0
    tp_bytes_per_s: float = 100e9


GiB = 2**30

# Peak bf16 dense rates from the vendors' data sheets. Memory bandwidth is ~80% of the data-sheet
# HBM rate (what STREAM-like copies reach). p2p is the inter-node rate per GPU (pipeline stages
# usually sit on different nodes): A100 with one HDR 200 Gb/s HCA per GPU (25 GB/s), H100/H200 with
# one NDR 400 Gb/s HCA per GPU (50 GB/s). Tensor-parallel all-reduces stay in a node: NCCL's
# all_reduce_perf reaches a bus bandwidth of about 230 GB/s on DGX A100 (NVLink 3) and about 450 GB/s
# on DGX H100/H200 (NVLink 4) for large messages. The CPU entry is a rough 2-core laptop-class machine
# (only used to sanity-check small runs; calibrate with a profile for real numbers).
# Backward/forward time of a transformer layer: on A100 as published (module docstring); on Hopper
# as measured here, our trainer's ViT and LLM layers of InternVL-6B+20B in bf16 on an H200 at 9 tiles
# and 4096 tokens (profiles/h200: 7.99/4.48 ms and 11.97/6.70 ms). H100 is the same chip.
A100_BWD_OVER_FWD = 11.9 / 7.7  # Korthikanti et al. 2022, Table 4: 22B layer on A100, ms
HOPPER_BWD_OVER_FWD = 1.79
DEVICES: dict[str, DeviceSpec] = {
    "a100-80g": DeviceSpec("a100-80g", 312e12, 0.8 * 2.039e12, 25e9, 80 * GiB, A100_BWD_OVER_FWD, 230e9),
    "h100-80g": DeviceSpec("h100-80g", 989e12, 0.8 * 3.35e12, 50e9, 80 * GiB, HOPPER_BWD_OVER_FWD, 450e9),
    "h200-141g": DeviceSpec("h200-141g", 989e12, 0.8 * 4.8e12, 50e9, 141e9, HOPPER_BWD_OVER_FWD, 450e9),
    "cpu": DeviceSpec("cpu", 100e9, 20e9, 5e9, 16 * GiB, 2.0, 5e9),
}

# Fraction of peak matmul rate each kind of unit reaches. ~0.5 is what large Megatron runs report
# as model FLOPs utilisation of the transformer layers; the patch embedding (a strided conv with
# 588-wide reduction) and the projector (few tokens) reach less.
DEFAULT_EFFICIENCY: dict[str, float] = {
    "vit_embed": 0.3,
    "vit_layer": 0.5,
    "projector": 0.4,
    "llm_embed": 0.5,  # unused (no FLOPs); the embedding is timed as memory traffic
    "llm_layer": 0.5,
    "llm_head": 0.5,
}

def get_device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise UserError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------
def vit_layer_flops(spec: ModelSpec, tiles: int, tp: int = 1) -> tuple[float, float]:
    """(total, attention-core) forward FLOPs of one ViT layer over ``tiles`` tiles, all TP ranks.

    At TP sizes that do not divide the heads, the layer runs ``spec.vision.padded_heads(tp)`` heads
    (zero ones after the real ones), and the attention's FLOPs grow with them.
    """
    v = spec.vision
    s, h, f = v.seq_per_tile, v.hidden_size, v.ffn_hidden_size
    width = v.padded_heads(tp) * v.head_dim  # attention width: h without padding
    linear = 2.0 * s * (4 * h * width + 2 * h * f)
    core = 4.0 * s * s * width
    return tiles * (linear + core), tiles * core


def llm_layer_flops(spec: ModelSpec, shape: MicroBatchShape) -> tuple[float, float]:
    """(total, attention-core) forward FLOPs of one LLM layer over the micro-batch."""
    lm = spec.language
    t, h, f = shape.llm_tokens, lm.hidden_size, lm.ffn_hidden_size
    d = lm.kv_channels
    width = lm.num_attention_heads * d  # attention width: h, unless head_dim says otherwise
    qkv = 2.0 * t * h * (width + 2 * lm.kv_groups * d)
    out = 2.0 * t * width * h
    mlp = (6.0 if lm.swiglu else 4.0) * t * h * f
    core = 4.0 * width * 0.5 * shape.attn_tokens_sq  # causal: half of the score matrix
    return qkv + out + mlp + core, core


def unit_flops(spec: ModelSpec, shape: MicroBatchShape, tp: int = 1) -> list[float]:
    """Forward FLOPs of every unit of ``build_units(spec)`` for one micro-batch, summed over the TP
    ranks (``tp`` only adds the ViT's padded heads)."""
    return [_unit_flops_core(spec, shape, u, tp)[0] for u in build_units(spec)]


def _unit_flops_core(spec: ModelSpec, shape: MicroBatchShape, unit: Unit, tp: int = 1) -> tuple[float, float]:
    v, lm = spec.vision, spec.language
    if unit.kind == "vit_embed":
        return shape.tiles * 2.0 * v.patches_per_tile * (v.in_channels * v.patch_size**2) * v.hidden_size, 0.0
    if unit.kind == "vit_layer":
        return vit_layer_flops(spec, shape.tiles, tp)
    if unit.kind == "projector":
        n = shape.tiles * spec.tokens_per_tile
        return 2.0 * n * (spec.projector_in_size * lm.hidden_size + lm.hidden_size**2), 0.0
    if unit.kind == "llm_embed":
        return 0.0, 0.0
    if unit.kind == "llm_layer":
        return llm_layer_flops(spec, shape)
    if unit.kind == "llm_head":
        return 2.0 * shape.llm_tokens * lm.hidden_size * lm.vocab_size, 0.0
    raise ValueError(f"unit {unit.name!r}: unknown kind {unit.kind!r}")


def unit_mem_bytes(spec: ModelSpec, shape: MicroBatchShape, tp: int = 1) -> list[float]:
    """Memory traffic (bytes) of the memory-bound part of every unit's forward, per TP rank.

    Only the LLM embedding is counted (read T rows, write T x h); the other units are
    matmul-bound and their elementwise work is folded into their efficiency.
    """
    out = []
    for u in build_units(spec):
        if u.kind == "llm_embed":
            out.append(2.0 * shape.llm_tokens * spec.language.hidden_size * shape.dtype_bytes)
        else:
            out.append(0.0)
    return out


def unit_work(spec: ModelSpec, shape: MicroBatchShape, tp: int = 1) -> list[float]:
    """What calibration divides time by: forward FLOPs per TP rank, or memory bytes for units without FLOPs."""
    flops = unit_flops(spec, shape, tp)
    mem = unit_mem_bytes(spec, shape, tp)
    return [fl / tp if fl > 0 else mb for fl, mb in zip(flops, mem)]


# ----------------------------------------------------------------------------------------------
# Bytes and parameters
# ----------------------------------------------------------------------------------------------
def layer_act_bytes_per_token(
    hidden: int, heads: int, kv_groups: int, ffn: int, swiglu: bool, attended: float,
    dtype_bytes: int, tp: int, dropout: bool, attention: str, *, rotary: bool = False, per_sample: bool = False,
    built_heads: int | None = None, head_dim: int | None = None,
) -> tuple[float, float]:
    """(all, attention-core) activation bytes per token of one pre-norm layer (see module docstring).

    attended: attended length per token (tokens), so the core keeps ``heads*attended`` scores per token.
    rotary: the layer applies rotary embeddings; per_sample: attention runs once per packed sample;
    built_heads: heads the layer is built with (padded for TP; default ``heads``); head_dim: per-head
    width (default hidden / heads).

    Beyond the textbook count, what this trainer's megatron-core local layers keep, as measured on an
    H200 (``profiles/h200``; the ViT layer matches to 0.1%, the LLM layers to 0.1%):
    * keys and values repeated to every query head before attention (megatron-core's core attention
      and ``SegmentAttention`` both do): K, V cost ``2*h*D/t``, not ``2*g*d*D/t``;
    * a gated MLP through megatron-core's unfused GLU (no bias, so no bias-activation fusion) also
      keeps ``act(x_glu)`` and ``x_linear + offset``: ``5*f*D/t``, not ``3*f*D/t``;
    * rotary embeddings keep cos and sin for q and for k: ``4*d*D``, replicated;
    * attention run per packed sample keeps each sample's output beside the concatenated
      out-projection input: ``h*D/t`` more.
    """
    d_bytes, p = dtype_bytes, (1 if dropout else 0)
    head_dim = head_dim or hidden // heads
    heads = built_heads or heads
    width = heads * head_dim  # attention width: hidden, unless heads are padded
    replicated = 4 * hidden * d_bytes + 2 * hidden * p + (4 * head_dim * d_bytes if rotary else 0)
    split = (width + 2 * max(kv_groups, heads) * head_dim) * d_bytes + width * d_bytes
    split += (5 if swiglu else 2) * ffn * d_bytes
    if per_sample:
        split += width * d_bytes
    if attention == "unfused":
        core = heads * attended * (d_bytes + p + p * d_bytes)
    elif attention == "flash":
        core = heads * 4.0  # fp32 log-sum-exp per head; the output is counted as the out-proj input
    else:
        raise UserError(f"attention must be 'unfused' or 'flash', got {attention!r}")
    return replicated + (split + core) / tp, core / tp


def unit_param_counts(spec: ModelSpec, tp: int = 1) -> list[int]:
    """Parameters of every unit (weights, biases, norm weights, qk-norm weights, layer scales), whole
    model; at ``tp`` the ViT's padded heads included. A tied output layer is counted in ``llm.head`` too:
    it holds its own copy whenever E and L sit on different stages."""
    v, lm = spec.vision, spec.language
    out = []
    for u in build_units(spec):
        if u.kind == "vit_embed":
            n = v.in_channels * v.patch_size**2 * v.hidden_size + v.hidden_size  # conv + bias
            n += v.hidden_size + v.seq_per_tile * v.hidden_size  # class token + position embedding
        elif u.kind == "vit_layer":
            h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
            n = 4 * h * width + 2 * h * f + (h + f + h) + 2 * h * (2 if v.normalization == "LayerNorm" else 1)
            n += 3 * width if v.qkv_bias else 0  # QKV bias
            n += 2 * width if v.qk_norm else 0  # q and k norm weights over the full width
            n += 2 * h if v.layer_scale_init is not None else 0  # ls1, ls2
        elif u.kind == "projector":
            hi, ho = spec.projector_in_size, lm.hidden_size
            n = 2 * hi + hi * ho + ho + ho * ho + ho
        elif u.kind == "llm_embed":
            n = lm.vocab_size * lm.hidden_size
        elif u.kind == "llm_layer":
            h, f = lm.hidden_size, lm.ffn_hidden_size
            d = lm.kv_channels
            qkv_rows = lm.num_attention_heads * d + 2 * lm.kv_groups * d
            n = h * qkv_rows + lm.num_attention_heads * d * h + (3 if lm.swiglu else 2) * h * f + 2 * h
            n += qkv_rows if lm.qkv_bias else 0
        elif u.kind == "llm_head":
            n = lm.vocab_size * lm.hidden_size + lm.hidden_size
        else:
            raise ValueError(f"unit {u.name!r}: unknown kind {u.kind!r}")
        out.append(int(n))
    return out


def _unit_bytes(spec: ModelSpec, shape: MicroBatchShape, unit: Unit, tp: int, dropout: bool, attention: str):
    """(act_bytes, act_bytes_full, act_bytes_selective, send_bytes) of one unit, per TP rank."""
    v, lm, D = spec.vision, spec.language, shape.dtype_bytes
    T, n_img = shape.llm_tokens, shape.tiles * spec.tokens_per_tile
    vit_tokens = shape.tiles * v.seq_per_tile
    if unit.kind == "vit_embed":
        pixels = shape.tiles * v.in_channels * v.image_size**2 * D
        return pixels, pixels, pixels, vit_tokens * v.hidden_size * D
    if unit.kind == "vit_layer":
        per_tok, core = layer_act_bytes_per_token(
            v.hidden_size, v.num_attention_heads, v.num_attention_heads, v.ffn_hidden_size, False,
            v.seq_per_tile, D, tp, dropout, attention, built_heads=v.padded_heads(tp))
        full = vit_tokens * v.hidden_size * D
        return vit_tokens * per_tok, full, vit_tokens * (per_tok - core), full
    if unit.kind == "projector":
        hi, ho = spec.projector_in_size, lm.hidden_size
        act = n_img * (2 * hi * D + 2 * ho * D / tp)  # norm input and output, GELU input, fc2 input
        return act, n_img * hi * D, act, n_img * ho * D
    if unit.kind == "llm_embed":
        ids = T * 8.0  # int64 token ids
        return ids, ids, ids, T * lm.hidden_size * D
    if unit.kind == "llm_layer":
        attended = shape.attn_tokens_sq / T if T else 0.0
        per_tok, core = layer_act_bytes_per_token(
            lm.hidden_size, lm.num_attention_heads, lm.kv_groups, lm.ffn_hidden_size, lm.swiglu,
            attended, D, tp, dropout, attention, rotary=True, per_sample=attention == "flash",
            head_dim=lm.kv_channels)
        full = T * lm.hidden_size * D + T * lm.kv_channels * 4.0  # input, fp32 rotary table
        return T * per_tok, full, T * (per_tok - core), T * lm.hidden_size * D
    if unit.kind == "llm_head":
        # final-norm input and output-layer input, plus the fp32 softmax of the vocab-parallel loss
        act = 2 * T * lm.hidden_size * D + T * (lm.vocab_size / tp) * 4.0
        return act, T * lm.hidden_size * D, act, 0.0
    raise ValueError(f"unit {unit.name!r}: unknown kind {unit.kind!r}")


# ----------------------------------------------------------------------------------------------
# Cost tables
# ----------------------------------------------------------------------------------------------
def _seconds_per_work(device: DeviceSpec, efficiency: dict[str, float] | None) -> dict[str, float]:
    eff = dict(DEFAULT_EFFICIENCY)
    if efficiency:
        unknown = set(efficiency) - set(KIND_CODES)
        if unknown:
            raise ValueError(f"efficiency: unknown unit kinds {sorted(unknown)}; kinds: {', '.join(KIND_CODES)}")
        eff.update(efficiency)
    rates = {}
    for kind in KIND_CODES:
        if not eff[kind] > 0:
            raise ValueError(f"efficiency[{kind!r}] must be > 0, got {eff[kind]}")
        fwd = 1.0 / (device.matmul_flops_per_s * eff[kind])
        rates[f"fwd:{kind}"], rates[f"bwd:{kind}"] = fwd, device.bwd_over_fwd * fwd
    # the embedding has no FLOPs: its work is memory bytes
    rates["fwd:llm_embed"] = 1.0 / device.mem_bytes_per_s
    rates["bwd:llm_embed"] = 1.0 / device.mem_bytes_per_s
    return rates


def tp_allreduce_bytes(spec: ModelSpec, shape: MicroBatchShape, unit: Unit) -> tuple[float, float]:
    """(forward, backward) bytes one unit all-reduces across its TP group, per micro-batch.

    Megatron's tensor parallelism without sequence parallelism: a transformer layer all-reduces its
    attention output and its MLP output in the forward and the gradients of the inputs of its two
    column-parallel blocks in the backward (2 + 2 tensors of tokens x hidden); the projector's MLP
    one each way; the vocabulary-parallel embedding its output in the forward; the output layer the
    gradient of its input in the backward (its loss reductions are a few floats per token).
    """
    v, lm, D = spec.vision, spec.language, shape.dtype_bytes
    vit = shape.tiles * v.seq_per_tile * v.hidden_size * D
    llm = shape.llm_tokens * lm.hidden_size * D
    img = shape.tiles * spec.tokens_per_tile * lm.hidden_size * D
    return {"vit_embed": (0.0, 0.0), "vit_layer": (2 * vit, 2 * vit), "projector": (img, img),
            "llm_embed": (llm, 0.0), "llm_layer": (2 * llm, 2 * llm),
            "llm_head": (3 * shape.llm_tokens * 4.0, llm)}[unit.kind]


def tp_allreduce_s(nbytes: float, tp: int, device: DeviceSpec) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``tp`` ranks: ``2 (tp-1)/tp * nbytes / bus bandwidth``."""
    return 0.0 if tp == 1 else 2.0 * (tp - 1) / tp * nbytes / device.tp_bytes_per_s


def _costs_from_rates(spec, shape, tp, rates, dropout, attention, source, meta, comm_device=None) -> CostTable:
    """comm_device: add its TP all-reduce times (a profile's fitted rates already hold its own)."""
    if tp < 1:
        raise UserError(f"tensor-parallel size must be >= 1, got {tp}")
    units = build_units(spec)
    params = unit_param_counts(spec, tp)
    work = unit_work(spec, shape, tp)
    rows = []
    for u, w, n_param in zip(units, work, params):
        total, core = _unit_flops_core(spec, shape, u, tp)
        fwd, bwd = w * rates[f"fwd:{u.kind}"], w * rates[f"bwd:{u.kind}"]
        core_s = fwd * (core / total) if total > 0 else 0.0  # the core's share of the forward time
        if comm_device is not None and tp > 1:
            fwd_bytes, bwd_bytes = tp_allreduce_bytes(spec, shape, u)
            fwd += tp_allreduce_s(fwd_bytes, tp, comm_device)
            bwd += tp_allreduce_s(bwd_bytes, tp, comm_device)
        act, act_full, act_sel, send = _unit_bytes(spec, shape, u, tp, dropout, attention)
        rows.append(UnitCost(u.name, u.kind, fwd, bwd, float(act), float(act_full), float(act_sel),
                             float(core_s), float(send), n_param))
    meta = dict(meta)
    meta.update({"model": spec.name, "spec": spec.to_dict(), "shape": shape.to_dict(), "tp": tp,
                 "dropout": dropout, "attention": attention})
    return CostTable(tuple(rows), source, meta)


def analytic_costs(
    spec: ModelSpec,
    shape: MicroBatchShape,
    tp: int = 1,
    device: DeviceSpec = DEVICES["a100-80g"],
    efficiency: dict[str, float] | None = None,
    *,
    dropout: bool = False,
    attention: str = "unfused",
) -> CostTable:
    """Costs of every unit of ``spec`` for one micro-batch of ``shape`` on one TP rank of ``device``.

    efficiency: fraction of ``device.matmul_flops_per_s`` reached per unit kind (defaults:
    ``DEFAULT_EFFICIENCY``). dropout: count 1-byte dropout masks (InternVL fine-tuning uses none).
    attention: "unfused" (scores kept for backward) or "flash". With ``tp`` > 1 the units' times
    include their TP all-reduces (``tp_allreduce_bytes`` over ``device.tp_bytes_per_s``).
    """
    rates = _seconds_per_work(device, efficiency)
    return _costs_from_rates(spec, shape, tp, rates, dropout, attention, "analytic",
                             {"device": device.name, "efficiency": {**DEFAULT_EFFICIENCY, **(efficiency or {})}},
                             comm_device=device)


def calibrate(profile: CostTable, spec: ModelSpec, shape: MicroBatchShape, tp: int = 1) -> dict[str, float]:
    """Fit seconds per unit of work, per kind, from a measured ``profile`` of ``spec`` at ``shape``.

    Returns ``{"fwd:<kind>": s, "bwd:<kind>": s}``: seconds per forward FLOP (per TP rank) for
    kinds with FLOPs, and seconds per memory byte for the LLM embedding (see ``unit_work``); the
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
    work = np.asarray(unit_work(spec, shape, tp), dtype=float)
    fwd = np.asarray([u.fwd_s for u in profile.units], dtype=float)
    bwd = np.asarray([u.bwd_s for u in profile.units], dtype=float)
    kinds = np.asarray([u.kind for u in units])
    rates: dict[str, float] = {}
    for kind in KIND_CODES:
        sel = (kinds == kind) & (work > 0)
        if not sel.any():
            continue
        w2 = float(np.sum(work[sel] ** 2))
        for direction, t in (("fwd", fwd), ("bwd", bwd)):
            rate = float(np.sum(t[sel] * work[sel]) / w2)
            if rate > 0 and math.isfinite(rate):
                rates[f"{direction}:{kind}"] = rate
    return rates


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
) -> CostTable:
    """Analytic costs of ``spec`` at ``shape`` with times scaled by rates fitted on ``profile``.

    The profile's own model, shape and TP size come from ``profile.meta`` ("spec", "shape", "tp",
    as ``profile.write_profile`` records them) unless given. Kinds the profile lacks fall back to
    the analytic rates of ``device`` (default: the profile's meta "device" if it names a preset,
    else a100-80g). Bytes are analytic. A profile taken at TP 1 holds no all-reduce, so ``device``'s
    TP all-reduce times are added; a profile at TP > 1 holds its own in the fitted rates.
    """
    meta = profile.meta or {}
    if profile_spec is None:
        if "spec" not in meta:
            raise UserError("calibrated_costs: the profile's meta has no 'spec'; pass profile_spec")
        profile_spec = ModelSpec.from_dict(meta["spec"])
    if profile_shape is None:
        if "shape" not in meta:
            raise UserError("calibrated_costs: the profile's meta has no 'shape'; pass profile_shape")
        profile_shape = MicroBatchShape.from_dict(meta["shape"])
    profile_tp = int(profile_tp or meta.get("tp", 1))
    if device is None:
        device = DEVICES.get(str(meta.get("device", "")), DEVICES["a100-80g"])
    rates = _seconds_per_work(device, None)
    fitted = calibrate(profile, profile_spec, profile_shape, profile_tp)
    rates.update(fitted)
    # a TP-1 profile measured no all-reduce: add ``device``'s; a TP profile's rates already hold its own
    return _costs_from_rates(spec, shape, tp, rates, dropout, attention, "calibrated",
                             {"device": meta.get("device", device.name), "calibration": fitted,
                              "profile_model": profile_spec.name},
                             comm_device=device if profile_tp == 1 else None)


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
    spec, shape = ModelSpec.from_dict(meta["spec"]), MicroBatchShape.from_dict(meta["shape"])
    tp = int(meta.get("tp", 1))
    attention = attention or meta.get("attention", "unfused")
    analytic = analytic_costs(spec, shape, tp, device, attention=attention)
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
