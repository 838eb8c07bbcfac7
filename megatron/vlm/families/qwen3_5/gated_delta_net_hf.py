"""transformers' ``Qwen3_5GatedDeltaNet`` tensors <-> ours (``megatron/vlm/layers/gated_delta_net.py``), per TP rank.

Names relative to the layer (HF: ``model.language_model.layers.<i>.linear_attn.``; ours: the layer's
``self_attention.``), HF -> ours on TP rank ``r`` of ``tp`` (``kd = key_dim / tp``, ``vd = value_dim / tp``,
``nh = value_heads / tp``; rows of rank r: ``[r*n, (r+1)*n)`` of each block)::

    in_proj_qkv.weight [2*key_dim + value_dim, h]  -> in_proj.weight rows [q_r | k_r | v_r | z_r | b_r | a_r]
    in_proj_z.weight   [value_dim, h]                 (q: qkv rows [0, key_dim), k: [key_dim, 2*key_dim),
    in_proj_b.weight   [value_heads, h]                v: [2*key_dim, ...); z, b, a: their own rows)
    in_proj_a.weight   [value_heads, h]
    conv1d.weight      [2*key_dim + value_dim, 1, w] -> conv1d.weight [q_r | k_r | v_r] channels
    A_log, dt_bias     [value_heads]                  -> A_log, dt_bias rows of rank r
    norm.weight        [value_head_dim]               -> out_norm.weight (replicated)
    out_proj.weight    [h, value_dim]                 -> out_proj.weight columns of rank r

A key head's rows stay with its value heads (key head i serves value heads i*r'..i*r'+r'-1, r' their ratio), so a
rank's slices are whole heads. ``ours_to_hf`` is the inverse (from every rank's tensors), bit for bit.
"""
from __future__ import annotations

import torch
from torch import Tensor

from omnibal_ext.model.linear_attention import LinearAttentionShape

HF_NAMES = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
            "A_log", "dt_bias", "norm.weight", "out_proj.weight")
OUR_NAMES = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight", "out_proj.weight")


def _rows(t: Tensor, width: int, rank: int, tp: int) -> Tensor:
    """Rank ``rank``'s rows of a block of ``width`` rows (dim 0)."""
    n = width // tp
    return t[rank * n:(rank + 1) * n]


def _qkv_blocks(t: Tensor, dims: LinearAttentionShape) -> tuple[Tensor, Tensor, Tensor]:
    return torch.split(t, [dims.key_dim, dims.key_dim, dims.value_dim], dim=0)


def hf_to_ours(hf: dict[str, Tensor], dims: LinearAttentionShape, rank: int = 0, tp: int = 1) -> dict[str, Tensor]:
    """TP rank ``rank``'s tensors of our layer from the HF layer's (names relative to the layer, module docstring)."""
    dims.check_tp(tp)
    missing = [n for n in HF_NAMES if n not in hf]
    if missing:
        raise KeyError(f"hf_to_ours: the HF Gated DeltaNet layer lacks {missing}")
    q, k, v = _qkv_blocks(hf["in_proj_qkv.weight"], dims)
    cq, ck, cv = _qkv_blocks(hf["conv1d.weight"], dims)
    heads = dims.value_heads
    in_proj = torch.cat([_rows(q, dims.key_dim, rank, tp), _rows(k, dims.key_dim, rank, tp),
                         _rows(v, dims.value_dim, rank, tp),
                         _rows(hf["in_proj_z.weight"], dims.value_dim, rank, tp),
                         _rows(hf["in_proj_b.weight"], heads, rank, tp),
                         _rows(hf["in_proj_a.weight"], heads, rank, tp)])
    conv = torch.cat([_rows(cq, dims.key_dim, rank, tp), _rows(ck, dims.key_dim, rank, tp),
                      _rows(cv, dims.value_dim, rank, tp)])
    out_proj = _rows(hf["out_proj.weight"].t(), dims.value_dim, rank, tp).t()
    return {"in_proj.weight": in_proj.clone(), "conv1d.weight": conv.clone(),
            "A_log": _rows(hf["A_log"], heads, rank, tp).clone(),
            "dt_bias": _rows(hf["dt_bias"], heads, rank, tp).clone(),
            "out_norm.weight": hf["norm.weight"].clone(), "out_proj.weight": out_proj.contiguous()}


def ours_to_hf(ranks: list[dict[str, Tensor]], dims: LinearAttentionShape) -> dict[str, Tensor]:
    """The HF layer's tensors from every TP rank's tensors of ours (``ranks[r]``: rank r's, names as OUR_NAMES)."""
    tp = len(ranks)
    dims.check_tp(tp)
    sections = dims.in_proj_sections(tp)
    parts = [torch.split(r["in_proj.weight"], sections, dim=0) for r in ranks]  # per rank: q k v z b a
    conv = [torch.split(r["conv1d.weight"], sections[:3], dim=0) for r in ranks]
    cat = lambda blocks, i: torch.cat([b[i] for b in blocks])  # noqa: E731  (block i of every rank)
    return {"in_proj_qkv.weight": torch.cat([cat(parts, 0), cat(parts, 1), cat(parts, 2)]),
            "in_proj_z.weight": cat(parts, 3), "in_proj_b.weight": cat(parts, 4), "in_proj_a.weight": cat(parts, 5),
            "conv1d.weight": torch.cat([cat(conv, 0), cat(conv, 1), cat(conv, 2)]),
            "A_log": torch.cat([r["A_log"] for r in ranks]), "dt_bias": torch.cat([r["dt_bias"] for r in ranks]),
            "norm.weight": ranks[0]["out_norm.weight"].clone(),
            "out_proj.weight": torch.cat([r["out_proj.weight"] for r in ranks], dim=1)}
