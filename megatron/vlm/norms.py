"""The layer norms of the local layer spec, with sequence parallelism allowed.

megatron-core's local-spec norm without Apex (``WrappedTorchNorm``) refuses ``config.sequence_parallel``.
``TorchNorm`` builds the same torch module (``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` after
``config.normalization``, the same parameters and state-dict keys) and, under sequence parallelism, marks its
parameters ``sequence_parallel`` (each TP rank normalises its own tokens: finalize_model_grads sums the
gradients over TP).
"""
from __future__ import annotations

import torch
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
