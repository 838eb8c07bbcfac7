"""InternVL at run time: the ``RuntimeFamily`` (registered when ``megatron.vlm.families`` discovers it)."""
from __future__ import annotations

import dataclasses

from omnibal_ext.model.families.internvl import INTERNVL as PLANNING

from megatron.vlm.components import GPT_DECODER, MoETextLayer, RuntimeFamily
from megatron.vlm.config import vision_config
from megatron.vlm.data.side import TILED
from megatron.vlm.families import register
from megatron.vlm.hf.config import HFSide

from . import hf
from .components import ProjectorUnit, VisionEmbed, VisionLayer
from .video import video_rule

INTERNVL = register(RuntimeFamily(
    planning=PLANNING, components=(VisionEmbed, VisionLayer, ProjectorUnit, *GPT_DECODER, MoETextLayer),
    vision_config=vision_config, data=dataclasses.replace(TILED, video_rule=video_rule),
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names, logits_batch=hf.logits_batch,
              structure_twin=hf.structure_twin, skipped_names=hf.skipped_names)))
