"""Qwen2.5-VL: its ViT (window attention with full-attention layers, 2-D rotary positions), the 2x2 patch merger and
a Qwen2 decoder with multimodal RoPE; the whole family in this folder, on the Qwen lineage library
(``megatron.vlm.lineages.qwen``: patch images, multimodal RoPE ids, vision windows, video, the batcher).

Tensor-free (imported by the planners without torch): ``kinds`` (its unit kinds: each one's cost, run-time
component, micro-batch parts and HF mapping), ``costs`` (ViT spec, cost components), ``presets`` and this module: the
``Family`` (its unit list), registered. Run time (named by the kinds and ``Family.runtime``, imported on first use):
``components`` (one per unit kind), ``modules``, ``hf`` (config reader, names, HF mappings) and ``runtime`` (the
``FamilyRuntime``: ViT config, data and HF sides).
"""
from __future__ import annotations

from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS
from omnibal_ext.model.moe_cost import llm_layer_units
from omnibal_ext.model.spec import ModelSpec

from .costs import VisionSpec
from .kinds import FULL_LAYER, MERGER, PATCH_EMBED, WINDOW_LAYER
from .presets import PRESETS
from megatron.vlm.lineages.qwen.kinds import IMAGE_TEXT_EMBED, MROPE_TEXT_LAYER
from megatron.vlm.stage.kinds import LLM_HEAD


class Qwen25VL(Family):
    """The patch embedding, window- and full-attention ViT layers (``fullatt_block_indexes``), the merger and the
    GPT decoder."""

    def unit_list(self, spec: ModelSpec):
        v = spec.vision
        units = [("vit.embed", PATCH_EMBED, None)]
        units += [(f"vit.layer.{i}", FULL_LAYER if v.full_attention(i) else WINDOW_LAYER, i)
                  for i in range(v.num_layers)]
        units += [("projector", MERGER, None), ("llm.embed", IMAGE_TEXT_EMBED, None)]
        units += llm_layer_units(spec, MROPE_TEXT_LAYER)  # no MoE layers: a model with experts is refused
        return units + [("llm.head", LLM_HEAD, None)]


QWEN2_5_VL = register(Qwen25VL(
    name="qwen2_5_vl", vision_spec=VisionSpec,
    kinds=(PATCH_EMBED, WINDOW_LAYER, FULL_LAYER, MERGER, IMAGE_TEXT_EMBED, MROPE_TEXT_LAYER, LLM_HEAD),
    vision_item="patch", presets=PRESETS, runtime=f"{__name__}.runtime:RUNTIME",
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--min-pixels", "--max-pixels"))))
