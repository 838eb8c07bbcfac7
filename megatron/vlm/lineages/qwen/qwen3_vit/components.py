"""The Qwen3-VL ViT at run time (used by the Qwen families with that ViT): the patch embedding with interpolated
learned positions, the ViT layers (full attention per image), the ViT layers at DeepStack indexes (each also runs
its DeepStack merger and hands the feature on as a side tensor) and the patch merger.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from omnibal_ext.model.spec import PROJECTOR

from .modules import DeepStackDropPathLayer, DeepStackLayer, PatchMerger, VisionEmbedding, vision_layer_spec
from megatron.vlm.layers.attention import segment_params
from megatron.vlm.layers.drop_path import iteration_keys, layer_rates, with_drop_path
from megatron.vlm.lineages.qwen.modules import vision_rotary
from megatron.vlm.lineages.qwen.vision_costs import deepstack_name
from megatron.vlm.parallel import sequence_parallel
from megatron.vlm.parallel.padded_heads import tp_rank
from megatron.vlm.stage.components import PaddedHeadLayers, RuntimeComponent
from megatron.vlm.stage.micro_batch import MicroBatch
from megatron.vlm.stage.side import StageCache


@dataclasses.dataclass(frozen=True)
class VitContext:
    """What the ViT layers of one micro-batch share (``VisionLayers.context``): the 2-D rotary angles (padded rows
    zero), the patch count, the count padded for sequence parallelism, the drop-path keys (None without drop path)
    and the packed parameters (one segment per frame of each image, the padding one more)."""

    rope: torch.Tensor
    patches: int
    padded: int
    keys: torch.Tensor | None
    params: object

class VisionEmbed(RuntimeComponent):
    """Patch rows -> Conv3d patch embedding + interpolated learned positions -> [patches, 1, H]."""

    attr = "vit_embed"

    def build(self):
        return VisionEmbedding(self.spec, self.ctx.vision_config)

    def forward(self, module, x, batch, cache):
        device = module.proj.weight.device
        v = batch.vision
        x = module(v.pixel_values, v.vision_pos_index.to(device), v.vision_pos_weight.to(device))
        return x.unsqueeze(1)


def _merger_config(ctx):
    """The mergers' config: the LLM's, replicated inputs (never sequence parallel)."""
    return dataclasses.replace(ctx.language_config, sequence_parallel=False)


class VisionLayers(PaddedHeadLayers):
    """ViT layers over the packed patch tokens [patches, 1, H] (THD, one segment per image frame, no mask), 2-D
    RoPE; heads padded to a multiple of TP. Both layer kinds live in the stage's ``vit_blocks``.

    Sequence parallelism: the patches are padded once to a multiple of TP (the pads one more segment, zero RoPE)
    and split where the ViT's layers start; plain and DeepStack layers share the region (left where the ViT's
    layers end, the pads cut off).

    Drop path (``--vision-drop-path-rate``, ``megatron/vlm/layers/drop_path.py``): per image, each patch row taking its
    image's key (``tile_keys``, processor order: the rows' order), the blocks' ``context``."""

    attr, layers = "vit_blocks", True

    def layer_spec(self, first_unit_index: int):
        ctx = self.ctx
        return self.with_drop_path(vision_layer_spec(ctx.seed, first_unit_index, ctx.impl, self.spec.vision.num_attention_heads))

    def with_drop_path(self, spec):
        """``spec`` with drop path per image where the rate is > 0 (a ``DeepStackLayer`` stays one)."""
        ctx = self.ctx
        if ctx.vision_drop_path_rate <= 0:
            return spec
        deepstack = spec.module is DeepStackLayer
        first = next(u.index for u in ctx.units if u.code == self.code())
        with_drop_path(spec, first, layer_rates(ctx.vision_drop_path_rate, self.spec.vision.num_layers), axis=0)
        if deepstack:
            spec.module = DeepStackDropPathLayer
        return spec

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.vision_config)

    def build(self):
        units = self.units
        return self.ctx.build_layers(units, self.ctx.vision_config, self.layer_spec, self.code())

    def context(self, batch: MicroBatch, device) -> "VitContext":
        """RoPE and the packed parameters, built once per micro-batch (held in the ``StageCache``); the patch count
        and the count padded for sequence parallelism."""
        v, cfg = self.spec.vision, self.ctx.vision_config
        patches = int(batch.vision.vision_cu_seqlens[-1])
        padded = patches
        if cfg.sequence_parallel:
            padded = sequence_parallel.padded_tokens(patches, cfg.tensor_model_parallel_size)
        rope = vision_rotary(batch.vision.vision_rotary_ids.to(device), v.head_dim, v.rotary_base)
        rope = F.pad(rope, (0, 0, 0, 0, 0, 0, 0, padded - patches))
        te = self.ctx.impl.transformer_engine
        cu, longest = sequence_parallel.with_pad_segment(batch.vision.vision_cu_seqlens, batch.vision.vision_max_seqlen,
                                                         padded)
        return VitContext(rope, patches, padded, self.drop_path_keys(batch, padded, device),
                          segment_params(cu, longest, device if te else None))

    def drop_path_keys(self, batch: MicroBatch, padded: int, device):
        """Drop path (training only): this iteration's key of each of the rows the layers run, [rows] int64 on
        ``device`` -- the patches' image keys (``tile_keys``, processor order) padded to ``padded`` rows and, under
        sequence parallelism, this TP rank's rows; None without drop path."""
        if not (self.ctx.vision_drop_path_rate > 0 and batch.vision.tile_keys is not None):
            return None
        keys = iteration_keys(batch.vision.tile_keys.to(device), self.ctx.seed, batch.iteration)
        keys = F.pad(keys, (0, padded - len(keys)))
        cfg = self.ctx.vision_config
        if cfg.sequence_parallel:
            rows = padded // cfg.tensor_model_parallel_size
            keys = keys[tp_rank(cfg) * rows:(tp_rank(cfg) + 1) * rows]
        return keys

    def _context(self, x, batch, cache: StageCache) -> "VitContext":
        return cache.once(VitContext, lambda: self.context(batch, x.device))

    def _run(self, block, x, c):
        keys = c.keys if block.training else None  # drop path: the blocks' context (saved for recompute)
        return block(hidden_states=x, attention_mask=None, rotary_pos_emb=c.rope, packed_seq_params=c.params,
                     context=keys)

    def forward(self, module, x, batch, cache):
        c = self._context(x, batch, cache)
        if self.sp_enters:
            x = sequence_parallel.enter(F.pad(x, (0, 0, 0, 0, 0, c.padded - c.patches)))
        for block in module:
            x = self._run(block, x, c)
        if self.sp_leaves:
            x = sequence_parallel.leave(x)[:c.patches]
        return x


