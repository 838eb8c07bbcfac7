"""Qwen3.5 (dense and MoE): the Qwen3-VL ViT without DeepStack, the 2x2 patch merger and a hybrid decoder of Gated
DeltaNet and gated-attention layers with zero-centred RMSNorms; the whole family in this folder, on the Qwen lineage
library (``megatron.vlm.lineages.qwen``: the ViT, patch images, multimodal RoPE ids, video, the batcher).

Tensor-free (imported by the planners without torch): ``costs`` (the hybrid decoder's layer costs, unit list),
``presets`` and this module, which registers the ``Family``. Run time (imported through ``Family.runtime`` only):
``runtime`` (the ``FamilyRuntime``), ``modules``, ``components``, ``hf`` and ``gated_delta_net_hf``.
"""
from __future__ import annotations

from omnibal_ext.model.components import TextEmbedCost
from omnibal_ext.model.families import Capabilities, Family, register

from .costs import (GatedAttentionLayerCost, GatedAttentionMoELayerCost, LinearAttentionLayerCost,
                    LinearAttentionMoELayerCost, Qwen35LanguageSpec, ZeroCentredHeadCost, few_layers, spec_problem,
                    unit_list)
from .presets import PRESETS
from megatron.vlm.lineages.qwen.vision_costs import (MergerCost, VisionEmbedCost, VisionLayerCost, VisionSpec,
                                                     image_segments_sq)

QWEN3_5 = register(Family(
    name="qwen3_5", vision_spec=VisionSpec, language_spec=Qwen35LanguageSpec,
    components=(VisionEmbedCost, VisionLayerCost, MergerCost, TextEmbedCost, LinearAttentionLayerCost,
                GatedAttentionLayerCost, LinearAttentionMoELayerCost, GatedAttentionMoELayerCost, ZeroCentredHeadCost),
    unit_list=unit_list, vision_item="patch", presets=PRESETS, segments_sq=image_segments_sq,
    spec_problem=spec_problem, few_layers=few_layers, runtime=f"{__name__}.runtime:RUNTIME",
    # sequence parallelism is declared: the Gated DeltaNet, the gated attention and the norms run under it (tested
    # at TP 2); context parallelism is refused (the linear layers' state would pass between CP ranks); no LoRA;
    # video as Qwen3-VL's (its ViT, processor and get_rope_index: tests/test_qwen_video_logits.py)
    capabilities=Capabilities(sequence_parallel=True, video=True, image_flags=("--min-pixels", "--max-pixels"),
                              moe=True)))
