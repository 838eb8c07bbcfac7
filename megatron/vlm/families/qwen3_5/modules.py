"""Qwen3.5's LLM layers on megatron-core parts: zero-centred RMSNorms (``1 + w``) and the layer specs of its two
kinds, a Gated DeltaNet layer (``megatron.vlm.layers.gated_delta_net``) and a gated full-attention layer (megatron-core's
SelfAttention with ``attention_output_gate``: its fused QKV holds ``[q | gate | k | v]`` per key-value group, the
attention output times ``sigmoid(gate)``), each with the SwiGLU MLP.

megatron-core's ``layernorm_zero_centered_gamma`` is read by TransformerEngine's norms only: its local-spec torch
norm (``WrappedTorchNorm``) refuses it on CPU, so the norms here are ours and the config flag stays False.
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.vlm.layers import blocks as layers
from megatron.vlm.layers.gated_delta_net import gated_delta_net_spec
from megatron.vlm.layers.layer_impl import LayerImpl


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * (1 + weight)`` in fp32, cast back to ``x``'s dtype (transformers' Qwen3_5RMSNorm order)."""
    flat = x.float()
    y = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


class ZeroCentredRMSNorm(torch.nn.Module):
    """A layer's or the final RMSNorm with weight ``w`` applied as ``1 + w`` (zeros at start: the identity scale).
    Built like megatron-core's norms (``config=, hidden_size=, eps=``); under sequence parallelism its weight is
    marked ``sequence_parallel`` (each TP rank normalises its own tokens: finalize_model_grads sums the gradient)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)


class PerHeadZeroCentredRMSNorm(ZeroCentredRMSNorm):
    """The q/k norm of every head over its ``head_dim`` values (``[s, b, heads, head_dim]``: this TP rank's heads):
    the weight is the same on every rank while each sees only its heads, so its gradient is summed over TP here
    (``copy_to_tensor_model_parallel_region``), and it is marked ``grad_summed_over_tp`` so that
    ``mark_sequence_parallel`` leaves it alone."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(dataclasses.replace(config, sequence_parallel=False), hidden_size, eps)
        self.tp = config.tensor_model_parallel_size
        self.weight.grad_summed_over_tp = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp > 1:

            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        return zero_centred_rms_norm(x, weight, self.eps)


def _with_norms(spec):
    spec.submodules.input_layernorm = ZeroCentredRMSNorm
    spec.submodules.pre_mlp_layernorm = ZeroCentredRMSNorm
    return spec


def attention_layer_spec(seed: int, first_unit_index: int, impl: LayerImpl):
    """Seeded gated full-attention layers: causal within each packed sample, per-head zero-centred q/k norms (the
    config's ``attention_output_gate`` adds the gate rows)."""
    spec = layers.layer_spec("RMSNorm", impl.llm_mask_type, seed, first_unit_index, impl)
    attn = spec.submodules.self_attention.submodules
    attn.q_layernorm = attn.k_layernorm = PerHeadZeroCentredRMSNorm
    return _with_norms(spec)


def linear_layer_spec(seed: int, first_unit_index: int, impl: LayerImpl, chunk_size: int, backend: str = "auto"):
    """Seeded Gated DeltaNet layers (the token mixer in the attention's place; its input norm keyed
    ``input_layernorm.``, there being no fused QKV to hold it)."""
    spec = layers.layer_spec("RMSNorm", impl.llm_mask_type, seed, first_unit_index, impl)
    spec.submodules.self_attention = gated_delta_net_spec(chunk_size=chunk_size, backend=backend)
    spec.submodules.sharded_state_dict_keys_map = {
        k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items() if k != "input_layernorm."}
    return _with_norms(spec)


def language_layer_config(base: TransformerConfig, lang) -> TransformerConfig:
    """The LLM layers' TransformerConfig: ``base`` (the shared decoder's) with the output gate and the Gated
    DeltaNet's sizes (``Qwen35LanguageSpec``)."""
    return dataclasses.replace(
        base, attention_output_gate=True, linear_num_key_heads=lang.linear_num_key_heads,
        linear_key_head_dim=lang.linear_key_head_dim, linear_num_value_heads=lang.linear_num_value_heads,
        linear_value_head_dim=lang.linear_value_head_dim, linear_conv_kernel_dim=lang.linear_conv_kernel_dim)

