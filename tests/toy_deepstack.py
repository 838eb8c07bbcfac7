"""A toy family with DeepStack-like side tensors, defined outside megatron/ and omnibal_ext/: InternVL's tiny model
whose ViT layers ``PRODUCERS`` each feed a small merger (pixel shuffle, one Linear into the LLM's width) whose output
(side tensor ``deepstack.k``) is added to the output of LLM layer ``CONSUMERS[k]`` at the image-token positions.

Importing it registers its ``Family`` (preset ``toy-deepstack``: InternVL's unit list with two kinds of its own, the
ViT layer and the LLM layer, whose run-time components here make and take the side tensors; run-time side ``RUNTIME``,
a ``FamilyRuntime``, named by ``Family.runtime``) through the public ``omnibal_ext.model.families.register``, so the
trainer takes it with ``--family-module tests/toy_deepstack.py --model toy-deepstack``; ``unregister()`` takes it out
again.

The mergers sit in their ViT layer's module (attribute ``side_merger`` of the TransformerLayer: checkpoint keys
``vit.layer.<i>.side_merger.*``) and have the projector's role (``parameter_role``): --freeze-vit leaves them training.
Consumers handle every parallelism like the LLM embedding: under CP they gather the side tensor's rows over the CP
group and pick their tokens' features; under SP the addition is made full-length and scattered to this TP rank's
tokens (backward: all-gather), so every TP rank back-propagates the same full gradient into its replicated copy.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from omnibal_ext.model import families
from omnibal_ext.model.spec import HEAD, PROJECTOR, SideTensor
from omnibal_ext.model.units import build_units, get_preset

from megatron.vlm.families.internvl import INTERNVL, InternVL
from megatron.vlm.families.internvl.components import VisionLayer
from megatron.vlm.families.internvl.kinds import VIT_LAYER
from megatron.vlm.layers.config import vision_config
from megatron.vlm.layers.seeding import seeded
from megatron.vlm.parallel import sequence_parallel
from megatron.vlm.parallel.context_parallel import context_parallel_group, gather_rows, tile_ranges
from megatron.vlm.stage.components import FamilyRuntime, TextLayer
from megatron.vlm.stage.kinds import LLM_LAYER
from megatron.vlm.stage.text import run_text_blocks

NAME = "toy-deepstack"
PRODUCERS = (1, 2)  # ViT layers whose outputs feed a merger
CONSUMERS = (0, 2)  # LLM layers whose outputs get the merger's feature
MERGER_SEED = 7919  # the mergers' init stream: seeded(seed, MERGER_SEED + unit index)


def toy_spec():
    return get_preset("tiny").replace(name=NAME, family=NAME)


def split_at(units, cuts):
    """``units`` (a run of layer units) cut after every unit whose index is in ``cuts``."""
    runs, run = [], []
    for u in units:
        run.append(u)
        if u.index in cuts:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def build_split(component, units, config, cuts):
    blocks = torch.nn.ModuleList()
    for run in split_at(units, cuts):
        blocks.extend(component.ctx.build_layers(run, config, component.layer_spec, component.code()))
    return blocks


def block_ends(module, first_index):
    """(block, index of the unit its last layer is) for each block of ``module``."""
    at = first_index - 1
    for block in module:
        at += len(block.layers)
        yield block, at


class Merger(torch.nn.Module):
    """[1 + P, n, Hv] -> drop the class token -> pixel shuffle -> Linear -> [n * tokens per tile, Hl]."""

    def __init__(self, spec):
        super().__init__()
        self.grid = int(round(spec.vision.patches_per_tile ** 0.5))
        self.factor = int(round(1 / spec.downsample_ratio))
        self.fc = torch.nn.Linear(spec.projector_in_size, spec.language.hidden_size)
        torch.nn.init.normal_(self.fc.weight, std=spec.init_method_std)
        torch.nn.init.zeros_(self.fc.bias)

    def forward(self, vit_out):
        x = vit_out[1:].transpose(0, 1)
        n, _, h = x.shape
        g, f = self.grid, self.factor
        x = x.reshape(n, g // f, f, g // f, f, h).permute(0, 1, 3, 2, 4, 5).reshape(n * (g // f) ** 2, f * f * h)
        return self.fc(x)


class DeepStackVisionLayer(VisionLayer):
    def sides(self):
        return {s.producer: s.name for s in FAMILY.side_tensors(self.spec)}

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.vision_config)

    @property
    def first(self):
        return self.units[0].index

    def build(self):
        units = self.units
        blocks = build_split(self, units, self.ctx.vision_config, set(self.sides()))
        layer_of = dict(zip([u.index for u in units], (layer for b in blocks for layer in b.layers)))
        for index in self.sides():
            if index in layer_of:
                with seeded(self.ctx.seed, MERGER_SEED + index):
                    layer_of[index].side_merger = Merger(self.spec).to(self.ctx.vision_config.params_dtype)
        return blocks

    def parameter_role(self, unit, name):
        return PROJECTOR if name.startswith("side_merger.") else unit.code

    def forward(self, module, x, batch, cache):
        mask, cfg = None, self.ctx.vision_config
        tokens = self.spec.vision.seq_per_tile
        if cfg.sequence_parallel:
            padded = sequence_parallel.padded_tokens(tokens, cfg.tensor_model_parallel_size)
            if self.sp_enters:
                x = sequence_parallel.enter(F.pad(x, (0, 0, 0, 0, 0, padded - tokens)))
            mask = sequence_parallel.vit_pad_mask(tokens, padded, x.device)
        sides = self.sides()
        for block, last in block_ends(module, self.first):
            x = block(hidden_states=x, attention_mask=mask)
            if last in sides:
                full = sequence_parallel.leave(x)[:tokens] if cfg.sequence_parallel else x
                cache.put_side(sides[last], block.layers[-1].side_merger(full))
        if cfg.sequence_parallel and self.sp_leaves:
            x = sequence_parallel.leave(x)[:tokens]
        return x


class DeepStackTextLayer(TextLayer):
    def sides(self):
        return {c: s.name for s in FAMILY.side_tensors(self.spec) for c in s.consumers}

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.language_config, (HEAD,))

    @property
    def first(self):
        return self.units[0].index

    def build(self):
        return build_split(self, self.units, self.ctx.language_config, set(self.sides()))

    def addition(self, feature, batch, like):
        """The side tensor's rows at this rank's image-token positions, zeros elsewhere: [t, 1, H]."""
        T, H = self.spec.tokens_per_tile, like.shape[-1]
        group = context_parallel_group()
        if group is not None:
            counts = [len(r) * T for r in tile_ranges(batch.cp.num_tiles, group.size())]
            feature = gather_rows(feature, counts, group)
        feats = feature.reshape(-1, T, H).index_select(0, batch.vision.image_tile_index).reshape(-1, H)
        if batch.cp is not None:
            feats = feats.index_select(0, batch.cp.image_feature_index)
        slots = (batch.text.tokens == self.ctx.img_context_id).reshape(-1, 1, 1)
        full = torch.zeros(slots.shape[0], 1, H, dtype=like.dtype, device=like.device)
        return full.masked_scatter(slots, feats.to(like.dtype))

    def forward(self, module, x, batch, cache):
        if self.sp_enters:
            x = sequence_parallel.enter(x)
        sp = self.ctx.language_config.sequence_parallel
        context, sides = self.context(module, batch, cache), self.sides()
        for k, (block, last) in enumerate(block_ends(module, self.first)):
            x = run_text_blocks(module[k:k + 1], x, context, self.ctx.impl.thd)
            if last in sides:
                add = self.addition(cache.take_side(sides[last]), batch, x)
                x = x + (sequence_parallel.enter(add) if sp else add)
        return sequence_parallel.leave(x) if self.sp_leaves else x


# the two kinds of its own: InternVL's with the run-time components above (the LLM layer reads the tokens too: where
# the image tokens are); no Hugging Face mapping (the family has no HF side)
DEEPSTACK_VIT_LAYER = dataclasses.replace(VIT_LAYER, runtime=f"{__name__}:DeepStackVisionLayer", hf="")
DEEPSTACK_TEXT_LAYER = dataclasses.replace(LLM_LAYER, runtime=f"{__name__}:DeepStackTextLayer",
                                           reads={"packing", "tokens"}, hf="")
OWN_KINDS = {VIT_LAYER: DEEPSTACK_VIT_LAYER, LLM_LAYER: DEEPSTACK_TEXT_LAYER}  # InternVL's kind -> this family's


class ToyDeepStack(InternVL):
    """InternVL's unit list with the two kinds above, and side tensors from the ViT layers ``PRODUCERS`` to the LLM
    layers ``CONSUMERS``."""

    def unit_list(self, spec):
        return [(name, OWN_KINDS.get(kind, kind), layer) for name, kind, layer in super().unit_list(spec)]

    def side_tensors(self, spec):
        units = build_units(spec)
        vit = [u.index for u in units if u.code == "v"]
        llm = [u.index for u in units if u.code == "t"]
        return tuple(SideTensor(f"deepstack.{k}", vit[p], (llm[c],), spec.language.hidden_size)
                     for k, (p, c) in enumerate(zip(PRODUCERS, CONSUMERS)) if p < len(vit) and c < len(llm))


FAMILY = ToyDeepStack(
    name=NAME, vision_spec=INTERNVL.vision_spec, vision_item="tile", presets={NAME: toy_spec()},
    kinds=tuple(OWN_KINDS.get(k, k) for k in INTERNVL.kinds),
    capabilities=dataclasses.replace(INTERNVL.capabilities, moe=False), runtime=f"{__name__}:RUNTIME")
RUNTIME = FamilyRuntime(vision_config=vision_config, data=INTERNVL.load_runtime().data)


def register():
    """The family, through the public ``register`` (again: a no-op)."""
    families.register(FAMILY)


def unregister():
    families.unregister(NAME)


register()
