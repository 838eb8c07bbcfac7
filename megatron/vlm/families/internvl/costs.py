"""InternVL (InternVL-Chat, InternVL 2.5 / 3), its costs (tensor-free, no torch): InternViT over fixed-size tiles, the
pixel-shuffle MLP projector, and the published model sizes.

The ViT's work is counted in tiles (``MicroBatchShape.vision_items``): each tile runs
``seq_per_tile`` tokens (patches plus a class token) with full attention within the tile.

FLOPs (forward, one multiply-add = 2), ``s`` tokens per tile, ``h`` hidden, ``f`` MLP hidden:
* ViT layer, per tile: ``2*s*(4*h^2 + 2*h*f)`` (QKV + out projection, 2-matrix GELU MLP) plus attention
  scores and context ``4*s^2*h``; at TP sizes that do not divide the heads the layer runs
  ``padded_heads(tp)`` heads and its attention FLOPs grow with them.
* projector: ``2*n*(h_in*h_llm + h_llm^2)`` over ``n = tiles * tokens_per_tile`` tokens;
* patch embedding: ``2*patches*(C*p^2)*h`` per tile.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnibal_ext.errors import UserError
from omnibal_ext.model.components import (FUSED_KERNELS, ActBytes, CostComponent, layer_act_bytes_per_token,
                                          norm_bytes_per_token, sp_tokens)
from omnibal_ext.model.spec import ModelSpec


@dataclass(frozen=True)
class VisionSpec:
    """InternViT: pre-norm layers over the patch tokens of one tile plus a class token."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    image_size: int = 448  # tile side, pixels
    patch_size: int = 14  # pixels
    in_channels: int = 3
    normalization: str = "LayerNorm"  # or "RMSNorm" (InternViT-6B)
    norm_eps: float = 1e-6  # epsilon of the layer norms and of the qk-norm (HF: layer_norm_eps)
    qkv_bias: bool = True  # bias on the fused QKV projection (HF: attention_bias; InternViT-6B: none)
    qk_norm: bool = False  # RMSNorm of q and of k over the full width of all heads (HF: use_qk_norm)
    # layer scale: x + ls1 * attn(norm1(x)), x + ls2 * mlp(norm2(x)), ls1/ls2 trained vectors of [hidden]
    # starting at this value (HF: layer_scale_init_value); None: no layer scale
    layer_scale_init: float | None = None

    def __post_init__(self):
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise UserError(f"vision normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_heads(self, tp: int) -> int:
        """Attention heads the model is built with at tensor-parallel size ``tp``: the real heads rounded
        up to a multiple of ``tp`` (InternViT-6B's 25 heads divide by no TP > 1). The padded heads have
        zero weights, give zero output and zero gradients, and so stay zero under training."""
        return -(-self.num_attention_heads // tp) * tp

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_per_tile(self) -> int:
        """Tokens the ViT runs per tile: patches plus the class token."""
        return self.patches_per_tile + 1


def vit_layer_flops(spec: ModelSpec, tiles: int, tp: int = 1) -> tuple[float, float]:
    """(total, attention-core) forward FLOPs of one InternViT layer over ``tiles`` tiles, all TP ranks."""
    v = spec.vision
    s, h, f = v.seq_per_tile, v.hidden_size, v.ffn_hidden_size
    width = v.padded_heads(tp) * v.head_dim  # attention width: h without padding
    linear = 2.0 * s * (4 * h * width + 2 * h * f)
    core = 4.0 * s * s * width
    return tiles * (linear + core), tiles * core


class VisionEmbedCost(CostComponent):
    """Patch embedding of the tiles (a strided conv, 588-wide reduction: low efficiency), class token,
    learned positions."""

    efficiency = 0.3

    def flops(self, shape, tp):
        v = self.spec.vision
        return shape.rank_vision_items * 2.0 * v.patches_per_tile * (v.in_channels * v.patch_size**2) * v.hidden_size, 0.0

    def params(self, tp):
        v = self.spec.vision
        n = v.in_channels * v.patch_size**2 * v.hidden_size + v.hidden_size  # conv + bias
        return n + v.hidden_size + v.seq_per_tile * v.hidden_size  # class token + position embedding

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        v, D = self.spec.vision, shape.dtype_bytes
        # the convolution keeps its input: under context parallelism a view of this rank's tiles into the pixels
        # of all the micro-batch's tiles (every CP rank decodes them all), which stay whole
        pixels = shape.vision_items * v.in_channels * v.image_size**2 * D
        return ActBytes(pixels, pixels, pixels, shape.rank_vision_items * v.seq_per_tile * v.hidden_size * D)


class VisionLayerCost(CostComponent):
    """One InternViT layer: full attention within each tile, GELU MLP, optional qk-norm and layer scale."""

    def flops(self, shape, tp):
        return vit_layer_flops(self.spec, shape.rank_vision_items, tp)

    def params(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        n = 4 * h * width + 2 * h * f + (h + f + h) + 2 * h * (2 if v.normalization == "LayerNorm" else 1)
        n += 3 * width if v.qkv_bias else 0  # QKV bias
        n += 2 * width if v.qk_norm else 0  # q and k norm weights over the full width
        return n + (2 * h if v.layer_scale_init is not None else 0)  # ls1, ls2

    def linears(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        return {"qkv": (h, 3 * width), "proj": (width, h), "fc1": (h, f), "fc2": (f, h)}

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # sequence parallel: every tile padded to a multiple of TP tokens (the pads masked out of attention)
        v, D = self.spec.vision, shape.dtype_bytes
        seq = sp_tokens(v.seq_per_tile, tp, sequence_parallel)
        tokens = shape.rank_vision_items * seq
        per_tok, core = layer_act_bytes_per_token(
            v.hidden_size, v.num_attention_heads, v.num_attention_heads, v.ffn_hidden_size, False,
            seq, D, tp, dropout, attention, norm=v.normalization, built_heads=v.padded_heads(tp),
            sequence_parallel=sequence_parallel, kernels=kernels)
        full = tokens * v.hidden_size * D / (tp if sequence_parallel else 1)
        return ActBytes(tokens * per_tok, full, tokens * (per_tok - core), full)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        v = self.spec.vision
        seq = sp_tokens(v.seq_per_tile, tp, sequence_parallel)  # all-gather + reduce-scatter of the padded tiles
        vit = shape.rank_vision_items * seq * v.hidden_size * shape.dtype_bytes
        return 2 * vit, 2 * vit


class ProjectorCost(CostComponent):
    """Pixel shuffle, LayerNorm and a 2-layer GELU MLP into the LLM's width (few tokens: lower efficiency)."""

    efficiency = 0.4

    def _image_tokens(self, shape) -> int:
        return shape.rank_vision_items * self.spec.tokens_per_tile

    def flops(self, shape, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2.0 * self._image_tokens(shape) * (hi * ho + ho**2), 0.0

    def params(self, tp):
        hi, ho = self.spec.projector_in_size, self.spec.language.hidden_size
        return 2 * hi + hi * ho + ho + ho * ho + ho

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        hi, ho, D = self.spec.projector_in_size, self.spec.language.hidden_size, shape.dtype_bytes
        n = self._image_tokens(shape)
        # LayerNorm input, statistics and output, GELU input, fc2 input
        act = n * (2 * hi * D + norm_bytes_per_token(hi, D, "LayerNorm", kernels) + 2 * ho * D / tp)
        return ActBytes(act, n * hi * D, act, n * ho * D)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        img = self._image_tokens(shape) * self.spec.language.hidden_size * shape.dtype_bytes
        return img, img


NAME = "internvl"