class DeepStackLayers(VisionLayers):
    """ViT layers at DeepStack indexes: one block per layer; after each, its DeepStack merger (a submodule of the
    layer) runs on the layer's output (all patches: gathered under sequence parallelism) and the feature is held as
    side tensor ``deepstack.{j}`` for LLM layer ``j``."""

    def layer_spec(self, first_unit_index: int):
        ctx, spec = self.ctx, self.spec
        merger_config = _merger_config(ctx)
        return self.with_drop_path(vision_layer_spec(
            ctx.seed, first_unit_index, ctx.impl, spec.vision.num_attention_heads,
            merger=lambda: PatchMerger(spec, merger_config, after_shuffle=True)))

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.vision_config)

    @functools.cached_property
    def slots(self) -> tuple[int, ...]:
        """Per block (one per layer): the DeepStack feature its merger makes."""
        return tuple(self.spec.vision.deepstack_slot(u.layer) for u in self.units)

    def build(self):
        units = self.units
        blocks = torch.nn.ModuleList()
        for unit in units:  # one block per layer: its output feeds the merger
            blocks.extend(self.ctx.build_layers([unit], self.ctx.vision_config, self.layer_spec, self.code()))
        return blocks

    def forward(self, module, x, batch, cache):
        c = self._context(x, batch, cache)
        if self.sp_enters:
            x = sequence_parallel.enter(F.pad(x, (0, 0, 0, 0, 0, c.padded - c.patches)))
        for block, slot in zip(module, self.slots):
            x = self._run(block, x, c)
            full = sequence_parallel.leave(x)[:c.patches] if self.ctx.vision_config.sequence_parallel else x
            cache.put_side(deepstack_name(slot), block.layers[-1].deepstack_merger(full))
        if self.sp_leaves:
            x = sequence_parallel.leave(x)[:c.patches]
        return x

    def profile_forward(self, module, x, batch, cache):
        """The first layer and its merger (the profiler runs it many times: its feature goes to a scratch cache)."""
        scratch, c = StageCache(), self._context(x, batch, cache)
        scratch.once(VitContext, lambda: c)
        return self.forward(module[:1], x, batch, scratch)

    def parameter_role(self, unit, name):
        """The DeepStack merger is the projector's (``--freeze-projector``, its learning rate), whatever stage runs
        it; the layer is the ViT's."""
        return PROJECTOR if name.startswith("deepstack_merger.") else unit.code


class Merger(RuntimeComponent):
    """The 2x2 patch merger (projector): [patches, 1, Hv] -> [image tokens, 1, Hl] (processor order: text order)."""

    attr = "projector"

    def build(self):
        # replicated over TP (full inputs, its LayerNorm whole on every rank) also under sequence parallelism
        return PatchMerger(self.spec, _merger_config(self.ctx))

    def forward(self, module, x, batch, cache):
        return module(x)
