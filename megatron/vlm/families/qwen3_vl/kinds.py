"""Qwen3-VL's unit kinds (tensor-free: the planner path imports them): its LLM layers, dense and MoE, that add
DeepStack feature ``j`` to layer ``j``'s output (the GPT decoder's kinds, ``megatron.vlm.stage.kinds``, with their
run-time components in ``components``, reading the tokens too; the MoE layers' experts from the fused HF tensors,
``hf``). Its ViT's, merger's and LLM embedding's kinds are the Qwen lineage's (``megatron.vlm.lineages.qwen.kinds``),
its head the GPT decoder's."""
from __future__ import annotations

import dataclasses

from megatron.vlm.stage.kinds import LLM_LAYER, LLM_MOE_LAYER

DEEPSTACK_TEXT_LAYER = dataclasses.replace(
    LLM_LAYER, reads={"packing", "tokens"},  # the tokens say where the image tokens are
    runtime="megatron.vlm.families.qwen3_vl.components:DeepStackTextLayer")
DEEPSTACK_MOE_TEXT_LAYER = dataclasses.replace(
    LLM_MOE_LAYER, reads={"packing", "tokens"},
    runtime="megatron.vlm.families.qwen3_vl.components:DeepStackMoETextLayer",
    hf="megatron.vlm.families.qwen3_vl.hf:moe_layer_recipes")
