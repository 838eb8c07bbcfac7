"""Qwen2.5-VL, planning side: its ViT (Conv3d patch embedding, window-attention and full-attention layers,
2-D rotary positions), the 2x2 patch merger as projector, the Qwen2.5 LLM with multimodal RoPE, and the
published model sizes.

The ViT's work is counted in patches (``MicroBatchShape.vision_items``; ``Family.vision_item`` "patch"): an
image of ``grid_thw = (t, h, w)`` runs ``t*h*w`` patch tokens (14 x 14 px, two frames of a still image in
one patch) and becomes ``t*h*w / 4`` LLM tokens after the 2x2 merger. Attention is per segment: a
full-attention layer (``fullatt_block_indexes``) attends within each image (frame), a window-attention
layer within each window of ``window_size`` px (4 x 4 merged tokens = 8 x 8 patches at 112 px; windows at
an image's right and bottom edges are smaller). The attention work of a micro-batch thus needs the sums of
squared segment lengths, ``MicroBatchShape.vision_attn_tokens_sq`` (images) and
``vision_window_tokens_sq`` (windows); when they are not given, the patches are taken as one image and as
full windows.

Context parallelism (``MicroBatchShape.cp``): the runtime gives each CP rank whole images (contiguous runs balanced
by patches); the components count the busiest rank as ``ceil(patches / CP)`` patches and ``1 / CP`` of the
attention squares, as for InternVL's tiles -- an approximation (whole images: a rank can get more, up to the
largest image's share).

FLOPs (forward, one multiply-add = 2), ``n`` patches, ``h`` hidden, ``f`` MLP hidden, ``w`` attention width:
* ViT layer: ``2*n*(4*h*w + 3*h*f)`` (QKV + out projection, 3-matrix SwiGLU MLP) plus attention scores and
  context ``4*S*w`` with ``S`` the layer kind's sum of squared segment lengths;
* merger: ``2*(n/4)*(16*h^2 + 4*h*h_llm)``;
* patch embedding: ``2*n*(C*2*14*14)*h``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal_ext.errors import UserError
from omnibal_ext.model.components import (FUSED_KERNELS, ActBytes, CostComponent, layer_act_bytes_per_token,
                                          norm_bytes_per_token, sp_tokens)
from omnibal_ext.model.spec import ModelSpec


@dataclass(frozen=True)
class VisionSpec:
    """The Qwen2.5-VL ViT: pre-RMSNorm layers with bias, SwiGLU MLP, 2-D RoPE, window attention except in
    ``fullatt_block_indexes``; no class token, no learned positions, no final norm (the merger has one)."""

    num_layers: int  # HF depth
    hidden_size: int
    num_attention_heads: int  # HF num_heads
    ffn_hidden_size: int  # HF intermediate_size
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    window_size: int = 112  # px
    patch_size: int = 14  # px
    temporal_patch_size: int = 2  # frames per patch (a still image is repeated)
    in_channels: int = 3
    spatial_merge_size: int = 2  # merged tokens are m x m patches
    norm_eps: float = 1e-6  # the layers' and the merger's RMSNorm (HF: fixed 1e-6)
    rotary_base: int = 10000  # the 2-D RoPE's theta (HF vision rope_parameters.rope_theta)
    normalization: str = "RMSNorm"
    tokens_per_second: int = 2  # a video's temporal RoPE ids per second (HF vision_config.tokens_per_second)

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i]
        if bad:
            raise UserError(f"fullatt_block_indexes {bad} are not layer numbers")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise UserError(f"ViT hidden size {self.hidden_size} / {self.num_attention_heads} heads must give a head "
                            "width divisible by 4 (2-D RoPE: a quarter of it per axis and half)")
        if self.window_patches_side < self.spatial_merge_size:
            raise UserError(f"window_size {self.window_size} px is smaller than one merged token")
        if self.normalization != "RMSNorm":
            raise UserError("the Qwen2.5-VL ViT uses RMSNorm")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_heads(self, tp: int) -> int:
        """Heads built at tensor-parallel size ``tp``: the real ones rounded up to a multiple of ``tp`` (padded
        heads have zero weights and stay zero)."""
        return -(-self.num_attention_heads // tp) * tp

    def full_attention(self, layer: int) -> bool:
        return layer in self.fullatt_block_indexes

    @property
    def window_patches_side(self) -> int:
        """Patches per side of a full window (8 at 112 px: 4 x 4 merged tokens)."""
        return self.window_size // (self.spatial_merge_size * self.patch_size) * self.spatial_merge_size

    def segments_sq(self, rows, cols) -> tuple[np.ndarray, np.ndarray]:
        """(full-attention, window) sums of squared segment lengths (patches^2) of images of ``rows x cols`` patches
        (arrays, one per image; ``PatchVision``): the whole image is one segment, ``(rows*cols)^2``; windows of
        ``w x w`` patches (``window_patches_side``) tile it from the top left, ragged at the bottom and right edges,
        so their squares sum to ``S(rows) * S(cols)`` with ``S(n) = (n // w) * w^2 + (n % w)^2``."""
        w = self.window_patches_side
        rows = np.asarray(rows, dtype=np.float64)
        cols = np.asarray(cols, dtype=np.float64)

        def side(n):
            return np.floor(n / w) * w * w + np.mod(n, w) ** 2

        return (rows * cols) ** 2, side(rows) * side(cols)

    @property
    def patch_dim(self) -> int:
        """Values of one patch row (3 x 2 x 14 x 14 = 1176)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


def _attention_sq(spec: ModelSpec, shape, window: bool) -> float:
    """Sum of squared attention-segment lengths (patches^2) of one ViT layer kind over the micro-batch, one CP
    rank's share (``MicroBatchShape.rank_vision_sq``)."""
    n = float(shape.vision_items)
    if window:
        given = shape.vision_window_tokens_sq
        return shape.rank_vision_sq(given if given is not None else n * spec.vision.window_patches_side**2)
    given = shape.vision_attn_tokens_sq
    return shape.rank_vision_sq(given if given is not None else n * n)


def _several_segments(shape, window: bool, padded: int) -> bool:
    """Whether a ViT layer kind's packed attention runs over more than one segment (``padded`` tokens: a
    sequence-parallel pad is a segment of its own). One segment keeps its output as the out-projection input;
    several keep each output beside their concatenation. A shape that does not give the kind's sum of squares
    stands for several (as the LLM's rows)."""
    n = shape.vision_items
    given = shape.vision_window_tokens_sq if window else shape.vision_attn_tokens_sq
    # sum(len^2) == n^2 only for one segment (of the micro-batch; its CP rank's part then is that one too)
    return given is None or given < float(n) * n or padded > shape.rank_vision_items


class VisionEmbedCost(CostComponent):
    """Conv3d patch embedding without bias (a 1176-wide reduction per patch: low efficiency)."""

    efficiency = 0.3

    def flops(self, shape, tp):
        v = self.spec.vision
        return shape.rank_vision_items * 2.0 * v.patch_dim * v.hidden_size, 0.0

    def params(self, tp):
        v = self.spec.vision
        return v.patch_dim * v.hidden_size

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # the convolution's input (the pixels in the compute dtype) and the int64 index that puts the patches in
        # window order
        v, D, n = self.spec.vision, shape.dtype_bytes, shape.rank_vision_items
        act = n * (v.patch_dim * D + 8.0)
        return ActBytes(act, act, act, n * v.hidden_size * D)


class _VisionLayerCost(CostComponent):
    window = False

    def flops(self, shape, tp):
        v = self.spec.vision
        n, h, f, width = shape.rank_vision_items, v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        core = 4.0 * _attention_sq(self.spec, shape, self.window) * width
        return 2.0 * n * (4 * h * width + 3 * h * f) + core, core

    def params(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        return 4 * h * width + 3 * width + h + 3 * h * f + 2 * f + h + 2 * h  # attention, MLP, two RMSNorms

    def linears(self, tp):
        v = self.spec.vision
        h, f, width = v.hidden_size, v.ffn_hidden_size, v.padded_heads(tp) * v.head_dim
        return {"qkv": (h, 3 * width), "proj": (width, h), "fc1": (h, 2 * f), "fc2": (f, h)}  # SwiGLU fc1

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # sequence parallel: the packed patches padded to a multiple of TP once (segments stay whole), and the
        # layer input kept for full recompute and sent to the next stage split over TP, as InternViT's
        v, D, n = self.spec.vision, shape.dtype_bytes, shape.rank_vision_items
        padded = sp_tokens(n, tp, sequence_parallel)
        attended = _attention_sq(self.spec, shape, self.window) / n if n else 0.0
        per_sample = attention == "flash" and _several_segments(shape, self.window, padded)
        per_tok, core = layer_act_bytes_per_token(
            v.hidden_size, v.num_attention_heads, v.num_attention_heads, v.ffn_hidden_size, True, attended, D, tp,
            dropout, attention, norm="RMSNorm", rotary=True, per_sample=per_sample,
            built_heads=v.padded_heads(tp), sequence_parallel=sequence_parallel, kernels=kernels)
        n = padded
        split = tp if sequence_parallel else 1
        full = n * v.hidden_size * D / split + n * v.head_dim * 4.0  # input, fp32 rotary table
        return ActBytes(n * per_tok, full, n * (per_tok - core), n * v.hidden_size * D / split)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        # all-gather + reduce-scatter of the padded patches
        n = sp_tokens(shape.rank_vision_items, tp, sequence_parallel)
        vit = n * self.spec.vision.hidden_size * shape.dtype_bytes
        return 2 * vit, 2 * vit


class WindowLayerCost(_VisionLayerCost):
    """A ViT layer attending within each window (quadratic per window)."""

    window = True


class FullLayerCost(_VisionLayerCost):
    """A ViT layer attending over each whole image (quadratic per image)."""

    window = False


class MergerCost(CostComponent):
    """RMSNorm per patch, 2x2 patches concatenated, Linear-GELU-Linear into the LLM's width."""

    efficiency = 0.4

    def _sizes(self):
        v = self.spec.vision
        return v.hidden_size * v.merge_unit, self.spec.language.hidden_size

    def flops(self, shape, tp):
        hi, ho = self._sizes()
        tokens = shape.rank_vision_items / self.spec.vision.merge_unit
        return 2.0 * tokens * (hi * hi + hi * ho), 0.0

    def params(self, tp):
        hi, ho = self._sizes()
        return self.spec.vision.hidden_size + hi * hi + hi + hi * ho + ho

    def act_bytes(self, shape, tp, dropout, attention, sequence_parallel=False, kernels=FUSED_KERNELS):
        # per patch the norm's input and what it keeps (norm_bytes_per_token); per merged token the fc1 input
        # (replicated), the GELU input and the fc2 input (split), and the int64 index back to processor order
        v, (hi, ho) = self.spec.vision, self._sizes()
        D, n = shape.dtype_bytes, shape.rank_vision_items
        tokens = n / v.merge_unit
        norm = n * (v.hidden_size * D + norm_bytes_per_token(v.hidden_size, D, "RMSNorm", kernels))
        act = norm + tokens * (hi * D + 2 * hi * D / tp + 8.0)
        return ActBytes(act, tokens * hi * D, act, tokens * ho * D)

    def tp_allreduce_bytes(self, shape, sequence_parallel=False, tp=1):
        out = shape.rank_vision_items / self.spec.vision.merge_unit * self.spec.language.hidden_size * shape.dtype_bytes
        return out, out
