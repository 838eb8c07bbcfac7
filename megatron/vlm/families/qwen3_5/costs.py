"""Qwen3.5 (dense and MoE), its costs (tensor-free, no torch): Qwen3-VL's ViT without DeepStack (its embedding,
layers and merger costs) and a hybrid LLM whose layers are of two kinds, in the order ``layer_types`` gives:

* ``linear_attention``: a Gated DeltaNet layer (``omnibal_ext.model.linear_attention``: in_proj, causal conv,
  chunked gated delta rule, gated RMSNorm, out_proj) and the SwiGLU MLP -- its time is linear in tokens;
* ``full_attention``: gated attention (``q_proj`` rows [q | gate] per head, ``sigmoid(gate)`` times the attention
  output, q/k norms, partial rotary) and the SwiGLU MLP -- its attention core is quadratic per sample.

Both are role ``t`` (LLM layers); the partition search, the recompute planner and the simulator see them as two
unit kinds of one role through their components, as Qwen2.5-VL's window and full-attention ViT layers in ``v``.
Every RMSNorm of the LLM is zero-centred (``1 + w``; the gated norm's weight is plain).

Cost of a linear layer over a micro-batch of ``T`` tokens in samples of ``sum(L^2)``: the closed form of
``linear_attention`` on ``n = round(T^2 / sum(L^2))`` equal segments (the shape says the squares, not the lengths;
exact for samples of one length) plus the MLP ``6 T h f``. Selective recompute has nothing to recompute in it
(megatron-core's selective recompute is the softmax attention core's), so its ``selective`` bytes are its ``act``.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnibal_ext.errors import UserError
from omnibal_ext.model.components import (FUSED_KERNELS, ActBytes, HeadCost, TextLayerCost,
                                          llm_layer_flops, norm_bytes_per_token, rotary_table_bytes, sp_tokens)
from omnibal_ext.model.linear_attention import LinearAttentionShape, linear_attention_act_bytes, linear_attention_flops
from omnibal_ext.model.moe import MoESpec
from omnibal_ext.model.moe_cost import MoELayerCost
from omnibal_ext.model.spec import LanguageSpec

from megatron.vlm.lineages.qwen.vision_costs import VisionSpec

LINEAR, FULL = "linear_attention", "full_attention"  # HF layer_types values


def every_fourth_full(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """transformers' default ``layer_types``: layer ``i`` is full attention when ``(i + 1) % interval == 0``."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


@dataclass(frozen=True)
class Qwen35LanguageSpec(LanguageSpec):
    """The Qwen3.5 decoder: a LanguageSpec (Qwen3's q/k norms, interleaved mrope, no qkv bias) plus its layer
    kinds (``layer_types``: one of ``LINEAR`` / ``FULL`` per layer; empty: every fourth full), partial rotary
    (``partial_rotary_factor`` of ``head_dim`` rotated), the Gated DeltaNet heads (HF ``linear_*``) and the torch
    delta rule's chunk (tokens)."""

    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_num_value_heads: int = 32
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64

    def __post_init__(self):
        types = tuple(self.layer_types) or every_fourth_full(self.num_layers)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers:
            raise UserError(f"layer_types has {len(types)} entries, the LLM {self.num_layers} layers")
        bad = sorted({t for t in types if t not in (LINEAR, FULL)})
        if bad:
            raise UserError(f"layer_types: {bad} unknown (each is {LINEAR!r} or {FULL!r})")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise UserError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even number of "
                            f"rotated channels in (0, head_dim {self.kv_channels}]")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise UserError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                            f"linear_num_key_heads ({self.linear_num_key_heads})")
        super().__post_init__()

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.partial_rotary_factor)

    @property
    def linear_shape(self) -> LinearAttentionShape:
        return LinearAttentionShape(self.hidden_size, self.linear_num_key_heads, self.linear_key_head_dim,
                                    self.linear_num_value_heads, self.linear_value_head_dim,
                                    self.linear_conv_kernel_dim)

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR


