"""Qwen2.5-VL's own modules on megatron-core parts: the Conv3d patch embedding, the ViT's 2-D rotary
frequencies, its layer spec and TransformerConfig (packed images / windows through SegmentAttention), the
2x2 patch merger, and the LLM embedding that writes the merged image features into the image-token slots.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from omnibal_ext.model.spec import ModelSpec

from megatron.vlm.layers import blocks as layers
from megatron.vlm.layers.layer_impl import LayerImpl
from megatron.vlm.parallel.padded_heads import draw_padded_attention
from megatron.vlm.layers.config import _common


def vision_config(spec: ModelSpec, tp: int, on_cpu: bool, dtype: torch.dtype) -> TransformerConfig:
    """The ViT's config: biased linears, SwiGLU MLP, RMSNorm; heads padded to a multiple of ``tp``."""
    v = spec.vision
    return TransformerConfig(
        num_layers=v.num_layers, hidden_size=v.hidden_size, num_attention_heads=v.padded_heads(tp),
        kv_channels=v.head_dim, ffn_hidden_size=v.ffn_hidden_size, add_bias_linear=True, add_qkv_bias=True,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=v.norm_eps,
        **_common(tp=tp, pp=1, on_cpu=on_cpu, dtype=dtype, init_method_std=spec.init_method_std))


def vision_layer_spec(seed: int, first_unit_index: int, impl: LayerImpl, real_heads: int) -> ModuleSpec:
    """Seeded ViT layers without a causal mask: each packed segment (image or window) attends to itself."""
    return layers.layer_spec("RMSNorm", impl.vision_mask_type, seed, first_unit_index, impl,
                             redraw=functools.partial(draw_padded_attention, real_heads=real_heads))


class PatchMerger(MegatronModule):
    """ViT output in window order [n, 1, Hv] -> RMSNorm per patch -> m*m consecutive patches concatenated
    [n/m^2, m^2 * Hv] -> Linear (column-parallel) -> GELU -> Linear (row-parallel) -> [n/m^2, 1, Hl] (still in
    window order; the component puts it back in processor order)."""

    def __init__(self, spec: ModelSpec, vision_config: TransformerConfig, config: TransformerConfig):
        super().__init__(config=config)
        v = spec.vision
        self.width = v.hidden_size * v.merge_unit
        self.norm = torch.nn.RMSNorm(v.hidden_size, eps=v.norm_eps)
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            self.width, self.width, config=config, init_method=config.init_method, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            self.width, spec.language.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=True, input_is_parallel=True, skip_bias_add=False)

    def forward(self, vit_out: torch.Tensor) -> torch.Tensor:
        x = self.norm(vit_out.squeeze(1)).reshape(-1, self.width)
        x, _ = self.fc1(x)
        x, _ = self.fc2(F.gelu(x))
        return x.unsqueeze(1)


