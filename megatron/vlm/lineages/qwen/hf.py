"""The Qwen lineage's Hugging Face tensor recipes shared by its ViTs: a ViT layer's attention stored per real head.
"""
from __future__ import annotations

from megatron.vlm.hf.recipes import Part, Recipe, whole


def vit_attention_recipes(table, u: str, m: dict, heads: int, d: int, H: int) -> None:
    """A Qwen ViT layer's fused attention (``m["qkv"]``, ``m["proj"]``: HF prefixes of ``weight`` and ``bias``)
    per real head (megatron/vlm/hf/keys.py's docstring): HF's fused qkv holds all q rows, then all k rows, then
    all v rows; our head h is [its q rows | its k rows | its v rows]."""
    hf, add, R = table.hf, table.add, heads
    sa = u + "self_attention."
    qkv, qkv_b = hf(m["qkv"] + "weight", (3 * H, H)), hf(m["qkv"] + "bias", (3 * H,))

    def per_head(name):
        return tuple(Part(name, j * H + h * d, j * H + (h + 1) * d) for h in range(R) for j in range(3))

    add(sa + "linear_qkv.weight", Recipe((R, 3 * d, H), per_head(qkv), 3 * d))
    add(sa + "linear_qkv.bias", Recipe((R, 3 * d), per_head(qkv_b), 3 * d))
    proj = hf(m["proj"] + "weight", (H, H))
    add(sa + "linear_proj.weight", Recipe((R, H, d), tuple(Part(proj, 0, H, (h * d, (h + 1) * d)) for h in range(R)), H))
    add(sa + "linear_proj.bias", whole(hf(m["proj"] + "bias", (H,)), (H,)))
