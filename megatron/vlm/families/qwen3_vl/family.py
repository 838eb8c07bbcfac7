"""Qwen3-VL (dense and MoE) at run time: the ``RuntimeFamily`` (registered when ``megatron.vlm.families`` discovers it).

Planning side: ``omnibal_ext.model.families.qwen3_vl``. Modules: ``modules``; components: ``components``; HF
config, names and tensor recipes: ``hf``; micro-batches of the logits check: ``batch``; training data: ``data``.
"""
from __future__ import annotations

from omnibal_ext.model.families.qwen3_vl import QWEN3_VL as PLANNING

from megatron.vlm.components import Head, RuntimeFamily
from megatron.vlm.families import register
from megatron.vlm.hf.config import HFSide

from . import batch, hf
from .components import (DeepStackLayers, DeepStackMoETextLayer, DeepStackTextLayer, ImageTextEmbed, Merger,
                         VisionEmbed, VisionLayers)
from .data import QWEN3_VL_DATA
from .modules import vision_config

QWEN3_VL = register(RuntimeFamily(
    planning=PLANNING,
    components=(VisionEmbed, VisionLayers, DeepStackLayers, Merger, ImageTextEmbed, DeepStackTextLayer,
                DeepStackMoETextLayer, Head),
    vision_config=vision_config,
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names, logits_batch=batch.logits_batch,
              structure_twin=hf.structure_twin, checkpoint_info=hf.checkpoint_info),
    data=QWEN3_VL_DATA))
