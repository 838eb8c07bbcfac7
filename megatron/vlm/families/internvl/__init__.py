"""InternVL (InternVL-Chat, 1.5, 2.5, 3, 3.5 and its MoE): InternViT over fixed-size tiles, the pixel-shuffle MLP
projector and a GPT decoder; the whole family in this folder.

Tensor-free (imported by the planners without torch): ``costs`` (ViT spec, cost components, unit list), ``presets``
and this module, which registers the ``Family``. Run time (imported through ``Family.runtime`` only): ``runtime``
(the ``FamilyRuntime``), ``modules`` and ``layers`` (InternViT, the projector), ``components`` (one per unit kind),
``hf`` (config reader, tensor names) and ``video`` (the frames-as-tiles video rule).
"""
from __future__ import annotations

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS

from .costs import NAME, ProjectorCost, VisionEmbedCost, VisionLayerCost, VisionSpec, spec_problem, unit_list
from .presets import PRESETS

INTERNVL = register(Family(
    name=NAME, default_preset="tiny", vision_spec=VisionSpec,
    components=(VisionEmbedCost, VisionLayerCost, ProjectorCost, TextEmbedCost, TextLayerCost, HeadCost),
    unit_list=unit_list, vision_item="tile", presets=PRESETS, spec_problem=spec_problem,
    runtime=f"{__name__}.runtime:RUNTIME",
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, moe=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--max-num-tiles", "--min-num-tiles"))))
