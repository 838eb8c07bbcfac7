"""Qwen3-VL's own modules on megatron-core parts: the patch embedding with its interpolated learned positions, the
ViT's layer spec and TransformerConfig (LayerNorm, GELU-tanh MLP, packed images through SegmentAttention), the
layer that also holds a DeepStack merger, and the patch mergers (LayerNorm before the 2x2 shuffle for the main
one, after it for DeepStack's).  The 2-D rotary frequencies and the Conv3d are Qwen2.5-VL's
(``qwen2_5_vl.modules``).
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
from megatron.vlm.layers.config import _common
from megatron.vlm.layers.drop_path import DropPathLayer
from megatron.vlm.layers.layer_impl import LayerImpl
from megatron.vlm.layers.seeding import SeededTransformerLayer
from megatron.vlm.lineages.qwen.modules import PatchEmbedding
from megatron.vlm.parallel.padded_heads import draw_padded_attention


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


def vision_config(spec: ModelSpec, tp: int, on_cpu: bool, dtype: torch.dtype) -> TransformerConfig:
    """The ViT's config: biased linears, a 2-matrix GELU (tanh) MLP, LayerNorm; heads padded to a multiple of
    ``tp``."""
    v = spec.vision
    return TransformerConfig(
        num_layers=v.num_layers, hidden_size=v.hidden_size, num_attention_heads=v.padded_heads(tp),
        kv_channels=v.head_dim, ffn_hidden_size=v.ffn_hidden_size, add_bias_linear=True, add_qkv_bias=True,
        gated_linear_unit=False, activation_func=gelu_tanh, normalization="LayerNorm", layernorm_epsilon=v.norm_eps,
        **_common(tp=tp, pp=1, on_cpu=on_cpu, dtype=dtype, init_method_std=spec.init_method_std))


def vision_layer_spec(seed: int, first_unit_index: int, impl: LayerImpl, real_heads: int,
                      merger=None) -> ModuleSpec:
    """Seeded ViT layers without a causal mask (each packed image attends to itself); with ``merger`` (a
    builder of the DeepStack merger) ``DeepStackLayer``s that hold one each."""
    spec = layers.layer_spec("LayerNorm", impl.vision_mask_type, seed, first_unit_index, impl,
                             redraw=functools.partial(draw_padded_attention, real_heads=real_heads))
    if merger is not None:
        spec.module = DeepStackLayer
        spec.params = {**spec.params, "merger": merger}
    return spec


class DeepStackLayer(SeededTransformerLayer):
    """A ViT layer at a DeepStack index: also holds the DeepStack merger that reads its output
    (``deepstack_merger``, drawn from the unit's seed after the layer; its tensors are the unit's checkpoint keys).
    The layer's forward is megatron-core's; the component runs the merger on the layer's output."""

    def __init__(self, config, submodules, layer_number=1, seed=0, first_unit_index=0, redraw=None, merger=None,
                 **kwargs):
        def redraw_then_merger(layer, cfg):
            if redraw is not None:
                redraw(layer, cfg)
            layer.deepstack_merger = merger()
            for p in layer.deepstack_merger.parameters():  # it sees every patch and gets its feature's whole
                p.sequence_parallel = False  # gradient on every TP rank: not summed over TP (mark_sequence_parallel)

        super().__init__(config, submodules, layer_number=layer_number, seed=seed, first_unit_index=first_unit_index,
                         redraw=redraw_then_merger, **kwargs)


class DeepStackDropPathLayer(DeepStackLayer, DropPathLayer):
    """A ``DeepStackLayer`` with drop path (``drop_path.DropPathLayer``: the blocks' ``context`` carries the
    patches' keys); the merger reads the layer's output after the drop."""


class VisionEmbedding(PatchEmbedding):
    """Patch rows [n, C*T*p*p] -> Conv3d (with bias) + learned positions [n, H]: each patch's position is the
    bilinear (``align_corners=True``) interpolation of the ``s x s`` table (``pos_embed``) at its place in its image,
    given as 4 table rows and their weights per patch (``batch.position_taps``)."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig):
        super().__init__(spec, config, bias=True)
        v = spec.vision
        self.pos_embed = torch.nn.Embedding(v.num_position_embeddings, v.hidden_size)
        with torch.no_grad():
            config.init_method(self.pos_embed.weight)

    def forward(self, pixel_values: torch.Tensor, pos_index: torch.Tensor, pos_weight: torch.Tensor) -> torch.Tensor:
        x = super().forward(pixel_values)
        pos = (self.pos_embed(pos_index) * pos_weight.to(x.dtype).unsqueeze(-1)).sum(1)  # [n, 4, H] -> [n, H]
        return x + pos


class PatchMerger(MegatronModule):
    """ViT output [n, 1, Hv] -> LayerNorm -> m*m consecutive patches concatenated [n/m^2, m^2 * Hv] -> Linear
    (column-parallel) -> exact GELU -> Linear (row-parallel) -> [n/m^2, 1, Hl]. The main merger (projector) norms each
    patch before the concatenation; a DeepStack merger (``after_shuffle``) norms the concatenated row."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, after_shuffle: bool = False):
        super().__init__(config=config)
        v = spec.vision
        self.width = v.hidden_size * v.merge_unit
        self.after_shuffle = after_shuffle
        self.norm = torch.nn.LayerNorm(self.width if after_shuffle else v.hidden_size, eps=v.norm_eps)
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            self.width, self.width, config=config, init_method=config.init_method, bias=True, gather_output=False)
        self.fc2 = tensor_parallel.RowParallelLinear(
            self.width, spec.language.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=True, input_is_parallel=True, skip_bias_add=False)

    def forward(self, vit_out: torch.Tensor) -> torch.Tensor:
        x = vit_out.reshape(-1, vit_out.shape[-1])
        x = self.norm(x.reshape(-1, self.width)) if self.after_shuffle else self.norm(x).reshape(-1, self.width)
        x, _ = self.fc1(x)
        x, _ = self.fc2(F.gelu(x))
        return x.unsqueeze(1)
