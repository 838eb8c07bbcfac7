"""Qwen3-VL (dense and MoE), its language spec (tensor-free, no torch): the Qwen3 LLM with interleaved multimodal
RoPE. Its ViT's costs are the Qwen lineage's Qwen3-VL ViT (``megatron.vlm.lineages.qwen.vision_costs``: embedding,
layers, the layers at DeepStack indexes with their DeepStack mergers, the 2x2 patch merger); Qwen3-VL-MoE's MoE
layers are ``moe_cost.MoELayerCost``; the unit list, the DeepStack side tensors and the spec's checks are the
``Family``'s (``__init__``).

DeepStack: the ViT layer ``deepstack_visual_indexes[j]`` also runs DeepStack merger ``j`` on its output
(LayerNorm over the 4 concatenated patches, Linear-GELU-Linear into the LLM width) and hands the feature
(``[image tokens, LLM hidden]``) to LLM layer ``j``, which adds it to its output at the image tokens
(``Family.side_tensors``); such a layer is its own kind (``DeepStackLayerCost``: the layer plus its merger).
"""
from __future__ import annotations

from omnibal_ext.model.spec import LanguageSpec


def qwen3_language(**kw) -> LanguageSpec:
    """A Qwen3 decoder: per-head q/k RMSNorm, explicit head_dim, no qkv bias, interleaved multimodal RoPE."""
    return LanguageSpec(qk_norm=True, mrope_interleaved=True, qkv_bias=False, **kw)
