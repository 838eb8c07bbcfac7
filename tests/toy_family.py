"""A model family defined outside the package, as a user's plugin, written step by step from docs/extending.md
("Adding a family"): importing this module registers it (the trainer imports it with ``--family-module
toy_family``).

The toy is InternVL with another projector: one linear layer (pixel shuffle, then a single Linear into the LLM's
width) instead of LayerNorm and a 2-layer MLP. Everything else (the ViT, the data side: tiles, the HF side: InternVL's
names plus the projector's own tensors) is InternVL's and the shared GPT decoder's, reached through public modules.

Step 1 (costs, tensor-free) and step 3 (the ``Family``) import no torch; step 2 (the run-time side) does. A plugin
that must plan without torch puts step 2 in a module of its own and names it in ``Family.runtime``; this one keeps the
three steps in one file.
"""
from __future__ import annotations

import dataclasses

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Family, family_of, register

from megatron.vlm.stage.components import GPT_DECODER, FamilyRuntime, RuntimeComponent
from megatron.vlm.layers.config import vision_config
from megatron.vlm.stage.components import runtime_family
from megatron.vlm.families.internvl.components import VisionEmbed, VisionLayer
from megatron.vlm.families.internvl.costs import ProjectorCost, VisionEmbedCost, VisionLayerCost, VisionSpec
from megatron.vlm.families.internvl.presets import PRESETS as INTERNVL_PRESETS
from megatron.vlm.hf.config import HFSide
from megatron.vlm.hf.recipes import whole

NAME = "toy-linear-projector"


# Step 1: the costs of the new unit kind and the unit list (tensor-free) ----------------------------------------
class LinearProjectorCost(ProjectorCost):
    """Pixel shuffle and one Linear (with bias) into the LLM's width."""

    kind = "linear_projector"

    def flops(self, shape, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2.0 * self._image_tokens(shape) * hi * ho, 0.0

    def params(self, tp):
        return self.spec.projector_in_size * self.spec.language.hidden_size + self.spec.language.hidden_size


def unit_list(spec):
    units = [("vit.embed", VisionEmbedCost, None)]
    units += [(f"vit.layer.{i}", VisionLayerCost, i) for i in range(spec.vision.num_layers)]
    units += [("projector", LinearProjectorCost, None), ("llm.embed", TextEmbedCost, None)]
    units += [(f"llm.layer.{i}", TextLayerCost, i) for i in range(spec.language.num_layers)]
    return units + [("llm.head", HeadCost, None)]


# Step 2: the run-time side: the module, its component (build, forward, HF mapping), the FamilyRuntime ----------
class LinearProjector(MegatronModule):
    """[1 + P, n, Hv] -> drop the class token -> pixel shuffle -> Linear -> [n * tokens per tile, 1, Hl]."""

    def __init__(self, spec, config):
        super().__init__(config=config)
        self.grid = int(round(spec.vision.patches_per_tile ** 0.5))
        self.factor = int(round(1 / spec.downsample_ratio))
        self.fc = tensor_parallel.ColumnParallelLinear(
            spec.projector_in_size, spec.language.hidden_size, config=config, init_method=config.init_method,
            bias=True, gather_output=True)

    def forward(self, vit_out):
        x = vit_out[1:].transpose(0, 1)
        n, _, h = x.shape
        g, f = self.grid, self.factor
        x = x.reshape(n, g // f, f, g // f, f, h).permute(0, 1, 3, 2, 4, 5).reshape(n * (g // f) ** 2, f * f * h)
        x, _ = self.fc(x)
        return x.unsqueeze(1)


class LinearProjectorUnit(RuntimeComponent):
    cost, attr = LinearProjectorCost, "projector"

    def build(self):  # its input is the ViT's whole output: never sequence parallel (as InternVL's projector)
        return LinearProjector(self.spec, dataclasses.replace(self.ctx.language_config, sequence_parallel=False))

    def forward(self, module, x, batch, cache):
        return module(x)

    @classmethod
    def hf_recipes(cls, unit, table):
        spec = table.spec
        hi, ho = spec.projector_in_size, spec.language.hidden_size
        table.add(unit.name + ".fc.weight", whole(table.hf("toy_projector.weight", (ho, hi)), (ho, hi)))
        table.add(unit.name + ".fc.bias", whole(table.hf("toy_projector.bias", (ho,)), (ho,)))


_INTERNVL_TINY = INTERNVL_PRESETS["tiny"]
_internvl = runtime_family(_INTERNVL_TINY)  # InternVL's run-time side: its data and HF sides are reused


def recognizes(cfg: dict) -> bool:
    return cfg.get("model_type") == NAME


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json"):
    """InternVL's native reader on the same keys, the model of this family."""
    spec, info = _internvl.hf.spec_from_config({**cfg, "model_type": _INTERNVL_TINY.family}, name, where)
    return spec.replace(family=NAME), info


def native_config(spec, info, source):
    return {**_internvl.hf.native_config(spec, info, source), "model_type": NAME,
            "architectures": ["ToyLinearProjectorForConditionalGeneration"]}


HF: HFSide = dataclasses.replace(_internvl.hf, recognizes=recognizes, spec_from_config=spec_from_config,
                                 native_config=native_config)
RUNTIME = FamilyRuntime(components=(VisionEmbed, VisionLayer, LinearProjectorUnit, *GPT_DECODER),
                        vision_config=vision_config, hf=HF, data=_internvl.data)


# Step 3: the Family, registered ---------------------------------------------------------------------------------
_internvl_family = family_of(_INTERNVL_TINY)
FAMILY = register(Family(
    name=NAME, vision_spec=VisionSpec,
    components=(VisionEmbedCost, VisionLayerCost, LinearProjectorCost, TextEmbedCost, TextLayerCost, HeadCost),
    unit_list=unit_list, vision_item="tile",
    presets={"toy-tiny": _INTERNVL_TINY.replace(name="toy-tiny", family=NAME)},
    spec_problem=_internvl_family.spec_problem, capabilities=_internvl_family.capabilities,
    runtime=f"{__name__}:RUNTIME"))
