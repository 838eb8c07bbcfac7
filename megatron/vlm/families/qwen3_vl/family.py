"""Qwen3-VL (dense) at run time: the ``RuntimeFamily`` (registered in ``megatron.vlm.families``).

Planning side: ``omnibal_ext.model.families.qwen3_vl``. Modules: ``modules``; components: ``components``; HF
config, names and tensor recipes: ``hf``; micro-batches of the logits check: ``batch``.
"""
from __future__ import annotations

from megatron.vlm.components import Head, RuntimeFamily
from megatron.vlm.hf.config import HFConfigReader

from . import batch, hf
from .components import DeepStackLayers, DeepStackTextLayer, ImageTextEmbed, Merger, VisionEmbed, VisionLayers
from .modules import vision_config

QWEN3_VL = RuntimeFamily(
    name="qwen3_vl",
    components=(VisionEmbed, VisionLayers, DeepStackLayers, Merger, ImageTextEmbed, DeepStackTextLayer, Head),
    vision_config=vision_config, hf_names=hf.Names,
    hf_config=HFConfigReader(hf.recognizes, hf.spec_from_config, hf.native_config),
    logits_batch=batch.logits_batch, structure_twin=hf.structure_twin)
