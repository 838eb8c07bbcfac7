"""InternVL's unit kinds (tensor-free: the planner path imports them): InternViT's patch embedding and layers and the
pixel-shuffle MLP projector, each with its cost (``costs``), run-time component (``components``), the micro-batch
parts it reads and its Hugging Face mapping (``hf``); its LLM's kinds are the GPT decoder's
(``megatron.vlm.stage.kinds``)."""
from __future__ import annotations

from omnibal_ext.model.spec import PROJECTOR, VISION_EMBED, VISION_LAYER
from omnibal_ext.model.unit_kind import UnitKind

from .costs import ProjectorCost, VisionEmbedCost, VisionLayerCost

VIT_EMBED = UnitKind(
    "vit_embed", VISION_EMBED, VisionEmbedCost, reads={"pixels"},
    runtime="megatron.vlm.families.internvl.components:VisionEmbed",
    hf="megatron.vlm.families.internvl.hf:vision_embed_recipes")
VIT_LAYER = UnitKind(
    "vit_layer", VISION_LAYER, VisionLayerCost,
    runtime="megatron.vlm.families.internvl.components:VisionLayer",
    hf="megatron.vlm.families.internvl.hf:vision_layer_recipes")
MLP_PROJECTOR = UnitKind(
    "projector", PROJECTOR, ProjectorCost,
    runtime="megatron.vlm.families.internvl.components:ProjectorUnit",
    hf="megatron.vlm.families.internvl.hf:projector_recipes")
