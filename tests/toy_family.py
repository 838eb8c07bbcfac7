"""A model family defined outside the package, as a user's plugin: importing this module registers it through the
public ``megatron.vlm.families.register`` (the trainer imports it with ``--family-module toy_family``).

The toy is InternVL with another projector: one linear layer (pixel shuffle, then a single Linear into the LLM's
width) instead of LayerNorm and a 2-layer MLP. Its planning side is a ``Family`` with its own ``ProjectorCost``
subclass and its own preset (``toy-tiny``); its runtime side a ``RuntimeFamily`` with its own projector component;
everything else (ViT, data side: tiles, HF side: InternVL's names with the projector's own tensors) is InternVL's
and the shared GPT decoder's, reached through the public modules only.
"""
from __future__ import annotations

import dataclasses

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from omnibal_ext.model.components import HeadCost, TextEmbedCost, TextLayerCost
from omnibal_ext.model.families import Family
from omnibal_ext.model.families.internvl import INTERNVL as INTERNVL_PLANNING
from omnibal_ext.model.families.internvl import ProjectorCost, VisionEmbedCost, VisionLayerCost, VisionSpec

from megatron.vlm.components import GPT_DECODER, RuntimeComponent, RuntimeFamily
from megatron.vlm.config import vision_config
from megatron.vlm.families import FAMILIES, register
from megatron.vlm.families.internvl.components import VisionEmbed, VisionLayer

NAME = "toy-linear-projector"


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

    def build(self, units):  # its input is the ViT's whole output: never sequence parallel (as InternVL's projector)
        return LinearProjector(self.spec, dataclasses.replace(self.ctx.language_config, sequence_parallel=False))

    def forward(self, module, x, batch, cache):
        return module(x)

    @classmethod
    def hf_recipes(cls, unit, table):
        from megatron.vlm.hf.recipes import whole

        spec = table.spec
        hi, ho = spec.projector_in_size, spec.language.hidden_size
        table.add(unit.name + ".fc.weight", whole(table.hf("toy_projector.weight", (ho, hi)), (ho, hi)))
        table.add(unit.name + ".fc.bias", whole(table.hf("toy_projector.bias", (ho,)), (ho,)))


def _tiny():
    base = INTERNVL_PLANNING.presets["tiny"]
    return base.replace(name="toy-tiny", family=NAME)


PLANNING = Family(
    name=NAME, vision_spec=VisionSpec,
    components=(VisionEmbedCost, VisionLayerCost, LinearProjectorCost, TextEmbedCost, TextLayerCost, HeadCost),
    unit_list=unit_list, vision_item="tile", presets={"toy-tiny": _tiny()},
    spec_problem=INTERNVL_PLANNING.spec_problem, capabilities=INTERNVL_PLANNING.capabilities)

_internvl = FAMILIES[INTERNVL_PLANNING.name]


def recognizes(cfg: dict) -> bool:
    return cfg.get("model_type") == NAME


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json"):
    """InternVL's native reader on the same keys, the model of this family."""
    spec, info = _internvl.hf.spec_from_config({**cfg, "model_type": "internvl"}, name, where)
    return spec.replace(family=NAME), info


def native_config(spec, info, source):
    return {**_internvl.hf.native_config(spec, info, source), "model_type": NAME,
            "architectures": ["ToyLinearProjectorForConditionalGeneration"]}


HF = dataclasses.replace(_internvl.hf, recognizes=recognizes, spec_from_config=spec_from_config,
                         native_config=native_config)
FAMILY = RuntimeFamily(planning=PLANNING, components=(VisionEmbed, VisionLayer, LinearProjectorUnit, *GPT_DECODER),
                       vision_config=vision_config, hf=HF, data=_internvl.data)

register(FAMILY)
