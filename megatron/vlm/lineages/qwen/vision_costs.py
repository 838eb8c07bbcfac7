"""The Qwen3-VL ViT's costs, shared by the Qwen lineage's families that use that ViT (tensor-free, no torch): its
spec (Conv3d patch embedding with bias, a learned position table bilinearly interpolated to each image, LayerNorm
layers with a GELU MLP and 2-D rotary positions, full attention within each image), the cost components of its
embedding, its layers and its 2x2 patch merger, and the merger's arithmetic that a family's DeepStack mergers reuse.

The ViT's work is counted in patches (``Family.vision_item`` "patch"): an image of ``grid_thw = (t, h, w)`` runs
``t*h*w`` patch tokens (16 x 16 px, two frames of a still image in one patch) and becomes ``t*h*w / 4`` LLM tokens
after the 2x2 merger.  Every ViT layer attends within each image (frame): its attention work is
``MicroBatchShape.vision_attn_tokens_sq`` (all patches as one image when not given).

FLOPs (forward, one multiply-add = 2), ``n`` patches, ``h`` hidden, ``f`` MLP hidden, ``w`` attention width:
* ViT layer: ``2*n*(4*h*w + 2*h*f)`` plus attention scores and context ``4*S*w`` (``S``: sum of squared image
  lengths);
* merger: ``2*(n/4)*(16*h^2 + 4*h*h_llm)``;
* patch embedding: ``2*n*(C*2*16*16)*h`` plus the position interpolation ``8*n*h`` (4 taps).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omnibal_ext.errors import UserError
from omnibal_ext.model.components import (FUSED_KERNELS, ActBytes, CostComponent, layer_act_bytes_per_token,
                                          norm_bytes_per_token, sp_tokens)
from omnibal_ext.model.spec import PROJECTOR, ModelSpec


@dataclass(frozen=True)
class VisionSpec:
    """The Qwen3-VL ViT: pre-LayerNorm layers with biases, GELU (tanh) MLP, 2-D RoPE plus learned positions
    interpolated from a ``sqrt(num_position_embeddings)``-per-side grid, full attention within each image; no
    final norm (the mergers have theirs)."""

    num_layers: int  # HF depth
    hidden_size: int
    num_attention_heads: int  # HF num_heads
    ffn_hidden_size: int  # HF intermediate_size
    num_position_embeddings: int = 2304  # a square grid (48 x 48 published)
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    patch_size: int = 16  # px
    temporal_patch_size: int = 2  # frames per patch (a still image is repeated)
    in_channels: int = 3
    spatial_merge_size: int = 2  # merged tokens are m x m patches
    norm_eps: float = 1e-6  # the layers' and the mergers' LayerNorm (HF: fixed 1e-6)
    rotary_base: int = 10000  # the 2-D RoPE's theta
    normalization: str = "LayerNorm"

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        ds = self.deepstack_visual_indexes
        bad = [i for i in ds if not 0 <= i < self.num_layers]
        if bad or len(set(ds)) != len(ds):
            raise UserError(f"deepstack_visual_indexes {list(ds)}: must be distinct ViT layer numbers below the "
                            f"depth {self.num_layers}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise UserError(f"ViT hidden size {self.hidden_size} / {self.num_attention_heads} heads must give a head "
                            "width divisible by 4 (2-D RoPE: a quarter of it per axis and half)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings or side < 2:
            raise UserError(f"num_position_embeddings {self.num_position_embeddings} is not a square grid of at least "
                            "2 x 2 positions")
        if self.normalization != "LayerNorm":
            raise UserError("the Qwen3-VL ViT uses LayerNorm")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_heads(self, tp: int) -> int:
        """Heads built at tensor-parallel size ``tp``: the real ones rounded up to a multiple of ``tp``."""
        return -(-self.num_attention_heads // tp) * tp

    @property
    def position_grid_side(self) -> int:
        """Positions per side of the learned table (48 published)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        """Values of one patch row (3 x 2 x 16 x 16 = 1536)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    def segments_sq(self, rows, cols) -> tuple[np.ndarray, np.ndarray]:
        """(full-attention, window) sums of squared segment lengths of images of ``rows x cols`` patches
        (``PatchVision``): every layer attends over the whole image, ``(rows*cols)^2``; there are no windows (the
        second is the same, unused)."""
        sq = (np.asarray(rows, dtype=np.float64) * np.asarray(cols, dtype=np.float64)) ** 2
        return sq, sq

    def deepstack_slot(self, layer: int) -> int | None:
        """Which DeepStack feature ViT layer ``layer`` makes (its place in ``deepstack_visual_indexes``), or None."""
        ds = self.deepstack_visual_indexes
        return ds.index(layer) if layer in ds else None


def attention_sq(shape) -> float:
    """Sum of squared image lengths (patches^2) over the micro-batch, one CP rank's share."""
    n = float(shape.vision_items)
    given = shape.vision_attn_tokens_sq
    return shape.rank_vision_sq(given if given is not None else n * n)


class VisionEmbedCost(CostComponent):
    """Conv3d patch embedding with bias plus the interpolated learned positions (4 table rows per patch)."""

    efficiency = 0.3

    def flops(self, shape, tp):
        v = self.spec.vision
        return shape.rank_vision_items * 2.0 * (v.patch_dim + 4) * v.hidden_size, 0.0

    def params(self, tp):
        v = self.spec.vision
        return (v.patch_dim + 1 + v.num_position_embeddings) * v.hidden_size

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # the convolution's input (pixels in the compute dtype), the interpolation's int64 indices and fp32 weights
        v, D, n = self.spec.vision, shape.dtype_bytes, shape.rank_vision_items
        act = n * (v.patch_dim * D + 4 * (8.0 + 4.0))
        return ActBytes(act, act, act, n * v.hidden_size * D)


