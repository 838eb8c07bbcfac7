"""Stochastic depth (drop path) of the ViT: each layer's attention and MLP branches are dropped per ViT item (a
tile where the ViT's batch element is a tile; an image where the ViT runs the patches of all images in one packed
row) with a rate rising linearly over the layers, ``linspace(0, rate, depth)``, and the kept branches scaled by
1 / keep probability (timm's ``drop_path``).

The mask is not drawn from an RNG state but hashed from (seed, iteration, sample id, tile within the sample,
layer, branch): a counter-based draw, so every TP/PP/DP size, layout, micro-batch size and packing gives the
serial run's masks, and a recomputed layer (full recompute replays the forward in the backward) sees the mask
its forward saw.  The collate hashes (sample id, tile) on the host (``tile_keys``, [tiles] int64); the ViT
component mixes in the seed and the iteration on the device (``iteration_keys``) and passes the result to its
TransformerBlocks as ``context``, which megatron-core hands to every layer and saves for recompute (the ViT has
no cross-attention: its layers pass ``context`` through untouched).  ``DropPathLayer`` gives it to its two
``DropPathBDA`` submodules (the bias-dropout-add replacements), which mix in the layer and branch.

The hash is a 32-bit integer mix (three xor-shift-multiply rounds) on int64 tensors whose products stay below
2**63, so it runs alike on the host, CPU and CUDA and never reads a device value back (no sync).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.vlm.layers.seeding import SeededTransformerLayer

_M32 = 0xFFFFFFFF
_MUL = 0x045D9F3B  # < 2**27: a product with a 32-bit value stays below 2**63


def mix32(x):
    """A 32-bit integer hash of ``x`` (a Python int or an int64 tensor of values in [0, 2**32))."""
    for _ in range(3):
        x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def hash_key(*parts: int) -> int:
    """Hash of a tuple of non-negative Python ints (64-bit ones split into two halves)."""
    h = 0x9E3779B9
    for p in parts:
        p = int(p) & 0xFFFFFFFFFFFFFFFF
        h = mix32(h ^ (p & _M32))
        h = mix32(h ^ (p >> 32))
    return h


def tile_keys(sample_ids: list[int], tiles_per_sample: list[int]) -> torch.Tensor:
    """int64 [sum of tiles]: the key of each tile of a micro-batch, from (sample id, tile index in the sample)."""
    keys = [hash_key(sid, t) for sid, n in zip(sample_ids, tiles_per_sample) for t in range(n)]
    return torch.tensor(keys, dtype=torch.int64)


def image_patch_keys(sample_ids: list[int], patches_per_image: list[list[int]]) -> torch.Tensor:
    """int64 [sum of patches]: one key per patch row, every patch of an image taking its image's key, from (sample
    id, image index in the sample): drop path per image over packed patch rows."""
    keys = [hash_key(sid, k) for sid, sizes in zip(sample_ids, patches_per_image)
            for k, n in enumerate(sizes) for _ in range(n)]
    return torch.tensor(keys, dtype=torch.int64)


def iteration_keys(keys: torch.Tensor, seed: int, iteration: int) -> torch.Tensor:
    """The tiles' keys of one training iteration (device tensor in, device tensor out; no sync)."""
    return mix32(keys ^ hash_key(seed, iteration))


def layer_rates(rate: float, depth: int) -> list[float]:
    """Drop probability of each of ``depth`` ViT layers: ``linspace(0, rate, depth)``, as the published ViTs do."""
    return torch.linspace(0, rate, depth).tolist() if depth > 0 else []


def keep_mask(keys: torch.Tensor, layer: int, branch: int, drop_prob: float, dtype) -> torch.Tensor:
    """[tiles] of 0 (dropped) or 1 / keep probability, for ViT layer ``layer`` and branch (0 attention, 1 MLP)."""
    h = mix32(keys ^ hash_key(layer, branch))
    u = (h >> 8).to(torch.float64) * (1.0 / (1 << 24))  # uniform in [0, 1)
    keep = 1.0 - drop_prob
    return (u < keep).to(dtype) / keep


