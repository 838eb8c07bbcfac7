"""Qwen3-VL (dense and MoE): the Qwen3-VL ViT with DeepStack mergers feeding the first LLM layers, the 2x2 patch
merger and a Qwen3 decoder with interleaved multimodal RoPE; the whole family in this folder, on the Qwen lineage
library (``megatron.vlm.lineages.qwen``: the ViT, patch images, multimodal RoPE ids, video, the batcher).

Tensor-free (imported by the planners without torch): ``kinds`` (its own unit kinds, the DeepStack LLM layers: each
one's cost, run-time component, micro-batch parts and HF mapping), ``costs`` (the Qwen3 language spec), ``presets``
and this module: the ``Family`` (its unit list, DeepStack side tensors, profiled copy and spec check), registered.
Run time (named by the kinds and ``Family.runtime``, imported on first use): ``components`` (the DeepStack LLM
layers), ``hf`` (config reader, names, the fused experts' HF mapping) and ``runtime`` (the ``FamilyRuntime``).
"""
from __future__ import annotations

from dataclasses import replace

from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS
from omnibal_ext.model.moe import first_layers
from omnibal_ext.model.moe_cost import llm_layer_units
from omnibal_ext.model.spec import ModelSpec, SideTensor

from .kinds import DEEPSTACK_MOE_TEXT_LAYER, DEEPSTACK_TEXT_LAYER
from .presets import PRESETS
from megatron.vlm.lineages.qwen.kinds import (IMAGE_TEXT_EMBED, QWEN3_DEEPSTACK_LAYER, QWEN3_MERGER, QWEN3_VIT_EMBED,
                                              QWEN3_VIT_LAYER)
from megatron.vlm.lineages.qwen.vision_costs import VisionSpec, deepstack_name
from megatron.vlm.stage.kinds import LLM_HEAD


class Qwen3VL(Family):
    """The Qwen3-VL ViT (its layers at DeepStack indexes their own kind), the merger and the GPT decoder (MoE layers
    at their own kind); DeepStack feature ``j`` goes from its ViT layer to LLM layer ``j`` (``side_tensors``)."""

    def unit_list(self, spec: ModelSpec):
        v = spec.vision
        units = [("vit.embed", QWEN3_VIT_EMBED, None)]
        units += [(f"vit.layer.{i}", QWEN3_VIT_LAYER if v.deepstack_slot(i) is None else QWEN3_DEEPSTACK_LAYER, i)
                  for i in range(v.num_layers)]
        units += [("projector", QWEN3_MERGER, None), ("llm.embed", IMAGE_TEXT_EMBED, None)]
        units += llm_layer_units(spec, DEEPSTACK_TEXT_LAYER, DEEPSTACK_MOE_TEXT_LAYER)  # MoE layers: their own kind
        return units + [("llm.head", LLM_HEAD, None)]

    def side_tensors(self, spec: ModelSpec) -> tuple[SideTensor, ...]:
        """DeepStack feature ``j``: made by the unit of ViT layer ``deepstack_visual_indexes[j]``, read by LLM layer
        ``j``'s unit; one row per LLM image token, the LLM's width."""
        names = [name for name, _, _ in self.unit_list(spec)]
        return tuple(SideTensor(deepstack_name(j), names.index(f"vit.layer.{layer}"),
                                (names.index(f"llm.layer.{j}"),), spec.language.hidden_size)
                     for j, layer in enumerate(spec.vision.deepstack_visual_indexes))

    def few_layers(self, spec: ModelSpec, vision_layers: int, llm_layers: int) -> ModelSpec:
        """``spec``'s first ``vision_layers`` ViT layers with the DeepStack indexes among them, and ``llm_layers`` LLM
        layers, more where the kept DeepStack features need them (the trainer's profiler)."""
        kept = tuple(i for i in spec.vision.deepstack_visual_indexes if i < vision_layers)
        vision = replace(spec.vision, num_layers=vision_layers, deepstack_visual_indexes=kept)
        n = max(llm_layers, len(kept))
        return spec.replace(vision=vision, language=replace(spec.language, num_layers=n,
                                                            moe=first_layers(spec.language.moe, n)))

    def spec_problem(self, spec: ModelSpec) -> str | None:
        k, n = len(spec.vision.deepstack_visual_indexes), spec.language.num_layers
        if k > n:
            return (f"vision_config.deepstack_visual_indexes has {k} entries but the LLM has {n} layers: DeepStack "
                    f"feature j is added after LLM layer j, so at most {n} are possible")
        return None


QWEN3_VL = register(Qwen3VL(
    name="qwen3_vl", vision_spec=VisionSpec,
    kinds=(QWEN3_VIT_EMBED, QWEN3_VIT_LAYER, QWEN3_DEEPSTACK_LAYER, QWEN3_MERGER, IMAGE_TEXT_EMBED,
           DEEPSTACK_TEXT_LAYER, DEEPSTACK_MOE_TEXT_LAYER, LLM_HEAD),
    vision_item="patch", presets=PRESETS, runtime=f"{__name__}.runtime:RUNTIME",
    # drop path: tests/test_qwen3_vl_drop_path.py; SP and CP: tests/test_qwen3_vl_training.py
    capabilities=Capabilities(drop_path=True, sequence_parallel=True, context_parallel=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--min-pixels", "--max-pixels"), moe=True)))