def merger_sizes(spec: ModelSpec) -> tuple[int, int]:
    v = spec.vision
    return v.hidden_size * v.merge_unit, spec.language.hidden_size


def merger_flops(spec: ModelSpec, shape) -> float:
    hi, ho = merger_sizes(spec)
    return 2.0 * shape.rank_vision_items / spec.vision.merge_unit * (hi * hi + hi * ho)


def merger_params(spec: ModelSpec, norm_width: int) -> int:
    hi, ho = merger_sizes(spec)
    return 2 * norm_width + hi * hi + hi + hi * ho + ho  # LayerNorm weight and bias, fc1, fc2


def merger_act(spec: ModelSpec, shape, tp: int, norm_width: int, kernels) -> float:
    """Per patch the norm's input and statistics (of the merged row when ``norm_width`` is 4 x hidden); per
    merged token the fc1 input (replicated), the GELU input and the fc2 input (split)."""
    v, (hi, _) = spec.vision, merger_sizes(spec)
    D, tokens = shape.dtype_bytes, shape.rank_vision_items / spec.vision.merge_unit
    rows = shape.rank_vision_items * v.hidden_size / norm_width
    norm = rows * (norm_width * D + norm_bytes_per_token(norm_width, D, "LayerNorm", kernels))
    return norm + tokens * (hi * D + 2 * hi * D / tp)


class VisionLayerCost(CostComponent):
    """A ViT layer attending over each whole image (quadratic per image)."""

    def flops(self, shape, tp):
        v = self.spec.vision
        n, h, f, width = shape.rank_vision_items, v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        core = 4.0 * attention_sq(shape) * width
        return 2.0 * n * (4 * h * width + 2 * h * f) + core, core

    def params(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        return 4 * h * width + 3 * width + h + 2 * h * f + f + h + 4 * h  # attention, MLP, two LayerNorms

    def linears(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        return {"qkv": (h, 3 * width), "proj": (width, h), "fc1": (h, f), "fc2": (f, h)}

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        v, D, n = self.spec.vision, shape.dtype_bytes, shape.rank_vision_items
        padded = sp_tokens(n, tp, sequence_parallel)
        attended = attention_sq(shape) / n if n else 0.0
        given = shape.vision_attn_tokens_sq
        several = given is None or given < float(shape.vision_items) ** 2 or padded > n
        per_tok, core = layer_act_bytes_per_token(
            v.hidden_size, v.num_attention_heads, v.num_attention_heads, v.ffn_hidden_size, False, attended, D, tp,
            dropout, attention, norm="LayerNorm", rotary=True, per_sample=attention == "flash" and several,
            built_heads=v.padded_heads(tp), sequence_parallel=sequence_parallel, kernels=kernels)
        split = tp if sequence_parallel else 1
        full = padded * v.hidden_size * D / split + padded * v.head_dim * 4.0  # input, fp32 rotary table
        return ActBytes(padded * per_tok, full, padded * (per_tok - core), padded * v.hidden_size * D / split)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        n = sp_tokens(shape.rank_vision_items, tp, sequence_parallel)
        vit = n * self.spec.vision.hidden_size * shape.dtype_bytes
        return 2 * vit, 2 * vit


class MergerCost(CostComponent):
    """LayerNorm per patch, 2x2 patches concatenated, Linear-GELU-Linear into the LLM's width."""

    efficiency = 0.4

    def flops(self, shape, tp):
        return merger_flops(self.spec, shape), 0.0

    def params(self, tp):
        return merger_params(self.spec, self.spec.vision.hidden_size)

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        hi, ho = merger_sizes(self.spec)
        tokens = shape.rank_vision_items / self.spec.vision.merge_unit
        act = merger_act(self.spec, shape, tp, self.spec.vision.hidden_size, kernels)
        return ActBytes(act, tokens * hi * shape.dtype_bytes, act, tokens * ho * shape.dtype_bytes)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        out = shape.rank_vision_items / self.spec.vision.merge_unit * self.spec.language.hidden_size * shape.dtype_bytes
        return out, out


class DeepStackLayerCost(VisionLayerCost):
    """A ViT layer at a DeepStack index: the layer plus its DeepStack merger (LayerNorm after the 2x2 shuffle)."""

    def flops(self, shape, tp):
        total, core = super().flops(shape, tp)
        return total + merger_flops(self.spec, shape), core

    def params(self, tp):
        return super().params(tp) + merger_params(self.spec, merger_sizes(self.spec)[0])

    def params_of_role(self, role, tp=1):
        """The layer is the ViT's, the merger the projector's (fc1's output and fc2's input split over TP; its norm
        and fc2's bias replicated)."""
        hi, ho = merger_sizes(self.spec)
        if role == PROJECTOR:
            return merger_params(self.spec, hi), 2 * hi + ho
        return (super().params(tp), 0) if role == self.code else (0, 0)

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # the merger runs after the layer's block, outside its recompute: its activations are kept in every mode
        layer = super().act_bytes(shape, tp, dropout, attention, sequence_parallel, kernels)
        extra = merger_act(self.spec, shape, tp, merger_sizes(self.spec)[0], kernels)
        return ActBytes(layer.act + extra, layer.full + extra, layer.selective + extra, layer.send)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        fwd, bwd = super().tp_allreduce_bytes(shape, sequence_parallel, tp)
        out = shape.rank_vision_items / self.spec.vision.merge_unit * self.spec.language.hidden_size * shape.dtype_bytes
        return fwd + out, bwd + out


def deepstack_name(slot: int) -> str:
    """The side tensor name of DeepStack feature ``slot`` (``megatron.vlm.stage.side``)."""
    return f"deepstack.{slot}"
