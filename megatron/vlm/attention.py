"""Core attention over packed samples, for megatron-core's local (torch) layer spec.

megatron-core's ``DotProductAttention`` takes a dense ``[b, 1, s, s]`` mask and computes every score
of the row, so a packed row of ``n`` samples costs ``(sum of lengths)^2`` and a ``[s, s]`` mask per
layer.  ``SegmentAttention`` replaces it as the ``core_attention`` submodule of the layer spec: the
``attention_mask`` it receives is the micro-batch's segment ids ``[b, s]`` (an integer tensor: sample
index per token, -1 for padding, as the collate writes them), and each contiguous run of one id is
attended causally on its own with ``torch.nn.functional.scaled_dot_product_attention``.  A packed
row then costs the sum of squared lengths, as FlashAttention's variable-length kernels do on GPU
(and as ``omnibal_ext.model.cost_model`` counts).  Padding runs attend among themselves; their
outputs never reach a real token.

The segment ids travel as the ``attention_mask`` argument because megatron-core's full-layer
recompute saves its arguments with ``save_for_backward`` (tensors only).  Dense boolean masks
(True = masked) are still accepted, for callers that have one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.dot_product_attention import DotProductAttention


def segment_runs(segment_ids: Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``segment_ids`` [b, s], the (start, end) token ranges of its runs of equal ids."""
    out = []
    for row in segment_ids.cpu():
        _, counts = torch.unique_consecutive(row, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        out.append(list(zip([0] + ends[:-1], ends)))
    return out


class SegmentAttention(DotProductAttention):
    """Causal attention within each packed sample (or unmasked, for ``AttnMaskType.no_mask``).

    Inputs as megatron-core's core attention: query [sq, b, np, hn], key/value [sk, b, ng, hn]
    (this TP rank's heads and key/value groups); output [sq, b, np * hn].
    """

    def __init__(self, config, *args, **kwargs):
        unsupported = {"attention_dropout": config.attention_dropout, "window_size": config.window_size,
                       "softmax_type": None if config.softmax_type == "vanilla" else config.softmax_type}
        unsupported = {k: v for k, v in unsupported.items() if v}
        if unsupported:
            raise ValueError(f"SegmentAttention does not support {unsupported}; use --attention-backend unfused")
        super().__init__(config, *args, **kwargs)
        if config.apply_query_key_layer_scaling:  # the parent divides the scale by the layer number and
            self.softmax_scale *= self.layer_number  # its fused softmax multiplies it back; SDPA does not

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SegmentAttention: attention_bias and packed_seq_params are not supported; "
                             "pass the segment ids as attention_mask")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if attention_mask is None:
            ctx = F.scaled_dot_product_attention(q, k, v, scale=self.softmax_scale)
        elif attention_mask.dtype == torch.bool:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        else:
            ctx = self._segments(q, k, v, attention_mask)
        # [b, n, s, d] -> [s, b, n * d]
        return ctx.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    def _segments(self, q: Tensor, k: Tensor, v: Tensor, segment_ids: Tensor) -> Tensor:
        b, s = segment_ids.shape
        if b != q.shape[0] or s != q.shape[2]:
            raise ValueError(f"SegmentAttention: segment ids of shape {tuple(segment_ids.shape)} for a "
                             f"micro-batch of {q.shape[0]} rows x {q.shape[2]} tokens")
        rows = []
        for r, runs in enumerate(segment_runs(segment_ids)):
            parts = [F.scaled_dot_product_attention(q[r:r + 1, :, a:e], k[r:r + 1, :, a:e], v[r:r + 1, :, a:e],
                                                    is_causal=True, scale=self.softmax_scale)
                     for a, e in runs]
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
        return torch.cat(rows, dim=0) if b > 1 else rows[0]
