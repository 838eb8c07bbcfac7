"""The Qwen lineage's shared modules: the Conv3d patch embedding, the ViT's 2-D rotary angles, the image-token slots
of a micro-batch and the image-token embedding (vision features written into those slots).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from omnibal_ext.model.spec import ModelSpec

from megatron.vlm.stage.text import word_embedding


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
