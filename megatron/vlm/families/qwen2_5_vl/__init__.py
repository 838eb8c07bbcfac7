"""Qwen2.5-VL: its ViT (window attention with full-attention layers, 2-D rotary positions), the 2x2 patch merger and
a Qwen2 decoder with multimodal RoPE; the whole family in this folder, on the Qwen lineage library
(``megatron.vlm.lineages.qwen``: patch images, multimodal RoPE ids, vision windows, video, the batcher).

Tensor-free (imported by the planners without torch): ``costs`` (ViT spec, cost components), ``presets`` and this
module: the ``Family`` (its unit list), registered. Run time (imported through ``Family.runtime`` only): ``runtime``
(the ``FamilyRuntime``), ``modules``, ``components``, ``hf`` and ``data``.
"""
from __future__ import annotations

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS
from omnibal_ext.model.moe_cost import llm_layer_units
from omnibal_ext.model.spec import ModelSpec

from .costs import FullLayerCost, MergerCost, VisionEmbedCost, VisionSpec, WindowLayerCost
from .presets import PRESETS


class Qwen25VL(Family):
    """The patch embedding, window- and full-attention ViT layers (``fullatt_block_indexes``), the merger and the
    GPT decoder."""

    def unit_list(self, spec: ModelSpec):
        v = spec.vision
        units = [("vit.embed", VisionEmbedCost, None)]
        units += [(f"vit.layer.{i}", FullLayerCost if v.full_attention(i) else WindowLayerCost, i)
                  for i in range(v.num_layers)]
        units += [("projector", MergerCost, None), ("llm.embed", TextEmbedCost, None)]
        units += llm_layer_units(spec)  # MoE layers (LanguageSpec.moe) at their own kind
        return units + [("llm.head", HeadCost, None)]


QWEN2_5_VL = register(Qwen25VL(
    name="qwen2_5_vl", vision_spec=VisionSpec,
    components=(VisionEmbedCost, WindowLayerCost, FullLayerCost, MergerCost, TextEmbedCost, TextLayerCost, HeadCost),
    vision_item="patch", presets=PRESETS, runtime=f"{__name__}.runtime:RUNTIME",
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--min-pixels", "--max-pixels"))))
