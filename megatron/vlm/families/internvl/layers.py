"""InternViT's layer features on megatron-core's layer spec: padded heads drawn for the real heads,
layer scale (``LayerScale`` as the bias-dropout-add submodules), qk-norm over the full width of all heads
(``FullWidthQKNorm`` as ``q_layernorm``/``k_layernorm``), and the bias-free fused QKV.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron.vlm.layers import blocks as layers
from megatron.vlm.layers.drop_path import with_drop_path
from megatron.vlm.layers.layer_impl import LOCAL, LayerImpl
from megatron.vlm.parallel.padded_heads import draw_padded_attention, tp_rank


def draw_padded_layer(layer: TransformerLayer, config: TransformerConfig, real_heads: int) -> None:
    """Draw an InternViT layer's matrices for ``real_heads`` heads: the attention as
    ``padded_heads.draw_padded_attention`` draws it (padded heads zero), then the MLP in and out (this TP rank's
    slice of the full matrices, in that fixed order, so the weights are the same at every TP size); biases zero."""
    draw_padded_attention(layer, config, real_heads)
    h, f, tp, rank = config.hidden_size, config.ffn_hidden_size, config.tensor_model_parallel_size, tp_rank(config)
    fc1 = torch.empty(f, h)
    config.init_method(fc1)
    fc2 = torch.empty(h, f)
    config.output_layer_init_method(fc2)
    ffn_mine = slice(rank * f // tp, (rank + 1) * f // tp)
    mlp = layer.mlp
    with torch.no_grad():
        for linear, full in ((mlp.linear_fc1, fc1[ffn_mine]), (mlp.linear_fc2, fc2[:, ffn_mine])):
            linear.weight.copy_(full.to(linear.weight.dtype))
            if getattr(linear, "bias", None) is not None:
                linear.bias.zero_()


class LayerScale(torch.nn.Module):
    """Bias-dropout-add with a trained per-channel scale of the branch: ``residual + scale * (x + bias)``.

    Used as a TransformerLayer's ``self_attn_bda`` / ``mlp_bda`` submodule (InternViT's layer scale:
    ``lambda_1``/``ls1`` is the attention branch's ``self_attn_bda.scale``, ``lambda_2``/``ls2`` the MLP
    branch's ``mlp_bda.scale``), a parameter of shape [hidden] kept apart from the weights (replicated
    over TP). Called like megatron-core's bias-dropout-add: ``bda(training, fused)(x_with_bias, residual,
    dropout_prob)``.
    """

    def __init__(self, hidden_size: int, init_value: float):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((hidden_size,), float(init_value)))

    def forward(self, training: bool, fused: bool = False):
        def bias_dropout_scale_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = F.dropout(x, p=prob, training=training) * self.scale
            return residual + x

        return bias_dropout_scale_add


class FullWidthQKNorm(MegatronModule):
    """RMSNorm of q (or k) over the full width of all heads, as InternViT-6B's qk-norm.

    Built as SelfAttention's ``q_layernorm`` / ``k_layernorm`` submodule, it gets this rank's heads
    [s, b, heads per rank, head_dim] and normalises each token over ``real_heads * head_dim`` values:
    under tensor parallelism the sum of squares is all-reduced over the TP group (forward and backward)
    and divided by the real width (padded heads are zero and add nothing). The weight covers this rank's
    heads ([heads per rank * head_dim], split over TP like the heads; padded heads' entries stay unused).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, real_heads: int | None = None):
        super().__init__(config=config)

        self.tp = config.tensor_model_parallel_size
        local_heads = config.num_attention_heads // self.tp
        self.real_width = (real_heads or config.num_attention_heads) * hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(local_heads * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        ss = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:  # all-reduce forward, all-reduce backward (every rank's output depends on the sum)
            ss = tensor_parallel.reduce_from_tensor_model_parallel_region(
                tensor_parallel.copy_to_tensor_model_parallel_region(ss))
        y = (flat * torch.rsqrt(ss / self.real_width + self.eps)).to(x.dtype)
        return (self.weight * y).reshape(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


def layer_spec(normalization: str, mask_type: AttnMaskType, seed: int, first_unit_index: int,
               impl: LayerImpl = LOCAL, real_heads: int | None = None, vision=None, drop_path: tuple[int, tuple[float, ...]] | None = None
               ) -> ModuleSpec:
    """The shared seeded layer spec (``megatron.vlm.layers.blocks.layer_spec``) with InternViT's features.

    real_heads: the model's attention heads when the config may hold padded ones: the layer's matrices are
    then drawn by ``draw_padded_layer``. vision: the VisionSpec whose per-layer features (qkv bias off,
    qk-norm, layer scale) the layer gets (None: a plain layer). drop_path: (unit index of ViT layer 0, drop
    probability per ViT layer) for stochastic depth (megatron/vlm/layers/drop_path.py; None: none): the layer is a
    ``DropPathLayer`` and both bias-dropout-adds ``DropPathBDA`` (which carries the layer scale, if any).
    """
    redraw = None if real_heads is None else functools.partial(draw_padded_layer, real_heads=real_heads)
    spec = layers.layer_spec(normalization, mask_type, seed, first_unit_index, impl, redraw=redraw)
    attn = spec.submodules.self_attention
    if vision is not None:
        if not vision.qkv_bias:
            attn.submodules.linear_qkv = layers.without_bias(attn.submodules.linear_qkv)
        if vision.qk_norm:
            norm = ModuleSpec(module=FullWidthQKNorm, params={"real_heads": real_heads})
            attn.submodules.q_layernorm = norm
            attn.submodules.k_layernorm = copy.deepcopy(norm)
        if vision.layer_scale_init is not None:
            scale = ModuleSpec(module=LayerScale, params={"hidden_size": vision.hidden_size,
                                                          "init_value": vision.layer_scale_init})
            spec.submodules.self_attn_bda = scale
            spec.submodules.mlp_bda = copy.deepcopy(scale)
    if drop_path is not None:

        first, rates = drop_path
        with_drop_path(spec, first, rates, vision.layer_scale_init if vision is not None else None,
                       vision.hidden_size if vision is not None else 0)
    return spec

