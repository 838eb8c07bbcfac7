"""Qwen2.5-VL's run-time components (its unit kinds, ``kinds``, name them): the patch embedding, the window- and
full-attention ViT layers (two kinds, one place in the stage) and the patch merger; the LLM embedding with image
features and the LLM layers with multimodal RoPE are the Qwen lineage's (``megatron.vlm.lineages.qwen.text``), the
head the shared GPT decoder's.

Micro-batch fields read (besides the shared ``tokens``, ``labels``, ``cu_seqlens``, ``max_seqlen``, ...):

* ``pixel_values [patches, C*T*p*p]`` (processor order), ``vision_patch_index [patches]`` (window order:
  ``x[vision_patch_index]``) -- the patch embedding;
* ``vision_rotary_ids [patches, 2]`` (window order), ``vision_cu_window_seqlens`` / ``vision_max_window_seqlen``
  (windows) and ``vision_cu_seqlens`` / ``vision_max_seqlen`` (images, one segment per frame): int32 host
  boundaries in patch tokens -- the ViT layers;
* ``vision_merged_inverse [image tokens]`` (back to processor order) -- the merger;
* ``mm_token_type_ids [b, s]`` (1 image, 2 video token: where the merged features go, in order) -- the LLM
  embedding;
* ``mrope_position_ids [3, b, s]`` (temporal, height, width) -- the LLM layers;
* under context parallelism (``data.QwenBatcher.split_cp``): the ViT fields of this rank's whole images,
  ``mrope_position_ids [3, 1, t]`` of the padded unsplit micro-batch, and ``image_feature_index`` /
  ``vision_rank_tokens`` -- the LLM embedding.

``batch.logits_batch`` makes them from transformers' inputs; ``vision_windows`` and ``positions`` compute them.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from .modules import PatchMerger, vision_layer_spec
from megatron.vlm.layers.attention import segment_params
from megatron.vlm.layers.drop_path import iteration_keys, layer_rates, with_drop_path
from megatron.vlm.lineages.qwen.modules import PatchEmbedding, vision_rotary
from megatron.vlm.parallel import sequence_parallel
from megatron.vlm.parallel.padded_heads import tp_rank
from megatron.vlm.stage.components import PaddedHeadLayers, RuntimeComponent
from megatron.vlm.stage.micro_batch import MicroBatch


@dataclasses.dataclass(frozen=True)
class WindowedVitContext:
    """What the ViT layers of one micro-batch share (``_VisionLayers.context``): the 2-D rotary angles (padded rows
    zero), the patch count, the count padded for sequence parallelism, the drop-path keys (None without drop path)
    and the packed parameters of the window and the full-attention layers."""

    rope: torch.Tensor
    patches: int
    padded: int
    keys: torch.Tensor | None
    window: object
    full: object

class VisionEmbed(RuntimeComponent):
    """Patch rows -> Conv3d patch embedding -> window order [patches, 1, H]."""

    attr = "vit_embed"

    def build(self):
        return PatchEmbedding(self.spec, self.ctx.vision_config)

    def forward(self, module, x, batch, cache):
        x = module(batch.vision.pixel_values)
        return x.index_select(0, batch.vision.vision_patch_index.to(x.device)).unsqueeze(1)


class _VisionLayers(PaddedHeadLayers):
    """ViT layers over the packed patch tokens [patches, 1, H] (THD, one segment per window or per image,
    no mask), 2-D RoPE; heads padded to a multiple of TP. Both kinds live in the stage's ``vit_blocks``.

    Sequence parallelism: the patches are padded once to a multiple of TP (the pads one more segment of both
    kinds' bounds, zero RoPE) and split where the ViT's layers start; window and full-attention runs share the
    region (it is left where the ViT's layers end, and the pads cut off)."""

    attr, layers = "vit_blocks", True
    window = False

    def layer_spec(self, first_unit_index: int):
        ctx = self.ctx
        spec = vision_layer_spec(ctx.seed, first_unit_index, ctx.impl,
                                 self.spec.vision.num_attention_heads)
        if ctx.vision_drop_path_rate > 0:  # per image: every patch row of an image takes its image's key
            first = next(u.index for u in ctx.units if u.code == self.code())
            with_drop_path(spec, first, layer_rates(ctx.vision_drop_path_rate, self.spec.vision.num_layers), axis=0)
        return spec

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.vision_config)

    def build(self):
        units = self.units
        return self.ctx.build_layers(units, self.ctx.vision_config, self.layer_spec, self.code())

    def context(self, batch: MicroBatch, device) -> "WindowedVitContext":
        """RoPE and the packed parameters of both kinds, built once per micro-batch (held in the ``StageCache``);
        the patch count and the count padded for sequence parallelism."""
        v, cfg = self.spec.vision, self.ctx.vision_config
        patches = int(batch.vision.vision_cu_seqlens[-1])
        padded = patches
        if cfg.sequence_parallel:
            padded = sequence_parallel.padded_tokens(patches, cfg.tensor_model_parallel_size)
        rope = vision_rotary(batch.vision.vision_rotary_ids.to(device), v.head_dim, v.rotary_base)
        rope = F.pad(rope, (0, 0, 0, 0, 0, 0, 0, padded - patches))
        te = self.ctx.impl.transformer_engine

        def params(cu_seqlens, max_seqlen):
            return segment_params(*sequence_parallel.with_pad_segment(cu_seqlens, max_seqlen, padded),
                                  device if te else None)

        return WindowedVitContext(rope, patches, padded, self.drop_path_keys(batch, padded, device),
                                  params(batch.vision.vision_cu_window_seqlens, batch.vision.vision_max_window_seqlen),
                                  params(batch.vision.vision_cu_seqlens, batch.vision.vision_max_seqlen))

    def drop_path_keys(self, batch: MicroBatch, padded: int, device):
        """Drop path (training only): this iteration's key of each of the rows the layers run, [rows] int64 on
        ``device`` -- the patches' image keys (``tile_keys``, processor order) in window order, padded to ``padded``
        rows and, under sequence parallelism, this TP rank's rows; None without drop path."""
        if not (self.ctx.vision_drop_path_rate > 0 and batch.vision.tile_keys is not None):
            return None
        keys = batch.vision.tile_keys.to(device).index_select(0, batch.vision.vision_patch_index.to(device))
        keys = F.pad(iteration_keys(keys, self.ctx.seed, batch.iteration), (0, padded - len(keys)))
        cfg = self.ctx.vision_config
        if cfg.sequence_parallel:
            rows = padded // cfg.tensor_model_parallel_size
            keys = keys[tp_rank(cfg) * rows:(tp_rank(cfg) + 1) * rows]
        return keys

    def forward(self, module, x, batch, cache):
        c = cache.once(WindowedVitContext, lambda: self.context(batch, x.device))
        if self.sp_enters:
            x = sequence_parallel.enter(F.pad(x, (0, 0, 0, 0, 0, c.padded - c.patches)))
        params = c.window if self.window else c.full
        keys = c.keys if module.training else None  # drop path: the blocks' context (saved for recompute)
        for block in module:
            x = block(hidden_states=x, attention_mask=None, rotary_pos_emb=c.rope, packed_seq_params=params,
                      context=keys)
        if self.sp_leaves:
            x = sequence_parallel.leave(x)[:c.patches]
        return x


class WindowLayer(_VisionLayers):
    """ViT layers attending within each window (``vision_cu_window_seqlens``)."""

    window = True


class FullLayer(_VisionLayers):
    """ViT layers attending over each whole image (``vision_cu_seqlens``): ``fullatt_block_indexes``."""

    window = False


class Merger(RuntimeComponent):
    """The 2x2 patch merger (projector); its output put back in processor order [image tokens, 1, Hl]."""

    attr = "projector"

    def build(self):
        # replicated over TP (full inputs, its RMSNorm whole on every rank) also under sequence parallelism
        return PatchMerger(self.spec, self.ctx.vision_config,
                           dataclasses.replace(self.ctx.language_config, sequence_parallel=False))

    def forward(self, module, x, batch, cache):
        y = module(x)
        return y.index_select(0, batch.vision.vision_merged_inverse.to(y.device))
