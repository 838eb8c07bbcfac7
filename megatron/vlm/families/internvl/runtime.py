"""InternVL at run time: its ``FamilyRuntime`` (``Family.runtime`` names it): InternViT's components, the projector's,
the shared GPT decoder's (dense and MoE), the tiled data side with the frames-as-tiles video rule, and the Hugging
Face side."""
from __future__ import annotations

import dataclasses

from . import hf
from .components import ProjectorUnit, VisionEmbed, VisionLayer
from .video import video_rule
from megatron.vlm.hf.config import HFSide
from megatron.vlm.layers.config import vision_config
from megatron.vlm.stage.components import GPT_DECODER, FamilyRuntime, MoETextLayer
from megatron.vlm.stage.data_side import TILED

RUNTIME = FamilyRuntime(
    components=(VisionEmbed, VisionLayer, ProjectorUnit, *GPT_DECODER, MoETextLayer),
    vision_config=vision_config, data=dataclasses.replace(TILED, video_rule=video_rule),
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names, logits_batch=hf.logits_batch,
              structure_twin=hf.structure_twin, skipped_names=hf.skipped_names))
