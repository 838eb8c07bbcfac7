"""The Qwen lineage's LLM side at run time: the image-text embedding (the merged vision tokens written into the
image-token slots, found from the token types) and the decoder layers with multimodal RoPE (3-D position ids,
``mrope_position_ids``), which every Qwen family's text layers build on.
"""
from __future__ import annotations

import functools

import torch

from .modules import ImageTokenEmbedding
from megatron.vlm.layers.attention import segment_params
from megatron.vlm.layers.rope import MultimodalRope
from megatron.vlm.parallel.context_parallel import context_parallel_group, gather_rows
from megatron.vlm.stage.components import TextEmbed, TextLayer
from megatron.vlm.stage.text import TextContext, packed_causal_mask


class ImageTextEmbed(TextEmbed):
    """Token embedding with the merged image features in the image-token slots (any number per image)."""

    def build(self):
        return ImageTokenEmbedding(self.spec, self.ctx.language_config, self.ctx.img_context_id)

    def forward(self, module, x, batch, cache):
        # context parallelism: every rank's images, then this rank's tokens'
        if batch.cp is not None and batch.cp.image_feature_index is not None:
            x = gather_rows(x, batch.cp.vision_rank_tokens, context_parallel_group())
            x = x.index_select(0, batch.cp.image_feature_index.to(x.device))
        return module(batch.text.tokens, x, batch.vision.mm_token_type_ids)


class MRopeTextLayer(TextLayer):
    """Decoder layers with multimodal RoPE: per-token frequencies from ``mrope_position_ids``
    (``megatron.vlm.layers.rope``: the LanguageSpec's ``mrope_section``, chunked as Qwen2.5-VL's or interleaved as
    Qwen3-VL's ``mrope_interleaved``); the layers are the shared TextLayer's (Qwen2.5 or Qwen3: per-head q/k norm
    where the spec says). THD: one frequency row per token of the flattened micro-batch, which megatron-core's
    ``apply_rotary_pos_emb`` maps by absolute offset, so the ids, not the segment, say the position (text after an
    image continues from the image's largest id).  Context parallelism: the ids come in the padded, unsplit layout
    (``QwenBatcher.split_cp``), one row per token of ``cu_seqlens``, so megatron-core takes this rank's chunks of
    the frequencies itself (its CP group passed in the packed parameters too)."""

    @functools.cached_property
    def rotary(self) -> torch.nn.Module:
        """The multimodal rotary table (parameter-free; the stage registers it: ``extra_modules``)."""
        lang = self.spec.language
        return MultimodalRope(lang.kv_channels, lang.rotary_base, lang.mrope_section, lang.mrope_interleaved)

    def extra_modules(self):
        return {"mrope": self.rotary}

    def context(self, module, batch, cache):
        return cache.once(TextContext, lambda: self._context(module, batch))

    def _context(self, module, batch) -> TextContext:
        device = next(module.parameters()).device
        ids = batch.vision.mrope_position_ids.to(device)  # [3, b, s]
        if self.ctx.impl.thd:
            te = self.ctx.impl.transformer_engine
            params = segment_params(batch.packing.cu_seqlens, int(batch.packing.max_seqlen), device if te else None,
                                    context_parallel_group(), decode=batch.packing.decode)
            # [t, 1, 1, d]: every token's (CP: of the padded unsplit layout, not sliced here: megatron-core's THD
            # RoPE takes this rank's chunks of every segment)
            rope = self.rotary(ids.reshape(3, 1, -1))
            return TextContext(None, rope, params)
        return TextContext(packed_causal_mask(batch.packing.segment_ids), self.rotary(ids))  # [s, b, 1, d]
