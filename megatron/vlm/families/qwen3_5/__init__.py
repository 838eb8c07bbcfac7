"""Qwen3.5 (dense and MoE): the Qwen3-VL ViT without DeepStack, the 2x2 patch merger and a hybrid decoder of Gated
DeltaNet and gated-attention layers with zero-centred RMSNorms; the whole family in this folder, on the Qwen lineage
library (``megatron.vlm.lineages.qwen``: the ViT, patch images, multimodal RoPE ids, video, the batcher).

Tensor-free (imported by the planners without torch): ``kinds`` (its unit kinds: each one's cost, run-time
component, micro-batch parts and HF mapping), ``costs`` (the hybrid decoder's layer costs), ``presets`` and this
module: the ``Family`` (its unit list, profiled copy and spec check), registered. Run time (named by the kinds and
``Family.runtime``, imported on first use): ``components`` (one per unit kind), ``modules``, ``hf`` (config reader,
names, HF mappings), ``gated_delta_net_hf`` and ``runtime`` (the ``FamilyRuntime``: ViT config, data and HF sides).
"""
from __future__ import annotations

import dataclasses

from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.moe import first_layers
from omnibal_ext.model.spec import ModelSpec

from .costs import Qwen35LanguageSpec
from .kinds import (ATTENTION_LAYER, ATTENTION_MOE_LAYER, LINEAR_LAYER, LINEAR_MOE_LAYER, ZERO_CENTRED_HEAD,
                    layer_kind)
from .presets import PRESETS
from megatron.vlm.lineages.qwen.kinds import IMAGE_TEXT_EMBED, QWEN3_MERGER, QWEN3_VIT_EMBED, QWEN3_VIT_LAYER
from megatron.vlm.lineages.qwen.vision_costs import VisionSpec


class Qwen35(Family):
    """The Qwen3-VL ViT (no DeepStack), the merger, the hybrid decoder's layers at the kinds ``layer_types`` gives
    (each with its MoE kind where ``LanguageSpec.moe`` says) and the zero-centred head."""

    def unit_list(self, spec: ModelSpec):
        lm = spec.language
        units = [("vit.embed", QWEN3_VIT_EMBED, None)]
        units += [(f"vit.layer.{i}", QWEN3_VIT_LAYER, i) for i in range(spec.vision.num_layers)]
        units += [("projector", QWEN3_MERGER, None), ("llm.embed", IMAGE_TEXT_EMBED, None)]
        units += [(f"llm.layer.{i}", layer_kind(lm, i), i) for i in range(lm.num_layers)]
        return units + [("llm.head", ZERO_CENTRED_HEAD, None)]

    def few_layers(self, spec: ModelSpec, vision_layers: int, llm_layers: int) -> ModelSpec:
        """``spec`` with ``vision_layers`` ViT layers and its first LLM layers, at least ``llm_layers`` and as many as
        hold a layer of each kind of ``layer_types`` (the trainer's profiler measures every kind)."""
        types = spec.language.layer_types
        keep = max(llm_layers, max(types.index(kind) for kind in set(types)) + 1)
        return spec.replace(vision=dataclasses.replace(spec.vision, num_layers=vision_layers),
                            language=dataclasses.replace(spec.language, num_layers=keep, layer_types=types[:keep],
                                                         moe=first_layers(spec.language.moe, keep)))

    def spec_problem(self, spec: ModelSpec) -> str | None:
        if spec.vision.deepstack_visual_indexes:
            return "Qwen3.5's ViT has no DeepStack (deepstack_visual_indexes must be empty)"
        if not isinstance(spec.language, Qwen35LanguageSpec):
            return "a Qwen3.5 model's language spec is a Qwen35LanguageSpec"
        return None


QWEN3_5 = register(Qwen35(
    name="qwen3_5", vision_spec=VisionSpec, language_spec=Qwen35LanguageSpec,
    kinds=(QWEN3_VIT_EMBED, QWEN3_VIT_LAYER, QWEN3_MERGER, IMAGE_TEXT_EMBED, LINEAR_LAYER, ATTENTION_LAYER,
           LINEAR_MOE_LAYER, ATTENTION_MOE_LAYER, ZERO_CENTRED_HEAD),
    vision_item="patch", presets=PRESETS, runtime=f"{__name__}.runtime:RUNTIME",
    # sequence parallelism is declared: the Gated DeltaNet, the gated attention and the norms run under it (tested
    # at TP 2); context parallelism is refused (the linear layers' state would pass between CP ranks); no LoRA;
    # video as Qwen3-VL's (its ViT, processor and get_rope_index: tests/test_qwen_video_logits.py)
    capabilities=Capabilities(sequence_parallel=True, video=True, image_flags=("--min-pixels", "--max-pixels"),
                              moe=True)))
