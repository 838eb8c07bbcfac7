"""InternVL's own modules: the patch embedding of the tiles and the pixel-shuffle MLP projector."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from omnibal_ext.model.spec import ModelSpec


class VisionEmbedding(MegatronModule):
    """Tiles [n, C, S, S] -> patch tokens plus a class token, with learned positions: [1 + P, n, H]."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig):
        super().__init__(config=config)
        v = spec.vision
        self.patch = torch.nn.Conv2d(v.in_channels, v.hidden_size, kernel_size=v.patch_size, stride=v.patch_size)
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, v.hidden_size) * spec.init_method_std)
        self.position = torch.nn.Parameter(torch.randn(1, v.seq_per_tile, v.hidden_size) * spec.init_method_std)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixel_values.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)  # [n, P, H]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.position
        return x.transpose(0, 1).contiguous()  # [1 + P, n, H]


class Projector(MegatronModule):
    """ViT output -> drop class token -> pixel shuffle -> LayerNorm -> MLP (tensor parallel).

    [1 + P, n, Hv] -> [n * tokens_per_tile, 1, Hl]
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig):
        super().__init__(config=config)
        self.grid = int(round(spec.vision.patches_per_tile**0.5))
        self.factor = int(round(1 / spec.downsample_ratio))
        in_size, hidden = spec.projector_in_size, spec.language.hidden_size
        self.norm = torch.nn.LayerNorm(in_size)
        init = config.init_method
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            in_size, hidden, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            hidden, hidden, config=config, init_method=init, bias=True, input_is_parallel=True,
            skip_bias_add=False)

    def forward(self, vit_out: torch.Tensor) -> torch.Tensor:
        x = vit_out[1:].transpose(0, 1)  # [n, P, Hv]
        n, _, h = x.shape
        g, f = self.grid, self.factor
        x = x.reshape(n, g // f, f, g // f, f, h).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(n * (g // f) ** 2, f * f * h)
        x, _ = self.fc1(self.norm(x))
        x, _ = self.fc2(F.gelu(x))
        return x.unsqueeze(1)
