"""Qwen3-VL (dense and MoE): the Qwen3-VL ViT with DeepStack mergers feeding the first LLM layers, the 2x2 patch
merger and a Qwen3 decoder with interleaved multimodal RoPE; the whole family in this folder, on the Qwen lineage
library (``megatron.vlm.lineages.qwen``: the ViT, patch images, multimodal RoPE ids, video, the batcher).

Tensor-free (imported by the planners without torch): ``costs`` (DeepStack layer cost, unit list, side tensors),
``presets`` and this module, which registers the ``Family``. Run time (imported through ``Family.runtime`` only):
``runtime`` (the ``FamilyRuntime``), ``modules``, ``components`` and ``hf``.
"""
from __future__ import annotations

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS
from omnibal_ext.model.moe_cost import MoELayerCost

from .costs import few_layers, side_tensors, spec_problem, unit_list
from .presets import PRESETS
from megatron.vlm.lineages.qwen.vision_costs import (DeepStackLayerCost, MergerCost, VisionEmbedCost, VisionLayerCost,
                                                     VisionSpec, image_segments_sq)

QWEN3_VL = register(Family(
    name="qwen3_vl", vision_spec=VisionSpec,
    components=(VisionEmbedCost, VisionLayerCost, DeepStackLayerCost, MergerCost, TextEmbedCost, TextLayerCost,
                MoELayerCost, HeadCost),
    unit_list=unit_list, vision_item="patch", presets=PRESETS, segments_sq=image_segments_sq,
    spec_problem=spec_problem, side_tensors=side_tensors, few_layers=few_layers,
    runtime=f"{__name__}.runtime:RUNTIME",
    # drop path: tests/test_qwen3_vl_drop_path.py; SP and CP: tests/test_qwen3_vl_training.py
    capabilities=Capabilities(drop_path=True, sequence_parallel=True, context_parallel=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--min-pixels", "--max-pixels"), moe=True)))