def _segments(tokens: int, attn_sq: float) -> list[int]:
    """``tokens`` cut into ``round(tokens^2 / attn_sq)`` segments as equal as integers allow (the packed
    samples the shape's ``sum(L^2)`` stands for)."""
    if tokens <= 0:
        return []
    n = max(1, min(tokens, round(tokens * tokens / attn_sq))) if attn_sq > 0 else 1
    base, extra = divmod(tokens, n)
    return [base + 1] * extra + [base] * (n - extra)


def _mlp_norm_bytes(lm: LanguageSpec, T: int, D: int, tp: int, sequence_parallel: bool, kernels) -> float:
    """What a layer keeps besides its token mixer: the two norms' inputs and statistics and the MLP's input
    (replicated; split under sequence parallelism), the SwiGLU MLP's ``5 f`` (split)."""
    h, f = lm.hidden_size, lm.ffn_hidden_size
    replicated = T * (3 * h * D + 2 * norm_bytes_per_token(h, D, "RMSNorm", kernels))
    if sequence_parallel:
        replicated /= tp
    return replicated + T * 5 * f * D / tp


class LinearAttentionLayerCost(TextLayerCost):
    """A Gated DeltaNet layer with its SwiGLU MLP (module docstring); TP all-reduces as any decoder layer's."""

    efficiency = 0.4

    def _lengths(self, shape, tokens: int) -> list[int]:
        return _segments(tokens, shape.rank_attn_tokens_sq)

    def flops(self, shape, tp):
        lm = self.spec.language
        t = shape.rank_llm_tokens
        lengths = self._lengths(shape, t)
        mixer = linear_attention_flops(lm.linear_shape, lengths, lm.linear_chunk_size).total if lengths else 0.0
        return mixer + 6.0 * t * lm.hidden_size * lm.ffn_hidden_size, 0.0

    def params(self, tp):
        lm = self.spec.language
        s, h, f = lm.linear_shape, lm.hidden_size, lm.ffn_hidden_size
        mixer = h * s.in_proj_dim + s.conv_dim * s.conv_kernel + 2 * s.value_heads + s.value_head_dim \
            + s.value_heads * s.value_head_dim * h
        return mixer + 3 * h * f + 2 * h

    def linears(self, tp):
        return {}  # no LoRA on these layers (not declared)

    def decode_cache(self, batch, context, tp, dtype_bytes):
        """A decode step reads, updates and writes each sequence's recurrent state (fp32, ``value heads * k_dim *
        v_dim``: about 6 FLOPs per element) and its convolution window (``kernel - 1`` inputs); no context."""
        s = self.spec.language.linear_shape
        state = s.value_heads * s.key_head_dim * s.value_head_dim
        return 6.0 * state * batch, batch * (2 * 4.0 * state + (s.conv_kernel - 1) * s.conv_dim * dtype_bytes) / tp

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        lm, D = self.spec.language, shape.dtype_bytes
        T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)
        split = tp if sequence_parallel else 1
        send = T * lm.hidden_size * D / split
        if T == 0:
            return ActBytes(0.0, 0.0, 0.0, 0.0)
        lengths = self._lengths(shape, shape.rank_llm_tokens)
        if T > shape.rank_llm_tokens:
            lengths.append(T - shape.rank_llm_tokens)  # the sequence-parallel pad: a segment of its own
        mixer = linear_attention_act_bytes(lm.linear_shape, lengths, tp, sequence_parallel and tp > 1, D).total
        act = mixer + _mlp_norm_bytes(lm, T, D, tp, sequence_parallel and tp > 1, kernels)
        act += 2 * zero_centred_bytes(lm, D)  # the two zero-centred layer norms' 1 + w
        # full recompute keeps the input and the rotary angles every LLM layer is given (the linear layer ignores them)
        return ActBytes(act, send + rotary_table_bytes(lm, shape, T), act, send)


