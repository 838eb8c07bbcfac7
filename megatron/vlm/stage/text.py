"""The GPT decoder's input side, shared by every family: the vocabulary-parallel token embedding (image
features written into the image-context slots) and what the LLM layers take per micro-batch.

Packed sequences.  The LLM runs in megatron-core's THD convention: the collate's host-built ``cu_seqlens``
(each sample, each run of padding, over the flattened micro-batch) become one
``PackedSeqParams(qkv_format="thd")`` per micro-batch (``TextContext.build``), passed to every LLM
TransformerBlock; RoPE restarts in each segment (megatron-core's ``apply_rotary_pos_emb`` with
``cu_seqlens``) and the core attention (``SegmentAttention`` on the local spec, TransformerEngine's fused
attention on the TE spec) stays causal within each segment.  Only ``--attention-backend unfused``
(megatron-core's ``DotProductAttention``, which refuses THD) gets the dense block-diagonal mask: its blocks
see ``[sequence, rows, hidden]``, converted at the LLM entry and exit (``run_text_blocks``), so stages
carry one shape.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core.packed_seq_params import PackedSeqParams

from megatron.vlm.layers.attention import segment_params
from megatron.vlm.parallel.context_parallel import context_parallel_group
from megatron.vlm.stage.micro_batch import MicroBatch

from omnibal_ext.model.spec import ModelSpec


def word_embedding(spec: ModelSpec, config: TransformerConfig) -> tensor_parallel.VocabParallelEmbedding:
    """The vocabulary-parallel token embedding (drawn first in the text-embedding unit's seed; a tied output
    layer on another stage draws the same weights the same way)."""
    return tensor_parallel.VocabParallelEmbedding(
        spec.language.vocab_size, spec.language.hidden_size, init_method=config.init_method, config=config)


class TextEmbedding(MegatronModule):
    """Token embedding (vocabulary-parallel) with image features written into image-context slots.

    tokens [b, s] and image features [n * T, 1, H] -> [b * s, 1, H] (rows flattened: THD).
    tokens_per_item: image tokens per vision item (fixed-size tiles: per tile).
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig, img_context_id: int, tokens_per_item: int):
        super().__init__(config=config)
        self.word = word_embedding(spec, config)
        self.img_context_id = img_context_id
        self.tokens_per_tile = tokens_per_item

    def forward(self, tokens, image_features, image_tile_index, feature_index=None):
        """image_tile_index: the real tiles' indices (host-built by the collate, which also checks that the
        image-context tokens number real tiles x tokens per tile: no count is read back here).
        feature_index: under context parallelism, which image feature (of all the real tiles') each of this
        rank's image-context tokens takes (megatron/vlm/parallel/context_parallel.py); None: all, in order."""
        emb = self.word(tokens.reshape(1, -1))  # [1, t, H], t = b * s
        feats = image_features.squeeze(1).reshape(-1, self.tokens_per_tile, emb.shape[-1])
        feats = feats.index_select(0, image_tile_index).reshape(-1, emb.shape[-1])
        if feature_index is not None:
            feats = feats.index_select(0, feature_index)
        slots = (tokens == self.img_context_id).reshape(1, -1, 1)
        if feats.shape[0] == 0:  # no image: every token is text (a generation's decode step may emit the context id)
            slots = torch.zeros_like(slots)  # the (empty) features stay in the graph: the ViT's backward still runs
        emb = emb.masked_scatter(slots, feats.to(emb.dtype))
        return emb.transpose(0, 1).contiguous()  # [t, 1, H]


def packed_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask [b, 1, s, s] (True = masked) from segment ids (-1 = padding).

    Tokens attend only to earlier tokens of the same packed sample; padding attends to itself.
    """
    s = segment_ids.shape[1]
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = same & causal & (segment_ids.unsqueeze(1) >= 0)
    allowed |= torch.eye(s, dtype=torch.bool, device=segment_ids.device)
    return (~allowed).unsqueeze(1)


@dataclasses.dataclass(frozen=True)
class TextContext:
    """What the LLM blocks take besides the hidden states (their keyword arguments), built once per micro-batch:
    the dense mask (None under THD), the rotary angles, the packed-sequence parameters (None: dense) and, for MoE
    layers, the router's token mask (``padding_mask``; None for dense layers)."""

    attention_mask: torch.Tensor | None
    rotary_pos_emb: torch.Tensor
    packed_seq_params: PackedSeqParams | None = None
    padding_mask: torch.Tensor | None = None

    def block_inputs(self) -> dict:
        """The keyword arguments of a megatron-core ``TransformerBlock`` call."""
        return {"attention_mask": self.attention_mask, "rotary_pos_emb": self.rotary_pos_emb,
                "packed_seq_params": self.packed_seq_params, "padding_mask": self.padding_mask}


def text_context(batch: MicroBatch, rotary, thd: bool, device=None) -> TextContext:
    """What the LLM blocks take besides the hidden states, built once per micro-batch.

    THD: ``packed_seq_params`` from the host-built ``cu_seqlens`` (kept on the host, ``device`` None, for the
    local spec, where SegmentAttention and megatron-core's unfused RoPE read them; on the device for
    TransformerEngine) and RoPE frequencies for ``max_seqlen`` positions, which megatron-core's
    ``apply_rotary_pos_emb`` restarts in every segment.  Dense (unfused): the block-diagonal mask
    [b, 1, s, s] and per-token frequencies [s, b, 1, d] gathered at ``position_ids``.
    """
    max_seqlen = int(batch.packing.max_seqlen)
    if thd and batch.packing.decode is not None:  # generation: positions continue past each sequence's cache
        params = segment_params(batch.packing.cu_seqlens, max_seqlen, device, decode=batch.packing.decode)
        positions = batch.packing.position_ids.reshape(-1)
        # one frequency row per token: megatron-core's THD RoPE then maps them by absolute offset
        rope = rotary(int(positions.max()) + 1, packed_seq=True)[positions.to(torch.long)]
        return TextContext(None, rope, params)
    if thd:
        params = segment_params(batch.packing.cu_seqlens, max_seqlen, device, context_parallel_group())
        # tokens of the (unsplit) micro-batch (tokens are only where the embedding is)
        t = params.segments[-1][1] * (params.cp.size if params.cp is not None else 1)
        # megatron-core maps frequencies by absolute offset when there are exactly t of them (and reads
        # each segment's start with .item()); one more keeps it on the restart-per-segment mapping
        rope = rotary(max_seqlen + 1 if max_seqlen == t else max_seqlen, packed_seq=True)  # whole: no CP slicing
        return TextContext(None, rope, params)
    rope = rotary(max_seqlen)[:, 0][batch.packing.position_ids.transpose(0, 1)]
    return TextContext(packed_causal_mask(batch.packing.segment_ids), rope)


def run_text_blocks(blocks, x: torch.Tensor, context: TextContext, thd: bool) -> torch.Tensor:
    """LLM blocks on x [b * s, 1, H] -> [b * s, 1, H] (dense: through [s, b, H], DotProductAttention's layout)."""
    inputs = context.block_inputs()
    if thd:
        for block in blocks:
            x = block(hidden_states=x, **inputs)
        return x
    b, s = context.attention_mask.shape[0], context.attention_mask.shape[-1]
    x = x.reshape(b, s, -1).transpose(0, 1)
    for block in blocks:
        x = block(hidden_states=x, **inputs)
    return x.transpose(0, 1).reshape(b * s, 1, -1)
