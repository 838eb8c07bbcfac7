"""InternVL (InternVL-Chat, 1.5, 2.5, 3, 3.5 and its MoE): InternViT over fixed-size tiles, the pixel-shuffle MLP
projector and a GPT decoder; the whole family in this folder.

Tensor-free (imported by the planners without torch): ``kinds`` (its unit kinds: each one's cost, run-time
component, micro-batch parts and HF mapping), ``costs`` (ViT spec, cost components), ``presets`` and this module: the
``Family`` (its unit list and spec check), registered. Run time (named by the kinds and ``Family.runtime``, imported
on first use): ``components`` (one per unit kind), ``modules`` and ``layers`` (InternViT, the projector), ``hf``
(config reader, tensor names, HF mappings), ``runtime`` (the ``FamilyRuntime``: ViT config, data and HF sides) and
``video`` (the frames-as-tiles video rule).
"""
from __future__ import annotations

from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS
from omnibal_ext.model.moe_cost import llm_layer_units
from omnibal_ext.model.spec import ModelSpec

from .costs import NAME, VisionSpec
from .kinds import MLP_PROJECTOR, VIT_EMBED, VIT_LAYER
from .presets import PRESETS
from megatron.vlm.stage.kinds import LLM_EMBED, LLM_HEAD, LLM_LAYER, LLM_MOE_LAYER


class InternVL(Family):
    """InternViT's embedding and layers, the projector, the GPT decoder (MoE layers at their own kind)."""

    def unit_list(self, spec: ModelSpec):
        units = [("vit.embed", VIT_EMBED, None)]
        units += [(f"vit.layer.{i}", VIT_LAYER, i) for i in range(spec.vision.num_layers)]
        units += [("projector", MLP_PROJECTOR, None), ("llm.embed", LLM_EMBED, None)]
        units += llm_layer_units(spec, LLM_LAYER, LLM_MOE_LAYER)  # MoE layers (LanguageSpec.moe) at their own kind
        return units + [("llm.head", LLM_HEAD, None)]

    def spec_problem(self, spec: ModelSpec) -> str | None:
        """The image size must be whole patches, and the patch grid pixel-shuffled by the downsample ratio."""
        v = spec.vision
        if v.image_size % v.patch_size:
            return f"--patch-size {v.patch_size} does not divide --image-size {v.image_size}"
        grid = v.image_size // v.patch_size
        if grid % int(round(1 / spec.downsample_ratio)):
            return f"the ViT patch grid {grid}x{grid} cannot be pixel-shuffled by {spec.downsample_ratio}"
        return None


INTERNVL = register(InternVL(
    name=NAME, default_preset="tiny", vision_spec=VisionSpec,
    kinds=(VIT_EMBED, VIT_LAYER, MLP_PROJECTOR, LLM_EMBED, LLM_LAYER, LLM_MOE_LAYER, LLM_HEAD), vision_item="tile",
    presets=PRESETS, runtime=f"{__name__}.runtime:RUNTIME",
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, moe=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--max-num-tiles", "--min-num-tiles"))))
