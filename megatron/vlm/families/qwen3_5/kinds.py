"""Qwen3.5's unit kinds (tensor-free: the planner path imports them): the hybrid decoder's two layer kinds (Gated
DeltaNet and gated full attention), each with its MoE kind, and the head with a zero-centred final norm; each with
its cost (``costs``), run-time component (``components``), the micro-batch parts it reads and its Hugging Face
mapping (``hf``). Its ViT's and LLM embedding's kinds are the Qwen lineage's (``megatron.vlm.lineages.qwen.kinds``)."""
from __future__ import annotations

import dataclasses

from omnibal_ext.model.spec import TEXT_LAYER
from omnibal_ext.model.unit_kind import UnitKind

from .costs import (GatedAttentionLayerCost, GatedAttentionMoELayerCost, LinearAttentionLayerCost,
                    LinearAttentionMoELayerCost, Qwen35LanguageSpec, ZeroCentredHeadCost)
from megatron.vlm.stage.kinds import LLM_HEAD

LINEAR_LAYER = UnitKind(
    "qwen3_5_linear_layer", TEXT_LAYER, LinearAttentionLayerCost, reads={"packing"},
    runtime="megatron.vlm.families.qwen3_5.components:LinearAttentionLayers",
    hf="megatron.vlm.families.qwen3_5.hf:linear_layer_recipes")
ATTENTION_LAYER = UnitKind(
    "qwen3_5_attention_layer", TEXT_LAYER, GatedAttentionLayerCost, reads={"packing"},
    runtime="megatron.vlm.families.qwen3_5.components:GatedAttentionLayers",
    hf="megatron.vlm.families.qwen3_5.hf:attention_layer_recipes")
LINEAR_MOE_LAYER = UnitKind(
    "qwen3_5_linear_moe_layer", TEXT_LAYER, LinearAttentionMoELayerCost, reads={"packing"},
    runtime="megatron.vlm.families.qwen3_5.components:LinearAttentionMoELayers",
    hf="megatron.vlm.families.qwen3_5.hf:linear_moe_layer_recipes")
ATTENTION_MOE_LAYER = UnitKind(
    "qwen3_5_attention_moe_layer", TEXT_LAYER, GatedAttentionMoELayerCost, reads={"packing"},
    runtime="megatron.vlm.families.qwen3_5.components:GatedAttentionMoELayers",
    hf="megatron.vlm.families.qwen3_5.hf:attention_moe_layer_recipes")
ZERO_CENTRED_HEAD = dataclasses.replace(LLM_HEAD, cost=ZeroCentredHeadCost,
                                        runtime="megatron.vlm.families.qwen3_5.components:Qwen35Head")


def layer_kind(lm: Qwen35LanguageSpec, layer: int) -> UnitKind:
    """The kind of LLM layer ``layer``: its ``layer_types`` entry, with experts where ``lm.moe`` says."""
    if lm.is_moe_layer(layer):
        return LINEAR_MOE_LAYER if lm.is_linear(layer) else ATTENTION_MOE_LAYER
    return LINEAR_LAYER if lm.is_linear(layer) else ATTENTION_LAYER
