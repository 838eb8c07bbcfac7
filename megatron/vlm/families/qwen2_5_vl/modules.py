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

from megatron.vlm import layers
from megatron.vlm.layer_impl import LayerImpl
from megatron.vlm.padded_heads import draw_padded_attention
from megatron.vlm.config import _common
from megatron.vlm.text import word_embedding


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


class PatchEmbedding(MegatronModule):
    """Patch rows [n, C * T * p * p] (``(channel, frame, y, x)`` order) -> [n, H]: a Conv3d whose kernel is the
    whole patch (stride = kernel), as HF stores it (``weight [H, C, T, p, p]``); without bias (Qwen2.5-VL) or with
    one starting at zero (``bias``: Qwen3-VL)."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, bias: bool = False):
        super().__init__(config=config)
        v = spec.vision
        self.kernel = (v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = torch.nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=self.kernel[1:], stride=self.kernel[1:],
                                    bias=bias)
        with torch.no_grad():
            config.init_method(self.proj.weight)
            if bias:
                self.proj.bias.zero_()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.to(self.proj.weight.dtype).reshape(-1, *self.kernel)
        return self.proj(x).reshape(x.shape[0], -1)


def vision_rotary(rotary_ids: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """2-D RoPE frequencies [n, 1, 1, head_dim] of patch tokens with (row, column) ids ``rotary_ids [n, 2]``:
    ``head_dim / 4`` frequencies per axis, the row's then the column's, the whole repeated for the rotated
    half (megatron-core's non-interleaved ``apply_rotary_pos_emb`` takes them as they are)."""
    quarter = head_dim // 2
    inv = 1.0 / (base ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=rotary_ids.device) / quarter))
    freqs = (rotary_ids.to(torch.float32)[..., None] * inv).reshape(rotary_ids.shape[0], -1)  # [n, d/2]: rows, cols
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


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


def vision_slots(tokens: torch.Tensor, token_types: torch.Tensor | None, image_token_id: int) -> torch.Tensor:
    """bool, ``tokens``' shape: the tokens that take merged ViT features (images' and videos', in text order):
    ``token_types > 0`` (``mm_token_type_ids``), or the ``image_token_id`` tokens without them."""
    if token_types is not None:
        return token_types.to(tokens.device).reshape(tokens.shape) > 0
    return tokens == image_token_id


class ImageTokenEmbedding(MegatronModule):
    """Vocabulary-parallel token embedding with the image features written, in order, into the image-token
    slots: tokens [b, s], features [image tokens, 1, H] (or None: a batch without images) -> [b * s, 1, H]."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, image_token_id: int):
        super().__init__(config=config)
        self.word = word_embedding(spec, config)
        self.image_token_id = image_token_id

    def forward(self, tokens: torch.Tensor, image_features: torch.Tensor | None,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        """``token_types [b, s]`` (``mm_token_type_ids``: > 0 on image and video tokens) says where the features go;
        None: the ``image_token_id`` tokens."""
        emb = self.word(tokens.reshape(1, -1))  # [1, t, H]
        if image_features is not None:
            slots = vision_slots(tokens, token_types, self.image_token_id).reshape(1, -1, 1)
            emb = emb.masked_scatter(slots, image_features.squeeze(1).to(emb.dtype))
        return emb.transpose(0, 1).contiguous()  # [t, 1, H]
