"""InternVL (InternVL-Chat, 1.5, 2.5, 3, 3.5 and its MoE): InternViT over fixed-size tiles, the pixel-shuffle MLP
projector and a GPT decoder; the whole family in this folder.

Tensor-free (imported by the planners without torch): ``costs`` (ViT spec, cost components), ``presets`` and this
module: the ``Family`` (its unit list and spec check), registered. Run time (imported through ``Family.runtime``
only): ``runtime`` (the ``FamilyRuntime``), ``modules`` and ``layers`` (InternViT, the projector), ``components``
(one per unit kind), ``hf`` (config reader, tensor names) and ``video`` (the frames-as-tiles video rule).
"""
from __future__ import annotations

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Capabilities, Family, register
from omnibal_ext.model.lora import TARGETS as LORA_TARGETS
from omnibal_ext.model.moe_cost import llm_layer_units
from omnibal_ext.model.spec import ModelSpec

from .costs import NAME, ProjectorCost, VisionEmbedCost, VisionLayerCost, VisionSpec
from .presets import PRESETS


class InternVL(Family):
    """InternViT's embedding and layers, the projector, the GPT decoder (MoE layers at their own kind)."""

    def unit_list(self, spec: ModelSpec):
        units = [("vit.embed", VisionEmbedCost, None)]
        units += [(f"vit.layer.{i}", VisionLayerCost, i) for i in range(spec.vision.num_layers)]
        units += [("projector", ProjectorCost, None), ("llm.embed", TextEmbedCost, None)]
        units += llm_layer_units(spec)  # MoE layers (LanguageSpec.moe) at their own kind
        return units + [("llm.head", HeadCost, None)]

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
    components=(VisionEmbedCost, VisionLayerCost, ProjectorCost, TextEmbedCost, TextLayerCost, HeadCost),
    vision_item="tile", presets=PRESETS, runtime=f"{__name__}.runtime:RUNTIME",
    capabilities=Capabilities(drop_path=True, context_parallel=True, sequence_parallel=True, moe=True, video=True,
                              lora_targets=LORA_TARGETS, image_flags=("--max-num-tiles", "--min-num-tiles"))))
