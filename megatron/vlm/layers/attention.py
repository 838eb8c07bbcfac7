"""Core attention over packed samples (THD), for megatron-core's local (torch) layer spec.

The LLM layers run in megatron-core's packed-sequence convention: hidden states ``[t, 1, h]`` (the
micro-batch's rows flattened into ``t = b * s`` tokens) and a ``PackedSeqParams(qkv_format="thd")``
whose ``cu_seqlens_q`` cut ``t`` into segments (each sample, each run of padding).  megatron-core's
``SelfAttention`` then hands the core attention query ``[t, np, hn]`` and key/value ``[t, ng, hn]``
and applies RoPE per segment (``apply_rotary_pos_emb`` with ``cu_seqlens``).

megatron-core's own ``DotProductAttention`` refuses packed sequences (it takes a dense ``[b, 1, s, s]``
mask and computes every score of the row).  ``SegmentAttention`` replaces it as the ``core_attention``
submodule of the local spec: each segment is attended causally on its own with
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa``: key/value groups are not copied
to every query head).  A packed row then costs the sum of squared lengths, as FlashAttention's
variable-length kernels do on GPU (and as ``omnibal_ext.model.cost_model`` counts).  Padding segments
attend among themselves; their outputs never reach a real token.

The segment boundaries are Python ints, read once per micro-batch from the host-built ``cu_seqlens``
(``SegmentParams.segments``, made by ``segment_params``): no layer touches a tensor on the host or
waits for the device.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron.vlm.parallel.context_parallel import CPSegments, all_gather_cp, cp_segments


@dataclasses.dataclass
class SegmentParams(PackedSeqParams):
    """megatron-core's PackedSeqParams plus the segments of ``cu_seqlens_q`` as host (start, end) pairs."""

    segments: tuple[tuple[int, int], ...] = ()
    cp: CPSegments | None = None  # context parallelism: this rank's view of the segments (else None)
    # generation: the decode step whose caches the layers read and extend (megatron.vlm.inference.cache.DecodeStep:
    # SegmentAttention's keys and values, the Gated DeltaNet's states); None: a training or logits forward
    decode: object | None = None


def segment_params(cu_seqlens: Tensor, max_seqlen: int, device: torch.device | None = None,
                   cp_group=None, decode=None) -> SegmentParams:
    """THD parameters of a micro-batch from its host-built ``cu_seqlens`` (int32, on the host).

    device: where ``cu_seqlens_q/kv`` go (TransformerEngine's kernels read them on the GPU); None keeps
    them on the host, which is where megatron-core's unfused THD RoPE reads them (``.tolist()``).
    cp_group: the context-parallel group when it has more than one rank: ``cu_seqlens`` then describe the padded,
    unsplit micro-batch (megatron/vlm/parallel/context_parallel.py) and ``segments`` this rank's part of each segment.
    decode: generation's decode step (``SegmentParams.decode``; the micro-batch's ``PackingPart.decode``), or None.
    """
    if cu_seqlens.device.type != "cpu":
        raise ValueError("segment_params: cu_seqlens must be built on the host")
    bounds = cu_seqlens.tolist()
    cu = cu_seqlens if device is None else cu_seqlens.to(device, non_blocking=True)
    cp = None
    if cp_group is not None and cp_group.size() > 1:
        cp = cp_segments(bounds, cp_group)
        bounds = [b // cp.size for b in bounds]
    return SegmentParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                         max_seqlen_kv=int(max_seqlen), segments=tuple(zip(bounds[:-1], bounds[1:])), cp=cp,
                         decode=decode)


