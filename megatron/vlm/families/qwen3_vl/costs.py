"""Qwen3-VL (dense and MoE), its costs (tensor-free, no torch): its unit list over the Qwen lineage's Qwen3-VL ViT
(``megatron.vlm.lineages.qwen.vision_costs``: embedding, layers, the layers at DeepStack indexes with their
DeepStack mergers, the 2x2 patch merger), the Qwen3 LLM with interleaved multimodal RoPE (Qwen3-VL-MoE: its MoE
layers at their own kind, ``moe_cost.MoELayerCost``), the DeepStack side tensors and the spec's checks.

DeepStack: the ViT layer ``deepstack_visual_indexes[j]`` also runs DeepStack merger ``j`` on its output
(LayerNorm over the 4 concatenated patches, Linear-GELU-Linear into the LLM width) and hands the feature
(``[image tokens, LLM hidden]``) to LLM layer ``j``, which adds it to its output at the image tokens
(``side_tensors``); such a layer is its own kind (``DeepStackLayerCost``: the layer plus its merger).
"""
from __future__ import annotations

from dataclasses import replace

from omnibal_ext.model.components import HeadCost, TextEmbedCost
from omnibal_ext.model.moe import first_layers
from omnibal_ext.model.moe_cost import llm_layer_units
from omnibal_ext.model.spec import LanguageSpec, ModelSpec, SideTensor

from megatron.vlm.lineages.qwen.vision_costs import (DeepStackLayerCost, MergerCost, VisionEmbedCost, VisionLayerCost,
                                                     deepstack_name)


def unit_list(spec: ModelSpec):
    v = spec.vision
    units = [("vit.embed", VisionEmbedCost, None)]
    units += [(f"vit.layer.{i}", VisionLayerCost if v.deepstack_slot(i) is None else DeepStackLayerCost, i)
              for i in range(v.num_layers)]
    units += [("projector", MergerCost, None), ("llm.embed", TextEmbedCost, None)]
    units += llm_layer_units(spec)  # MoE layers (LanguageSpec.moe) at their own kind
    return units + [("llm.head", HeadCost, None)]


def side_tensors(spec: ModelSpec) -> tuple[SideTensor, ...]:
    """DeepStack feature ``j``: made by the unit of ViT layer ``deepstack_visual_indexes[j]``, read by LLM layer
    ``j``'s unit; one row per LLM image token, the LLM's width."""
    names = [name for name, _, _ in unit_list(spec)]
    return tuple(SideTensor(deepstack_name(j), names.index(f"vit.layer.{layer}"), (names.index(f"llm.layer.{j}"),),
                            spec.language.hidden_size)
                 for j, layer in enumerate(spec.vision.deepstack_visual_indexes))


def few_layers(spec: ModelSpec, vision_layers: int, llm_layers: int) -> ModelSpec:
    """``spec``'s first ``vision_layers`` ViT layers with the DeepStack indexes among them, and ``llm_layers`` LLM
    layers, more where the kept DeepStack features need them (``Family.few_layers``: the trainer's profiler)."""
    kept = tuple(i for i in spec.vision.deepstack_visual_indexes if i < vision_layers)
    vision = replace(spec.vision, num_layers=vision_layers, deepstack_visual_indexes=kept)
    n = max(llm_layers, len(kept))
    return spec.replace(vision=vision, language=replace(spec.language, num_layers=n,
                                                        moe=first_layers(spec.language.moe, n)))


def spec_problem(spec: ModelSpec) -> str | None:
    k, n = len(spec.vision.deepstack_visual_indexes), spec.language.num_layers
    if k > n:
        return (f"vision_config.deepstack_visual_indexes has {k} entries but the LLM has {n} layers: DeepStack "
                f"feature j is added after LLM layer j, so at most {n} are possible")
    return None


def qwen3_language(**kw) -> LanguageSpec:
    """A Qwen3 decoder: per-head q/k RMSNorm, explicit head_dim, no qkv bias, interleaved multimodal RoPE."""
    return LanguageSpec(qk_norm=True, mrope_interleaved=True, qkv_bias=False, **kw)
