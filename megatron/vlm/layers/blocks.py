"""Transformer layers of any family from megatron-core's layer specs: the spec a stage's layers are built
with, the attention mask type, and the split of a run of layers into TransformerBlock segments that carry
their recompute settings.

Recompute: a stage's layers of one role (ViT, LLM) are split into megatron TransformerBlocks ("segments"):
the first ``full_layers`` fully recomputed, the rest with selective (core-attention) recompute or none, so
every stage can get its own plan.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.vlm.layers.attention import SegmentAttention
from megatron.vlm.layers.layer_impl import LOCAL, LayerImpl
from megatron.vlm.layers.lora import with_lora
from megatron.vlm.layers.norms import PerHeadRMSNorm, TorchNorm
from megatron.vlm.layers.seeding import SeededTransformerLayer
from megatron.vlm.parallel.sequence_parallel import mark_sequence_parallel

_NO_BIAS_CLASSES: dict = {}


def without_bias(linear_cls: type) -> type:
    """``linear_cls`` built without a bias whatever the ``bias`` its builder passes (megatron-core gives
    linear_qkv a bias whenever ``add_bias_linear`` is set; the ViT keeps biases elsewhere)."""
    if linear_cls not in _NO_BIAS_CLASSES:
        def __init__(self, *args, bias=True, **kwargs):
            linear_cls.__init__(self, *args, bias=False, **kwargs)

        _NO_BIAS_CLASSES[linear_cls] = type(f"{linear_cls.__name__}NoBias", (linear_cls,), {"__init__": __init__})
    return _NO_BIAS_CLASSES[linear_cls]


def base_layer_spec(normalization: str, impl: LayerImpl = LOCAL) -> ModuleSpec:
    """megatron-core's layer spec: torch modules or TransformerEngine's fused ones (``impl``).

    With TransformerEngine the normalisation comes from the config (fused into the linear layers).
    """
    if impl.transformer_engine:

        return get_gpt_layer_with_transformer_engine_spec()
    return get_gpt_layer_local_spec(normalization=normalization)


def layer_spec(normalization: str, mask_type: AttnMaskType, seed: int, first_unit_index: int,
               impl: LayerImpl = LOCAL, redraw=None) -> ModuleSpec:
    """The spec of seeded layers (``SeededTransformerLayer``) whose first is unit ``first_unit_index``; a
    family changes submodules of the returned copy for its layer features."""
    spec = copy.deepcopy(base_layer_spec(normalization, impl))
    spec.module = SeededTransformerLayer
    spec.params = {**spec.params, "seed": seed, "first_unit_index": first_unit_index, "redraw": redraw}
    attn = spec.submodules.self_attention
    attn.params = {**attn.params, "attn_mask_type": mask_type}
    if impl.segment_attention:
        attn.submodules.core_attention = SegmentAttention
    _allow_sequence_parallel_norms(spec)
    return spec


def with_qk_norm(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with a per-head RMSNorm of the queries and the keys (Qwen3: ``PerHeadRMSNorm`` as the attention's
    ``q_layernorm`` / ``k_layernorm``, which megatron-core applies per head before RoPE); changed in place."""
    attn = spec.submodules.self_attention.submodules
    attn.q_layernorm = PerHeadRMSNorm
    attn.k_layernorm = PerHeadRMSNorm
    return spec


def _allow_sequence_parallel_norms(spec: ModuleSpec) -> None:
    """The local spec's torch norms (megatron-core's WrappedTorchNorm refuses sequence parallelism) become
    ``TorchNorm``: the same modules, marked ``sequence_parallel`` under it."""

    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name, None) is WrappedTorchNorm:
            setattr(spec.submodules, name, TorchNorm)


def segment_configs(base: TransformerConfig, num_layers: int, full_layers: int, selective: bool):
    """Split ``num_layers`` into (num_layers, config) segments carrying their recompute settings."""
    if full_layers < 0 or full_layers > num_layers:
        raise ValueError(f"recompute of {full_layers} full layers on a stage with {num_layers} layers")
    segments = []
    if full_layers:
        segments.append((full_layers, dataclasses.replace(
            base, num_layers=full_layers, recompute_granularity="full", recompute_method="block",
            recompute_num_layers=full_layers)))
    rest = num_layers - full_layers
    if rest:
        segments.append((rest, dataclasses.replace(
            base, num_layers=rest, recompute_granularity="selective" if selective else None,
            recompute_method=None, recompute_num_layers=None)))
    return segments


def build_blocks(config: TransformerConfig, spec_for, first_index: int, n_layers: int, full_layers: int,
                 selective: bool, lora=None, lora_linears: tuple[str, ...] = (),
                 pg_collection=None) -> torch.nn.ModuleList:
    """TransformerBlock segments of ``n_layers`` consecutive layer units from unit ``first_index``;
    ``spec_for(first_unit_index)`` is the layer spec of a segment starting at that unit. lora: the LoRA flags
    (``omnibal_ext.model.lora.Lora``) and lora_linears the linears of these layers that carry adapters
    (``megatron/vlm/layers/lora.py``). pg_collection: megatron-core's process groups of the blocks (None: its default)."""

    blocks = torch.nn.ModuleList()
    offset = 0
    for n, cfg in segment_configs(config, n_layers, min(full_layers, n_layers), selective):
        spec = with_lora(spec_for(first_index + offset), lora, lora_linears)
        blocks.append(TransformerBlock(cfg, spec, post_layer_norm=False, pg_collection=pg_collection))
        offset += n
    if config.sequence_parallel:  # replicated parameters that see 1/TP of the tokens: gradients summed over TP
        mark_sequence_parallel(blocks)
    return blocks