class DropPathBDA(torch.nn.Module):
    """Bias-dropout-add with drop path of the branch per item, and optionally a layer scale:
    ``residual + keep_mask * scale * dropout(x + bias)``; ``axis``: the hidden states' dimension the keys run
    along (1: [tokens per tile, tiles, hidden], one key per tile; 0: packed rows [rows, 1, hidden], one per row).

    A TransformerLayer's ``self_attn_bda`` (branch 0) / ``mlp_bda`` (branch 1) submodule; called like
    megatron-core's bias-dropout-add, ``bda(training, fused)(x_with_bias, residual, dropout_prob)``.
    ``layer`` (global ViT layer index) and ``drop_prob`` are set by ``DropPathLayer``; ``keys`` per forward.
    scale_init: None for no layer scale, else the trained ``scale`` parameter [hidden] starts there (the
    same parameter as ``LayerScale``'s, so checkpoints and HF names do not change).
    """

    def __init__(self, config=None, hidden_size: int = 0, branch: int = 0, scale_init: float | None = None,
                 axis: int = 1):
        super().__init__()
        self.branch, self.axis = branch, axis
        self.layer, self.drop_prob, self.keys = 0, 0.0, None
        if scale_init is not None:
            self.scale = torch.nn.Parameter(torch.full((hidden_size,), float(scale_init)))
        else:
            self.scale = None

    def forward(self, training: bool, fused: bool = False):
        def bias_dropout_droppath_add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            x = F.dropout(x, p=prob, training=training)
            if self.scale is not None:
                x = x * self.scale
            if training and self.drop_prob > 0 and self.keys is not None:
                mask = keep_mask(self.keys, self.layer, self.branch, self.drop_prob, x.dtype)
                shape = [1] * x.dim()
                shape[self.axis] = -1
                x = x * mask.view(shape)
            return residual + x

        return bias_dropout_droppath_add


class DropPathLayer(SeededTransformerLayer):
    """A seeded ViT layer with drop path: its ``context`` argument carries the tiles' iteration keys
    (``iteration_keys``), handed to its DropPathBDA submodules right before they run (in the forward and in
    a recompute alike).  vit_first_unit: unit index of ViT layer 0; rates: the drop probability per ViT layer."""

    def __init__(self, config, submodules, layer_number=1, seed=0, first_unit_index=0, redraw=None,
                 vit_first_unit=1, rates=(), **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, seed=seed,
                         first_unit_index=first_unit_index, redraw=redraw, **kwargs)
        vit_layer = first_unit_index + layer_number - 1 - vit_first_unit
        for bda in (self.self_attn_bda, self.mlp_bda):
            bda.layer, bda.drop_prob = vit_layer, float(rates[vit_layer])

    def forward(self, *args, **kwargs):
        keys = kwargs.get("context")
        self.self_attn_bda.keys = self.mlp_bda.keys = keys
        try:
            out, _ = super().forward(*args, **kwargs)
        finally:
            self.self_attn_bda.keys = self.mlp_bda.keys = None
        return out, keys


def with_drop_path(spec, vit_first_unit: int, rates, scale_init: float | None = None, hidden_size: int = 0,
                   axis: int = 1):
    """A ViT layer ``spec`` (a megatron-core ModuleSpec of a ``SeededTransformerLayer``) made a ``DropPathLayer``
    whose two bias-dropout-adds are ``DropPathBDA`` (carrying the layer scale ``scale_init`` when not None, over
    ``hidden_size``); vit_first_unit: unit index of ViT layer 0; rates: drop probability per ViT layer; axis: see
    ``DropPathBDA``. The spec is changed in place and returned."""

    spec.module = DropPathLayer
    spec.params = {**spec.params, "vit_first_unit": vit_first_unit, "rates": tuple(rates)}
    for name, branch in (("self_attn_bda", 0), ("mlp_bda", 1)):
        setattr(spec.submodules, name, ModuleSpec(module=DropPathBDA, params={
            "hidden_size": hidden_size, "branch": branch, "scale_init": scale_init, "axis": axis}))
    return spec
