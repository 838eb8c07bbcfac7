"""Qwen2.5-VL's unit kinds (tensor-free: the planner path imports them): its ViT's patch embedding, window- and
full-attention layers and the 2x2 patch merger, each with its cost (``costs``), run-time component (``components``),
the micro-batch parts it reads and its Hugging Face mapping (``hf``). Its LLM's are the Qwen lineage's
(``megatron.vlm.lineages.qwen.kinds``: the image-text embedding, the multimodal-RoPE layer) and the GPT decoder's
(``megatron.vlm.stage.kinds``: MoE layers, the head)."""
from __future__ import annotations

from omnibal_ext.model.spec import PROJECTOR, VISION_EMBED, VISION_LAYER
from omnibal_ext.model.unit_kind import UnitKind

from .costs import FullLayerCost, MergerCost, VisionEmbedCost, WindowLayerCost

PATCH_EMBED = UnitKind(
    "qwen_vit_embed", VISION_EMBED, VisionEmbedCost, reads={"pixels"},
    runtime="megatron.vlm.families.qwen2_5_vl.components:VisionEmbed",
    hf="megatron.vlm.families.qwen2_5_vl.hf:vision_embed_recipes")
WINDOW_LAYER = UnitKind(
    "qwen_vit_window_layer", VISION_LAYER, WindowLayerCost, reads={"pixels"},
    runtime="megatron.vlm.families.qwen2_5_vl.components:WindowLayer",
    hf="megatron.vlm.families.qwen2_5_vl.hf:vision_layer_recipes")
FULL_LAYER = UnitKind(
    "qwen_vit_full_layer", VISION_LAYER, FullLayerCost, reads={"pixels"},
    runtime="megatron.vlm.families.qwen2_5_vl.components:FullLayer",
    hf="megatron.vlm.families.qwen2_5_vl.hf:vision_layer_recipes")
MERGER = UnitKind(
    "qwen_merger", PROJECTOR, MergerCost, reads={"pixels"},
    runtime="megatron.vlm.families.qwen2_5_vl.components:Merger",
    hf="megatron.vlm.families.qwen2_5_vl.hf:merger_recipes")
