"""InternVL's run-time components (its unit kinds, ``kinds``, name them): InternViT's patch embedding and layers,
the pixel-shuffle projector."""
from __future__ import annotations

import dataclasses
import functools

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType

from .layers import layer_spec
from .modules import Projector, VisionEmbedding
from megatron.vlm.layers.drop_path import iteration_keys, layer_rates
from megatron.vlm.parallel import sequence_parallel
from megatron.vlm.stage.components import PaddedHeadLayers, RuntimeComponent


class VisionEmbed(RuntimeComponent):
    """Tiles [n, C, S, S] -> patch tokens plus a class token, with learned positions."""

    attr = "vit_embed"

    def build(self):
        return VisionEmbedding(self.spec, self.ctx.vision_config)

    def forward(self, module, x, batch, cache):
        return module(batch.vision.pixel_values)


class VisionLayer(PaddedHeadLayers):
    """InternViT layers: full attention within each tile (no mask), heads padded to a multiple of TP, and
    the layer features of the VisionSpec (qkv bias, qk-norm, layer scale)."""

    attr, layers = "vit_blocks", True

    def layer_spec(self, first_unit_index: int):
        v, ctx = self.spec.vision, self.ctx
        drop_path = None
        if ctx.vision_drop_path_rate > 0:
            first = next(u.index for u in ctx.units if u.code == self.code())
            drop_path = (first, tuple(layer_rates(ctx.vision_drop_path_rate, v.num_layers)))
        return layer_spec(v.normalization, AttnMaskType.no_mask, ctx.seed, first_unit_index, ctx.impl,
                          real_heads=v.num_attention_heads, vision=v, drop_path=drop_path)

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.vision_config)

    def build(self):
        units = self.units
        return self.ctx.build_layers(units, self.ctx.vision_config, self.layer_spec, self.code())

    def forward(self, module, x, batch, cache):
        mask, cfg = None, self.ctx.vision_config
        if cfg.sequence_parallel:  # tiles padded to a multiple of TP tokens, the pads masked out of attention
            tokens = self.spec.vision.seq_per_tile
            padded = sequence_parallel.padded_tokens(tokens, cfg.tensor_model_parallel_size)
            if self.sp_enters:
                x = sequence_parallel.enter(F.pad(x, (0, 0, 0, 0, 0, padded - tokens)))
            mask = sequence_parallel.vit_pad_mask(tokens, padded, x.device)
        keys = None  # drop path: the tiles' keys of this iteration, as the blocks' context (saved for recompute)
        if self.ctx.vision_drop_path_rate > 0 and module.training and batch.vision.tile_keys is not None:
            keys = iteration_keys(batch.vision.tile_keys, self.ctx.seed, batch.iteration)
        for block in module:
            x = block(hidden_states=x, attention_mask=mask, context=keys)
        if cfg.sequence_parallel and self.sp_leaves:
            x = sequence_parallel.leave(x)[:self.spec.vision.seq_per_tile]
        return x


class ProjectorUnit(RuntimeComponent):
    """ViT output -> drop class token -> pixel shuffle -> LayerNorm -> 2-layer MLP into the LLM's width."""

    attr = "projector"

    def build(self):
        # replicated over TP (full inputs, its LayerNorm whole on every rank) also under sequence parallelism
        return Projector(self.spec, dataclasses.replace(self.ctx.language_config, sequence_parallel=False))

    def forward(self, module, x, batch, cache):
        return module(x)
