"""The unit kinds the Qwen families share (tensor-free: the planner path imports them), each with its cost, run-time
component, the micro-batch parts it reads and its Hugging Face mapping:

* the Qwen3-VL ViT's (costs: ``vision_costs``; components: ``qwen3_vit.components``; HF: ``qwen3_vit.hf``): the patch
  embedding, the layers, the layers at DeepStack indexes (each with its DeepStack merger) and the 2x2 patch merger;
* the Qwen LLM's embedding and layers at run time (``text``: the merged vision tokens written into the image-token
  slots, multimodal RoPE): the GPT decoder's kinds (``megatron.vlm.stage.kinds``: name, cost, HF mapping) with these
  run-time components.
"""
from __future__ import annotations

import dataclasses

from omnibal_ext.model.spec import PROJECTOR, VISION_EMBED, VISION_LAYER
from omnibal_ext.model.unit_kind import UnitKind

from .vision_costs import DeepStackLayerCost, MergerCost, VisionEmbedCost, VisionLayerCost
from megatron.vlm.stage.kinds import LLM_EMBED, LLM_LAYER

QWEN3_VIT_EMBED = UnitKind(
    "qwen3_vit_embed", VISION_EMBED, VisionEmbedCost, reads={"pixels"},
    runtime="megatron.vlm.lineages.qwen.qwen3_vit.components:VisionEmbed",
    hf="megatron.vlm.lineages.qwen.qwen3_vit.hf:vision_embed_recipes")
QWEN3_VIT_LAYER = UnitKind(
    "qwen3_vit_layer", VISION_LAYER, VisionLayerCost, reads={"pixels"},
    runtime="megatron.vlm.lineages.qwen.qwen3_vit.components:VisionLayers",
    hf="megatron.vlm.lineages.qwen.qwen3_vit.hf:vision_layer_recipes")
QWEN3_DEEPSTACK_LAYER = UnitKind(
    "qwen3_vit_deepstack_layer", VISION_LAYER, DeepStackLayerCost, reads={"pixels"},
    runtime="megatron.vlm.lineages.qwen.qwen3_vit.components:DeepStackLayers",
    hf="megatron.vlm.lineages.qwen.qwen3_vit.hf:deepstack_layer_recipes")
QWEN3_MERGER = UnitKind(
    "qwen3_merger", PROJECTOR, MergerCost, reads={"pixels"},
    runtime="megatron.vlm.lineages.qwen.qwen3_vit.components:Merger",
    hf="megatron.vlm.lineages.qwen.qwen3_vit.hf:merger_recipes")

IMAGE_TEXT_EMBED = dataclasses.replace(LLM_EMBED, runtime="megatron.vlm.lineages.qwen.text:ImageTextEmbed")
MROPE_TEXT_LAYER = dataclasses.replace(LLM_LAYER, runtime="megatron.vlm.lineages.qwen.text:MRopeTextLayer")
