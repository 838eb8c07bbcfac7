"""Qwen3.5's run-time components (its unit kinds, ``kinds``, name them): the two LLM layer kinds (Gated DeltaNet and
gated full attention, with interleaved multimodal RoPE over the rotated ``partial_rotary_factor`` of each head) and
the head with a zero-centred final norm; its ViT's and LLM embedding's are the Qwen lineage's.

Both LLM layer kinds are role ``t``: consecutive units of one kind on a stage form TransformerBlock segments, and
all of them sit in the stage's ``llm_blocks`` in unit order (the stage runs a run of one kind, then the next). They
share one sequence-parallel region (the stage's LLM layers, whatever their kinds) and one micro-batch context
(the ``StageCache``'s ``TextContext``: the packed parameters and the rotary angles, which the Gated DeltaNet ignores but for
its segments).

Qwen3.5-MoE: each kind has its MoE kind (``LinearAttentionMoELayers``, ``GatedAttentionMoELayers``), the same layer
with megatron-core's MoELayer as its MLP (router, seeded experts, the shared expert behind its sigmoid gate) and the
router's token mask in the blocks' context.

Refused when built: context parallelism (the linear layers' recurrent state would pass between CP ranks),
TransformerEngine layers and the dense-mask backend (the norms and the Gated DeltaNet are local modules over THD
rows).
"""
from __future__ import annotations

import functools

import torch

from omnibal_ext.errors import UserError
from omnibal_ext.model.spec import HEAD

from .modules import ZeroCentredRMSNorm, attention_layer_spec, language_layer_config, linear_layer_spec
from megatron.vlm.layers.rope import MultimodalRope
from megatron.vlm.lineages.qwen.text import MRopeTextLayer
from megatron.vlm.stage.components import Head, MoEMLPs


class _Qwen35TextLayers(MRopeTextLayer):
    """What both LLM layer kinds share: their config, the refusals, the partial multimodal RoPE."""

    def _check(self) -> None:
        ctx = self.ctx
        if ctx.language_config.context_parallel_size > 1:
            raise UserError("Qwen3.5: context parallelism (--context-parallel-size > 1) is not implemented: the "
                            "Gated DeltaNet layers' recurrent state would have to pass between CP ranks")
        if ctx.impl.transformer_engine:
            raise UserError("Qwen3.5: --transformer-impl transformer_engine is not implemented (its zero-centred "
                            "norms and Gated DeltaNet layers are local modules); use --transformer-impl local")
        if not ctx.impl.thd:
            raise UserError("Qwen3.5: --attention-backend unfused is not implemented (the Gated DeltaNet runs on "
                            "packed THD rows); use --attention-backend auto")

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.language_config, (HEAD,))

    def build(self):
        self._check()
        config = language_layer_config(self.ctx.language_config, self.spec.language)
        return self.ctx.build_layers(self.units, config, self.layer_spec, self.code())

    @functools.cached_property
    def rotary(self) -> torch.nn.Module:
        lang = self.spec.language
        return MultimodalRope(lang.rotary_dim, lang.rotary_base, lang.mrope_section, lang.mrope_interleaved)


class LinearAttentionLayers(_Qwen35TextLayers):
    """Gated DeltaNet layers (``linear_attention``): each packed sample from a zero state."""

    def layer_spec(self, first_unit_index: int):
        ctx = self.ctx
        return linear_layer_spec(ctx.seed, first_unit_index, ctx.impl,
                                 self.spec.language.linear_chunk_size)


class GatedAttentionLayers(_Qwen35TextLayers):
    """Gated full-attention layers (``full_attention``)."""

    def layer_spec(self, first_unit_index: int):
        ctx = self.ctx
        return attention_layer_spec(ctx.seed, first_unit_index, ctx.impl)


class _MoELayers(MoEMLPs):
    """What both MoE layer kinds add to their dense kind: megatron-core's MoELayer as the MLP, its router numbered and
    masked (``MoEMLPs``; the shared expert and its sigmoid gate as the config's ``moe_shared_expert_*`` say)."""

    def layer_spec(self, first_unit_index: int):
        return self.with_moe(super().layer_spec(first_unit_index), first_unit_index)


class LinearAttentionMoELayers(_MoELayers, LinearAttentionLayers):
    """Gated DeltaNet layers with MoE MLPs (Qwen3.5-MoE's ``linear_attention`` layers)."""


class GatedAttentionMoELayers(_MoELayers, GatedAttentionLayers):
    """Gated full-attention layers with MoE MLPs (Qwen3.5-MoE's ``full_attention`` layers)."""


class Qwen35Head(Head):
    """The head with the zero-centred final norm."""

    def norm_builder(self):
        return ZeroCentredRMSNorm
