"""Qwen3-VL's run-time components (its unit kinds, ``kinds``, name them): the LLM layers with multimodal RoPE that
add DeepStack feature ``j`` to layer ``j``'s output at the image tokens, dense and MoE. The ViT (the patch embedding
with interpolated learned positions, the layers, the layers at DeepStack indexes that run the DeepStack mergers and
hand the features on as side tensors, the patch merger) and the LLM embedding are the Qwen lineage's, the head the
shared GPT decoder's.

Micro-batch fields read (besides the shared ``tokens``, ``labels``, ``cu_seqlens``, ``max_seqlen``, ...; all
host-built by ``batch.vision_fields``):

* ``pixel_values [patches, C*T*p*p]`` (processor order), ``vision_pos_index [patches, 4]`` / ``vision_pos_weight
  [patches, 4]`` (the position table's bilinear taps) -- the patch embedding;
* ``vision_rotary_ids [patches, 2]``, ``vision_cu_seqlens`` / ``vision_max_seqlen`` (int32 host bounds, one
  segment per frame of each image) -- the ViT layers;
* ``mrope_position_ids [3, b, s]`` -- the LLM layers.

Patches stay in processor order (no windows), so the merger's output rows are the image tokens in text order, and
so are every DeepStack feature's rows (side tensor ``deepstack.{j}``: ``[image tokens, 1, LLM hidden]``).
"""
from __future__ import annotations

import functools

import torch

from omnibal_ext.model.spec import HEAD

from megatron.vlm.lineages.qwen.modules import vision_slots
from megatron.vlm.lineages.qwen.text import MRopeTextLayer
from megatron.vlm.lineages.qwen.vision_costs import deepstack_name
from megatron.vlm.parallel import sequence_parallel
from megatron.vlm.parallel.context_parallel import context_parallel_group, gather_rows
from megatron.vlm.stage.components import MoETextLayer
from megatron.vlm.stage.text import run_text_blocks


class DeepStackTextLayer(MRopeTextLayer):
    """Qwen3 decoder layers with multimodal RoPE (Qwen2.5-VL's ``MRopeTextLayer``); layer ``j`` below the number of
    DeepStack features is a block of its own, and DeepStack feature ``j`` (side tensor ``deepstack.{j}``) is added
    to its output at the image and video tokens (``mm_token_type_ids > 0``), as transformers'
    ``Qwen3VLTextModel._deepstack_process`` does (every micro-batch runs the ViT: one without images gets a stand-in
    image whose tokens no text token takes, so its features add nothing).

    Sequence parallelism: the feature is scattered over the micro-batch's tokens and this TP rank's slice added
    (``_add_feature``). Context parallelism: a rank's ViT makes its own images' features; each DeepStack layer
    gathers them over the CP group and picks its tokens' rows (``_tokens_features``), so the side tensor keeps the
    rows of the images the rank ran (``deepstack.{j}``: the planning side's ``SideTensor`` list is unchanged)."""

    reads = frozenset({"packing", "tokens"})  # the tokens say where the image tokens are

    def block_slots(self, module) -> tuple[int | None, ...]:
        """Per block of ``module`` (``build``: a block of its own per layer below the number of DeepStack features,
        then the rest's blocks): the DeepStack feature added after it, or None."""
        k = len(self.spec.vision.deepstack_visual_indexes)
        first = tuple(u.layer for u in self.units if u.layer < k)
        return first + (None,) * (len(module) - len(first))

    @functools.cached_property
    def sp_edges(self):
        return self.ctx.sequence_parallel_edges(self.units, self.ctx.language_config, (HEAD,))

    def build(self):
        units = self.units
        k = len(self.spec.vision.deepstack_visual_indexes)
        first, rest = [u for u in units if u.layer < k], [u for u in units if u.layer >= k]
        blocks = torch.nn.ModuleList()
        for unit in first:
            blocks.extend(self.ctx.build_layers([unit], self.ctx.language_config, self.layer_spec, self.code(),
                                                lora_linears=self.lora_linears))
        if rest:
            more = self.ctx.build_layers(rest, self.ctx.language_config, self.layer_spec, self.code(),
                                         lora_linears=self.lora_linears)
            blocks.extend(more)
        return blocks

    @staticmethod
    def _tokens_features(feature, batch):
        """The DeepStack feature rows of this rank's image tokens: the feature itself, or under context
        parallelism (the rank's images' rows) every CP rank's rows gathered and this rank's tokens' picked, as the
        LLM embedding does with the merger's output (``vision_rank_tokens``, ``image_feature_index``; backward:
        each rank's rows get the gradients every rank's tokens put on them)."""
        if batch.cp is None or batch.cp.image_feature_index is None:
            return feature
        feature = gather_rows(feature, batch.cp.vision_rank_tokens, context_parallel_group())
        return feature.index_select(0, batch.cp.image_feature_index.to(feature.device))

    def _add_feature(self, x, feature, batch):
        """``x`` plus DeepStack ``feature`` [image tokens, 1, H] at the image tokens. Under sequence parallelism
        ``x`` is this TP rank's slice of the tokens: the feature, scattered over all the micro-batch's tokens, is
        split like them (``sequence_parallel.enter``: its backward all-gathers the slices' gradients, so every TP
        rank's merger gets the whole feature's gradient, as it got the whole input)."""
        mask = vision_slots(batch.text.tokens, batch.vision.mm_token_type_ids, self.ctx.img_context_id)
        mask = mask.reshape(-1).to(x.device)
        full = torch.zeros(mask.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device)
        full = full.masked_scatter(mask.reshape(-1, 1, 1), feature.to(x.dtype))
        if self.ctx.language_config.sequence_parallel:
            full = sequence_parallel.enter(full)
        return x + full

    def forward(self, module, x, batch, cache):
        return self._forward(module, self.block_slots(module), x, batch, cache,
                             lambda slot: self._tokens_features(cache.take_side(deepstack_name(slot)), batch))

    def _forward(self, module, slots, x, batch, cache, feature_of):
        if self.sp_enters:
            x = sequence_parallel.enter(x)
        context = self.context(module, batch, cache)
        for block, slot in zip(module, slots):
            x = run_text_blocks([block], x, context, self.ctx.impl.thd)
            if slot is not None:
                x = self._add_feature(x, feature_of(slot), batch)
        return sequence_parallel.leave(x) if self.sp_leaves else x

    def profile_forward(self, module, x, batch, cache):
        """The first layer, adding a zero DeepStack feature where it takes one (the profiler runs each unit alone:
        the ViT's features are not held)."""
        def zero_feature(slot):
            tokens = int(vision_slots(batch.text.tokens, batch.vision.mm_token_type_ids, self.ctx.img_context_id).sum())
            return x.new_zeros(tokens, 1, self.spec.language.hidden_size)

        return self._forward(module[:1], self.block_slots(module)[:1], x, batch, cache, zero_feature)


class DeepStackMoETextLayer(MoETextLayer, DeepStackTextLayer):
    """Qwen3-VL-MoE's MoE decoder layers: the shared MoE layer (megatron-core's MoELayer, the router's padding mask)
    run as ``DeepStackTextLayer`` runs its layers (multimodal RoPE, DeepStack feature ``j`` added after layer
    ``j``)."""
