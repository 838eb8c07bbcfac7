"""How a run's transformer layers are built: TransformerEngine's fused layers or megatron-core's torch modules, and
packed (THD) attention or a dense mask.  ``resolve_layer_impl`` decides it once per run from --transformer-impl,
--attention-backend and the run's device and features; the stage build carries the result (``LayerImpl``) to every
component, which reads its properties instead of comparing flag strings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.enums import AttnMaskType

from omnibal_ext.errors import UserError

ATTENTION_BACKENDS = ("auto", "unfused")


@dataclass(frozen=True)
class LayerImpl:
    """``transformer_engine``: TransformerEngine's layer spec (fused norms and linears, its THD attention), else
    megatron-core's torch modules.  ``dense_mask``: megatron-core's DotProductAttention with a dense mask
    (``--attention-backend unfused``: the attention scores are kept, as selective recompute saves them), a
    torch-module layer only; else the LLM attends within each packed segment."""

    transformer_engine: bool = False
    dense_mask: bool = False

    def __post_init__(self):
        if self.transformer_engine and self.dense_mask:
            raise ValueError("--attention-backend unfused is megatron-core's DotProductAttention (torch layers)")

    @classmethod
    def of(cls, transformer_impl: str, attention_backend: str = "auto") -> "LayerImpl":
        """The implementation the two flags' resolved values name ("local" | "transformer_engine", "auto" |
        "unfused")."""
        if transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"transformer impl must be 'local' or 'transformer_engine', got {transformer_impl!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        return cls(transformer_engine=transformer_impl == "transformer_engine",
                   dense_mask=attention_backend == "unfused")

    @property
    def thd(self) -> bool:
        """The LLM layers take packed sequences (THD rows with cu_seqlens)."""
        return not self.dense_mask

    @property
    def segment_attention(self) -> bool:
        """Torch layers with SegmentAttention (segment ids, SDPA): what sequence parallelism and CP run."""
        return not self.transformer_engine and not self.dense_mask

    @property
    def llm_mask_type(self) -> AttnMaskType:
        """Causal within each THD segment (TransformerEngine's THD kernels want ``padding_causal``), or
        ``arbitrary`` for DotProductAttention's dense mask."""
        if self.transformer_engine:
            return AttnMaskType.padding_causal
        return AttnMaskType.arbitrary if self.dense_mask else AttnMaskType.causal

    @property
    def vision_mask_type(self) -> AttnMaskType:
        """ViT layers attend within each packed item: TransformerEngine's ``padding`` kernels, or no mask for the
        torch modules (the segments come with the packed parameters)."""
        return AttnMaskType.padding if self.transformer_engine else AttnMaskType.no_mask

    @property
    def name(self) -> str:
        """--transformer-impl's resolved value, as the profile and the logs name it."""
        return "transformer_engine" if self.transformer_engine else "local"


LOCAL = LayerImpl()


def resolve_layer_impl(requested: str, attention_backend: str, device: torch.device, cp: int = 1,
                       torch_layers_only: bool = False) -> LayerImpl:
    """The run's layers.  ``requested`` "auto": TransformerEngine on CUDA when it imports and the LLM runs packed
    sequences, else megatron-core's torch modules.  The torch modules always serve ``--attention-backend unfused``
    (DotProductAttention refuses THD), context parallelism (SegmentAttention's: TE's CP attention is not wired) and
    ``torch_layers_only`` runs (sequence parallelism and LoRA build on the torch layers).  The TE spec runs the THD
    path only (its fused attention with cu_seqlens needs TE >= 1.7 and a flash/cuDNN fused-attention backend for THD
    on the GPU, and TE's fused THD RoPE)."""
    dense = attention_backend == "unfused"
    if device.type == "cpu" and requested == "transformer_engine":
        raise UserError("--transformer-impl transformer_engine needs a CUDA device")
    if device.type == "cpu" or dense or cp > 1 or torch_layers_only:
        return LayerImpl.of("local", attention_backend)
    if requested != "auto":
        return LayerImpl.of(requested, attention_backend)
    try:
        import transformer_engine  # noqa: F401  (optional: TransformerEngine, on CUDA)
    except ImportError:
        return LayerImpl.of("local", attention_backend)
    return LayerImpl.of("transformer_engine", attention_backend)
