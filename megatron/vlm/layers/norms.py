"""The layer norms of the local layer spec, with sequence parallelism allowed.

megatron-core's local-spec norm without Apex (``WrappedTorchNorm``) refuses ``config.sequence_parallel``.
``TorchNorm`` builds the same torch module (``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` after
``config.normalization``, the same parameters and state-dict keys) and, under sequence parallelism, marks its
parameters ``sequence_parallel`` (each TP rank normalises its own tokens: finalize_model_grads sums the
gradients over TP).
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchNorm:
    """Called like megatron-core's norm builders: ``TorchNorm(config=, hidden_size=, eps=)``."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization must be LayerNorm or RMSNorm, got {config.normalization!r}")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


class PerHeadRMSNorm(torch.nn.Module):
    """RMSNorm of each attention head over its ``head_dim`` values (Qwen3's q_norm / k_norm), built as
    SelfAttention's ``q_layernorm`` / ``k_layernorm`` submodule (``megatron.vlm.layers.blocks.with_qk_norm``).

    It gets this TP rank's heads ``[s, b, heads, head_dim]`` and normalises in fp32, then scales by the weight
    in the input's dtype (transformers' Qwen3RMSNorm order). The weight ``[head_dim]`` is the same on every TP
    rank while each rank sees only its heads, so its gradient is summed over TP here (identity forward,
    all-reduce backward: ``copy_to_tensor_model_parallel_region``). It is deliberately neither marked
    ``sequence_parallel`` (it says ``grad_summed_over_tp``, which ``mark_sequence_parallel`` respects: under
    --sequence-parallel the layer's other replicated parameters are marked) nor announced by the config's
    ``qk_layernorm``: megatron-core's finalize_model_grads would then sum it again, and its name match would also
    catch the ViT's TP-split qk-norms."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.tp = config.tensor_model_parallel_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.grad_summed_over_tp = True  # summed over TP here: mark_sequence_parallel leaves it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp > 1:

            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        flat = x.float()
        y = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)
