"""Qwen3.5 (dense and MoE) at run time: the ``RuntimeFamily`` (registered when ``megatron.vlm.families`` discovers it).

Planning side: ``omnibal_ext.model.families.qwen3_5``. LLM modules: ``modules``; components: ``components``; HF
config, names and tensor recipes: ``hf``. The ViT's config, the logits-check micro-batches and the training data
are Qwen3-VL's (``qwen3_vl.modules.vision_config``, ``qwen3_vl.batch``, ``qwen3_vl.data.QWEN3_VL_DATA``): the same
ViT, image and video processors and multimodal RoPE ids (videos too), with no DeepStack features to carry.
"""
from __future__ import annotations

from omnibal_ext.model.families.qwen3_5 import QWEN3_5 as PLANNING

from megatron.vlm.components import RuntimeFamily
from megatron.vlm.families import register
from megatron.vlm.families.qwen3_vl import batch
from megatron.vlm.families.qwen3_vl.data import QWEN3_VL_DATA
from megatron.vlm.families.qwen3_vl.modules import vision_config
from megatron.vlm.hf.config import HFSide

from . import hf
from .components import (GatedAttentionLayers, GatedAttentionMoELayers, ImageTextEmbed, LinearAttentionLayers,
                         LinearAttentionMoELayers, Merger, Qwen35Head, VisionEmbed, VisionLayers)

QWEN3_5 = register(RuntimeFamily(
    planning=PLANNING,
    components=(VisionEmbed, VisionLayers, Merger, ImageTextEmbed, LinearAttentionLayers, GatedAttentionLayers,
                LinearAttentionMoELayers, GatedAttentionMoELayers, Qwen35Head),
    vision_config=vision_config,
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names,
              logits_batch=batch.logits_batch, structure_twin=hf.structure_twin,
              checkpoint_info=hf.checkpoint_info),
    data=QWEN3_VL_DATA))
