"""ViT layers whose heads TP does not divide: drawn for the real heads, the padded heads zero.

A ViT is built with ``padded_heads(tp)`` heads (a multiple of the TP size). ``draw_padded_attention`` draws the
full attention matrices of the real model on the host in a fixed order (QKV, then out-projection), so a layer's
weights are the same at every TP size, padded or not, and this rank keeps its slice; attention biases start at
zero. Megatron's fused QKV holds, per head, rows [q | k | v] of ``kv_channels`` each; the out-projection's input
columns follow the heads. A padded head's q, k, v are zero, so its attention output is zero; its out-projection
columns are zero, so that output reaches nothing and every gradient the head gets is zero: padded heads stay zero
under training. (megatron-core's own initialisation runs first and is overwritten: it is also what marks the
weights tensor-parallel.) Checkpoints store the real heads only (``sharding.drop_padded_heads``).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig


def tp_rank(config: TransformerConfig) -> int:
    return parallel_state.get_tensor_model_parallel_rank() if config.tensor_model_parallel_size > 1 else 0


def draw_padded_attention(layer, config: TransformerConfig, real_heads: int) -> None:
    """Draw ``layer``'s QKV and out-projection for ``real_heads`` heads, zero the padded ones, keep this TP rank's
    heads, zero the attention biases (see the module docstring). The caller draws the rest of the layer after it."""
    heads, d, h = config.num_attention_heads, config.kv_channels, config.hidden_size
    if config.num_query_groups not in (None, heads):
        raise ValueError("draw_padded_attention: multi-head attention only (the ViT's)")
    if not 1 <= real_heads <= heads:
        raise ValueError(f"draw_padded_attention: {real_heads} real heads for a layer of {heads}")
    tp, rank = config.tensor_model_parallel_size, tp_rank(config)
    mine = slice(rank * heads // tp, (rank + 1) * heads // tp)
    qkv = torch.zeros(heads, 3 * d, h)
    config.init_method(qkv[:real_heads])
    proj = torch.zeros(h, heads, d)
    real = torch.empty(h, real_heads, d)
    config.output_layer_init_method(real)
    proj[:, :real_heads] = real
    attn = layer.self_attention
    with torch.no_grad():
        for linear, full in ((attn.linear_qkv, qkv[mine].reshape(-1, h)), (attn.linear_proj, proj[:, mine].reshape(h, -1))):
            linear.weight.copy_(full.to(linear.weight.dtype))
            if getattr(linear, "bias", None) is not None:
                linear.bias.zero_()
