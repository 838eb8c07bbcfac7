"""Qwen2.5-VL at run time: the ``RuntimeFamily`` (registered when ``megatron.vlm.families`` discovers it).

Planning side: ``omnibal_ext.model.families.qwen2_5_vl``. Modules: ``modules``; components: ``components``; HF
config, names and tensor recipes: ``hf``; micro-batches of the logits check: ``batch``; training data: ``data``.
"""
from __future__ import annotations

from megatron.vlm.components import Head, RuntimeFamily
from megatron.vlm.families import register
from megatron.vlm.hf.config import HFConfigReader

from . import batch, hf
from .data import QWEN_DATA
from .components import FullLayer, ImageTextEmbed, Merger, MRopeTextLayer, VisionEmbed, WindowLayer
from .modules import vision_config

QWEN2_5_VL = register(RuntimeFamily(
    name="qwen2_5_vl", components=(VisionEmbed, WindowLayer, FullLayer, Merger, ImageTextEmbed, MRopeTextLayer, Head),
    vision_config=vision_config, hf_names=hf.Names,
    hf_config=HFConfigReader(hf.recognizes, hf.spec_from_config, hf.native_config),
    logits_batch=batch.logits_batch, structure_twin=hf.structure_twin, data=QWEN_DATA))
