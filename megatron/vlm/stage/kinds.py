"""The GPT decoder's unit kinds, shared by every family (every family's LLM is one): the text embedding, the layer,
the layer with MoE MLPs and the head.

Tensor-free declarations (``omnibal_ext.model.unit_kind.UnitKind``; the planner path imports them): their costs are
``omnibal_ext.model.components``' and ``moe_cost``'s, their run-time components this floor's ``components``
(``TextEmbed``, ``TextLayer``, ``MoETextLayer``, ``Head``), their Hugging Face mappings ``megatron.vlm.hf.recipes``'
(on the HF names every family's ``Names`` gives). A family whose LLM runs otherwise (multimodal RoPE, DeepStack
additions, a zero-centred head) declares its kind as one of these with its own run-time component
(``dataclasses.replace(LLM_LAYER, runtime=...)``), keeping the kind's name, cost and mapping.
"""
from __future__ import annotations

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.moe_cost import MoELayerCost
from omnibal_ext.model.spec import HEAD, TEXT_EMBED, TEXT_LAYER
from omnibal_ext.model.unit_kind import UnitKind

LLM_EMBED = UnitKind(
    "llm_embed", TEXT_EMBED, TextEmbedCost, runtime="megatron.vlm.stage.components:TextEmbed", reads={"tokens"},
    hf="megatron.vlm.hf.recipes:text_embed_recipes")
LLM_LAYER = UnitKind(
    "llm_layer", TEXT_LAYER, TextLayerCost, runtime="megatron.vlm.stage.components:TextLayer", reads={"packing"},
    hf="megatron.vlm.hf.recipes:text_layer_recipes")
LLM_MOE_LAYER = UnitKind(
    "llm_moe_layer", TEXT_LAYER, MoELayerCost, runtime="megatron.vlm.stage.components:MoETextLayer",
    reads={"packing"}, hf="megatron.vlm.hf.recipes:moe_text_layer_recipes")
LLM_HEAD = UnitKind(
    "llm_head", HEAD, HeadCost, runtime="megatron.vlm.stage.components:Head", reads={"labels", "packing"},
    hf="megatron.vlm.hf.recipes:head_recipes")
