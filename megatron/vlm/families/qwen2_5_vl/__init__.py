"""Qwen2.5-VL: its ViT (window attention with full-attention layers, 2-D rotary positions), the 2x2 patch merger and
a Qwen2 decoder with multimodal RoPE; the whole family in this folder, on the Qwen lineage library
(``megatron.vlm.lineages.qwen``: patch images, multimodal RoPE ids, vision windows, video, the batcher).

Tensor-free (imported by the planners without torch): ``costs`` (ViT spec, cost components, unit list), ``presets``
and this module, which registers the ``Family``. Run time (imported through ``Family.runtime`` only): ``runtime``
(the ``FamilyRuntime``), ``modules``, ``components``, ``hf`` and ``data``.
"""
from __future__ import annotations

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS

from .costs import FullLayerCost, MergerCost, VisionEmbedCost, VisionSpec, WindowLayerCost, image_segments_sq, unit_list
from .presets import PRESETS

QWEN2_5_VL = register(Family(
    name="qwen2_5_vl", vision_spec=VisionSpec,
    components=(VisionEmbedCost, WindowLayerCost, FullLayerCost, MergerCost, TextEmbedCost, TextLayerCost, HeadCost),
    unit_list=unit_list, vision_item="patch", presets=PRESETS, segments_sq=image_segments_sq,
    runtime=f"{__name__}.runtime:RUNTIME",
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--min-pixels", "--max-pixels"))))
