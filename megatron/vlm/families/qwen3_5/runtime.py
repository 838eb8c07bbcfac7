"""Qwen3.5 (dense and MoE) at run time: its ``FamilyRuntime`` (``Family.runtime`` names it): the HF side (config
reader and names: ``hf``); the ViT's config, the logits-check micro-batches and the training data are the Qwen
lineage's Qwen3-VL ViT (``megatron.vlm.lineages.qwen.qwen3_vit``): the same ViT, image and video processors and
multimodal RoPE ids (videos too), with no DeepStack features to carry. Its unit kinds name their components
themselves (``kinds``).
"""
from __future__ import annotations

from . import hf
from megatron.vlm.hf.config import HFSide
from megatron.vlm.lineages.qwen.qwen3_vit import batch
from megatron.vlm.lineages.qwen.qwen3_vit.data import QWEN3_VL_DATA
from megatron.vlm.lineages.qwen.qwen3_vit.modules import vision_config
from megatron.vlm.stage.components import FamilyRuntime

RUNTIME = FamilyRuntime(
    vision_config=vision_config,
    hf=HFSide(hf.recognizes, hf.spec_from_config, hf.native_config, names=hf.Names,
              logits_batch=batch.logits_batch, structure_twin=hf.structure_twin,
              checkpoint_info=hf.checkpoint_info),
    data=QWEN3_VL_DATA)