class GatedAttentionLayerCost(TextLayerCost):
    """A gated full-attention layer: the decoder layer's cost with ``q_proj``'s gate rows (``heads * head_dim``
    more outputs of the fused QKV), the sigmoid gate on the attention output and partial rotary (its tables
    ``rotary_dim`` wide)."""

    def _width(self) -> int:
        lm = self.spec.language
        return lm.num_attention_heads * lm.kv_channels

    def flops(self, shape, tp):
        total, core = llm_layer_flops(self.spec, shape)
        t, h = shape.rank_llm_tokens, self.spec.language.hidden_size
        return total + 2.0 * t * h * self._width() + 4.0 * t * self._width(), core

    def params(self, tp):
        return super().params(tp) + self.spec.language.hidden_size * self._width()

    def linears(self, tp):
        return {}  # no LoRA on these layers (not declared)

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        """The decoder layer's bytes (q/k norms, partial rotary) plus, per token and TP rank, the gate's rows of the
        fused QKV output, its contiguous copy and the ungated attention output (``heads * head_dim`` each; the
        gated product is the out-projection input the decoder layer counts), and the ``1 + w`` of its two layer
        norms and of the q and k norms."""
        lm, D = self.spec.language, shape.dtype_bytes
        base = super().act_bytes(shape, tp, dropout, attention, sequence_parallel, kernels)
        T = sp_tokens(shape.rank_llm_tokens, tp, sequence_parallel)
        gate = T * self._width() * 3 * D / tp + 2 * zero_centred_bytes(lm, D) + 2 * lm.kv_channels * D
        return ActBytes(base.act + gate, base.full, base.selective + gate, base.send)


def zero_centred_bytes(lm: LanguageSpec, dtype_bytes: int) -> float:
    """What a zero-centred norm over the hidden states keeps beside a plain one: its ``1 + w`` (``hidden`` values,
    per layer, not per token)."""
    return lm.hidden_size * dtype_bytes


class ZeroCentredHeadCost(HeadCost):
    """The head, its final norm zero-centred (``zero_centred_bytes`` more)."""

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        b = super().act_bytes(shape, tp, dropout, attention, sequence_parallel, kernels)
        extra = zero_centred_bytes(self.spec.language, shape.dtype_bytes)
        return ActBytes(b.act + extra, b.full, b.selective + extra, b.send)


def qwen3_5_language(**kw) -> Qwen35LanguageSpec:
    """A Qwen3.5 decoder: Qwen3's q/k norms, interleaved mrope, no qkv bias, plus the given layer kinds."""
    return Qwen35LanguageSpec(qk_norm=True, mrope_interleaved=True, qkv_bias=False, **kw)


def vision(**kw) -> VisionSpec:
    """Qwen3-VL's ViT without DeepStack."""
    return VisionSpec(deepstack_visual_indexes=(), **kw)


# --------------------------------------------------------------------------------------------
# Qwen3.5-MoE (transformers' qwen3_5_moe): the same hybrid decoder with every layer's MLP a mixture of experts
# (megatron-core's MoELayer, ``moe_cost``): top-k softmax routing renormalised over the k, a shared expert behind a
# sigmoid gate. Each layer kind has its MoE unit kind: its token mixer's cost and ``MoELayerCost``'s MLP part.
# --------------------------------------------------------------------------------------------
class LinearAttentionMoELayerCost(MoELayerCost, LinearAttentionLayerCost):
    """A Gated DeltaNet layer whose MLP is a mixture of experts: ``LinearAttentionLayerCost`` with its SwiGLU MLP
    replaced by ``MoELayerCost``'s router, experts and shared expert (and their EP all-to-alls)."""


class GatedAttentionMoELayerCost(MoELayerCost, GatedAttentionLayerCost):
    """A gated full-attention layer whose MLP is a mixture of experts (as ``LinearAttentionMoELayerCost``)."""


def qwen3_5_moe_experts(num_layers: int, num_experts: int, topk: int, expert_ffn: int, shared_ffn: int) -> MoESpec:
    """Qwen3.5-MoE's experts: every layer MoE, softmax scores renormalised over the top k (its router always
    does), one shared expert of ``shared_ffn`` behind a sigmoid gate."""
    return MoESpec(num_experts=num_experts, topk=topk, ffn_hidden_size=expert_ffn, layer_freq=(1,) * num_layers,
                   shared_expert_ffn_hidden_size=shared_ffn, shared_expert_gate=True, norm_topk_prob=True)
