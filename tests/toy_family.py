"""A model family defined outside the package, as a user's plugin, written step by step from docs/extending.md
("Adding a family"): importing this module registers it (the trainer imports it with ``--family-module
toy_family``).

The toy is InternVL with another projector: one linear layer (pixel shuffle, then a single Linear into the LLM's
width) instead of LayerNorm and a 2-layer MLP, a unit kind of its own. Everything else (the ViT's kinds, the data
side: tiles, the HF side: InternVL's names plus the projector's own tensors) is InternVL's and the shared GPT
decoder's, reached through public modules.

Step 1 (the cost) and steps 3-4's declarations import no torch; step 2 (the run-time component and the HF mapping)
and the run-time side of step 4 do. A plugin that must plan without torch puts those in a module of its own and names
it in ``UnitKind.runtime``, ``UnitKind.hf`` and ``Family.runtime``; this one keeps every step in one file.
"""
from __future__ import annotations

import dataclasses

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from omnibal_ext.model.families import register
from omnibal_ext.model.spec import PROJECTOR
from omnibal_ext.model.unit_kind import UnitKind

from megatron.vlm.families.internvl import INTERNVL, InternVL
from megatron.vlm.families.internvl.costs import ProjectorCost, VisionSpec
from megatron.vlm.families.internvl.kinds import VIT_EMBED, VIT_LAYER
from megatron.vlm.families.internvl.presets import PRESETS as INTERNVL_PRESETS
from megatron.vlm.hf.recipes import whole
from megatron.vlm.layers.config import vision_config
from megatron.vlm.stage.components import FamilyRuntime, RuntimeComponent
from megatron.vlm.stage.kinds import LLM_EMBED, LLM_HEAD, LLM_LAYER

NAME = "toy-linear-projector"


# Step 1: the cost of the new unit kind (tensor-free) -----------------------------------------------------------
class LinearProjectorCost(ProjectorCost):
    """Pixel shuffle and one Linear (with bias) into the LLM's width."""

    def flops(self, shape, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2.0 * self._image_tokens(shape) * hi * ho, 0.0

    def params(self, tp):
        return self.spec.projector_in_size * self.spec.language.hidden_size + self.spec.language.hidden_size


# Step 2: its run-time component (module, build, forward) and its Hugging Face mapping --------------------------
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
    attr = "projector"

    def build(self):  # its input is the ViT's whole output: never sequence parallel (as InternVL's projector)
        return LinearProjector(self.spec, dataclasses.replace(self.ctx.language_config, sequence_parallel=False))

    def forward(self, module, x, batch, cache):
        return module(x)


def linear_projector_recipes(unit, table):
    """Our ``projector.fc.*`` from the HF tensors ``toy_projector.weight`` / ``.bias``."""
    hi, ho = table.spec.projector_in_size, table.spec.language.hidden_size
    table.add(unit.name + ".fc.weight", whole(table.hf("toy_projector.weight", (ho, hi)), (ho, hi)))
    table.add(unit.name + ".fc.bias", whole(table.hf("toy_projector.bias", (ho,)), (ho,)))


# Step 3: the unit kind, in one declaration ----------------------------------------------------------------------
LINEAR_PROJECTOR = UnitKind("linear_projector", PROJECTOR, LinearProjectorCost,
                            runtime=f"{__name__}:LinearProjectorUnit", hf=f"{__name__}:linear_projector_recipes")


# Step 4: the family: its unit list, its run-time side, registered ----------------------------------------------
class Toy(InternVL):
    """InternVL's family (its spec check) with the linear projector in its unit list."""

    def unit_list(self, spec):
        units = [("vit.embed", VIT_EMBED, None)]
        units += [(f"vit.layer.{i}", VIT_LAYER, i) for i in range(spec.vision.num_layers)]
        units += [("projector", LINEAR_PROJECTOR, None), ("llm.embed", LLM_EMBED, None)]
        units += [(f"llm.layer.{i}", LLM_LAYER, i) for i in range(spec.language.num_layers)]
        return units + [("llm.head", LLM_HEAD, None)]


_INTERNVL_TINY = INTERNVL_PRESETS["tiny"]
_internvl = INTERNVL.load_runtime()  # InternVL's run-time side: its data and HF sides are reused


def recognizes(cfg: dict) -> bool:
    return cfg.get("model_type") == NAME


def spec_from_config(cfg: dict, name: str = "hf", where: str = "config.json"):
    """InternVL's native reader on the same keys, the model of this family."""
    spec, info = _internvl.hf.spec_from_config({**cfg, "model_type": _INTERNVL_TINY.family}, name, where)
    return spec.replace(family=NAME), info


def native_config(spec, info, source):
    return {**_internvl.hf.native_config(spec, info, source), "model_type": NAME,
            "architectures": ["ToyLinearProjectorForConditionalGeneration"]}


RUNTIME = FamilyRuntime(vision_config=vision_config, data=_internvl.data,
                        hf=dataclasses.replace(_internvl.hf, recognizes=recognizes, spec_from_config=spec_from_config,
                                               native_config=native_config))
FAMILY = register(Toy(
    name=NAME, kinds=(VIT_EMBED, VIT_LAYER, LINEAR_PROJECTOR, LLM_EMBED, LLM_LAYER, LLM_HEAD),
    vision_spec=VisionSpec, vision_item="tile",
    presets={"toy-tiny": _INTERNVL_TINY.replace(name="toy-tiny", family=NAME)},
    capabilities=dataclasses.replace(INTERNVL.capabilities, moe=False),  # no MoE kind in its unit list
    runtime=f"{__name__}:RUNTIME"))
