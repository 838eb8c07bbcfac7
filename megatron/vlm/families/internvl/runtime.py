"""InternVL at run time: its ``FamilyRuntime`` (``Family.runtime`` names it): InternViT's config, the tiled data side
with the frames-as-tiles video rule, and the Hugging Face side (its unit kinds name their components themselves:
``kinds``)."""
from __future__ import annotations

import dataclasses

from . import hf
from .video import video_rule
from megatron.vlm.hf.config import HFSide
from megatron.vlm.layers.config import vision_config
from megatron.vlm.stage.components import FamilyRuntime
from megatron.vlm.stage.data_side import TILED

RUNTIME = FamilyRuntime(
    vision_config=vision_config, data=dataclasses.replace(TILED, video_rule=video_rule),
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names, logits_batch=hf.logits_batch,
              structure_twin=hf.structure_twin, skipped_names=hf.skipped_names))