class SegmentAttention(DotProductAttention):
    """Attention within each packed segment (THD: causal, or bidirectional for ``no_mask`` layers such as a
    ViT's packed images or windows), or over the whole sequence (no_mask/causal, sbhd).

    THD (``packed_seq_params`` given): query [t, np, hn], key/value [t, ng, hn] -> [t, np * hn].
    Otherwise as megatron-core's core attention: query [sq, b, np, hn], key/value [sk, b, ng, hn]
    (this TP rank's heads and key/value groups) -> [sq, b, np * hn]; a boolean ``attention_mask``
    (True = masked) is honoured.
    """

    def __init__(self, config, *args, **kwargs):
        unsupported = {"attention_dropout": config.attention_dropout, "window_size": config.window_size,
                       "softmax_type": None if config.softmax_type == "vanilla" else config.softmax_type}
        unsupported = {k: v for k, v in unsupported.items() if v}
        if unsupported:
            raise ValueError(f"SegmentAttention does not support {unsupported}; use --attention-backend unfused")
        # megatron-core's DotProductAttention asserts context_parallel_size == 1 (its CP lives in TE's attention);
        # this class does its own (``_thd_cp``), so the parent is built as for one rank and the config kept
        parent_config = config if config.context_parallel_size == 1 else \
            dataclasses.replace(config, context_parallel_size=1)
        super().__init__(parent_config, *args, **kwargs)
        self.config = config
        if config.apply_query_key_layer_scaling:  # the parent divides the scale by the layer number and
            self.softmax_scale *= self.layer_number  # its fused softmax multiplies it back; SDPA does not
        self.gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SegmentAttention: attention_bias is not supported")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
                raise ValueError("SegmentAttention: packed sequences are THD, without an attention mask")
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            return self._thd(query, key, value, packed_seq_params, causal=mask_type != AttnMaskType.no_mask)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError("SegmentAttention: a dense attention_mask must be boolean (True = masked); "
                                 "packed samples come as packed_seq_params")
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
                                                 enable_gqa=self.gqa)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=mask_type == AttnMaskType.causal,
                                                 scale=self.softmax_scale, enable_gqa=self.gqa)
        # [b, n, s, d] -> [s, b, n * d]
        return ctx.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _thd(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams, causal: bool = True) -> Tensor:
        segments = getattr(params, "segments", None)
        if not segments:  # a plain PackedSeqParams: read its boundaries (host work in every layer)
            bounds = params.cu_seqlens_q.tolist()
            segments = tuple(zip(bounds[:-1], bounds[1:]))
        t = query.shape[0]
        if getattr(params, "decode", None) is not None:  # generation: each segment's cached keys and values too
            return params.decode.attend(self, query, key, value, segments, causal)
        if getattr(params, "cp", None) is not None:
            return self._thd_cp(query, key, value, params.cp, t)
        if segments[-1][1] != t:
            raise ValueError(f"SegmentAttention: segments cover {segments[-1][1]} tokens of {t}")
        # [t, n, d] -> [1, n, t, d] (4-D: torch's CPU flash kernel takes no 3-D inputs, and the math
        # fallback would keep the scores)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
        parts = [F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=causal,
                                                scale=self.softmax_scale, enable_gqa=self.gqa)
                 for a, e in segments]
        ctx = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        # [1, n, t, d] -> [t, n * d]
        return ctx[0].transpose(0, 1).reshape(t, self.hidden_size_per_partition)

    def _thd_cp(self, query: Tensor, key: Tensor, value: Tensor, cp: CPSegments, t: int) -> Tensor:
        """Context parallelism: this rank's two chunks of every segment attend to the segment's keys and values
        gathered from the CP group, each query chunk to the keys up to it (causal, bottom-right aligned)."""
        if cp.kv_index.numel() != cp.size * t:
            raise ValueError(f"SegmentAttention: {t} local tokens, but the CP segments cover {cp.kv_index.numel()}")
        index = cp.kv_index.to(key.device)
        # [cp * t, ng, d] in rank order -> every segment's keys in order -> [1, ng, T, d]
        k, v = (all_gather_cp(x.contiguous(), cp.group).index_select(0, index).transpose(0, 1).unsqueeze(0)
                for x in (key, value))
        q = query.transpose(0, 1).unsqueeze(0)
        masks: dict = {}
        parts = []
        for local, c, start in cp.chunks:
            for half, i in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
                qs = q[:, :, local + half * c: local + (half + 1) * c]
                ks, vs = k[:, :, start: start + (i + 1) * c], v[:, :, start: start + (i + 1) * c]
                if i == 0:
                    parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.softmax_scale,
                                                                enable_gqa=self.gqa))
                    continue
                if (c, i) not in masks:  # query p of chunk i sees keys 0 .. i * c + p
                    keys = torch.arange((i + 1) * c, device=q.device)
                    masks[(c, i)] = keys.unsqueeze(0) <= (i * c + torch.arange(c, device=q.device)).unsqueeze(1)
                parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=masks[(c, i)],
                                                            scale=self.softmax_scale, enable_gqa=self.gqa))
        ctx = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return ctx[0].transpose(0, 1).reshape(t, self.hidden_size_per_partition)
