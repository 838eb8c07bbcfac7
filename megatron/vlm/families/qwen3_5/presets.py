"""Qwen3.5's (and Qwen3.5-MoE's) published model sizes and a CPU model (tensor-free, no torch): ``PRESETS``."""
from __future__ import annotations

from omnibal_ext.model.spec import ModelSpec

from .costs import FULL, LINEAR, qwen3_5_language, qwen3_5_moe_experts, vision

# --------------------------------------------------------------------------------------------
# Presets: the dense Qwen/Qwen3.5-* sizes whose config.json facts were found (where each was read:
# tests/test_qwen3_5_model.py, PUBLISHED). Common: vocab 248320, head_dim 256, rope_theta 1e7, partial rotary
# 0.25, mrope_section [11, 11, 10] interleaved, rms_norm_eps 1e-6, linear conv kernel 4, key/value head dims 128,
# every fourth layer full attention; the ViT: patch 16, temporal 2, merge 2, 2304 positions. 2B's ViT and tie are
# not in the facts found (its LLM is): 4B's ViT and tied embeddings, as the other small sizes have.
# --------------------------------------------------------------------------------------------
_TEXT = dict(rotary_base=10000000, norm_eps=1e-6, head_dim=256, vocab_size=248320, mrope_section=(11, 11, 10),
             partial_rotary_factor=0.25, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4)
SMALL_VIT = vision(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072)
MID_VIT = vision(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096)
LARGE_VIT = vision(num_layers=27, hidden_size=1152, num_attention_heads=16, ffn_hidden_size=4304)


def _preset(name, vit, layers, hidden, heads, groups, ffn, key_heads, value_heads, tie):
    return ModelSpec(name=name, vision=vit, family="qwen3_5", language=qwen3_5_language(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        tie_word_embeddings=tie, **_TEXT))


PRESETS: dict[str, ModelSpec] = {
    "qwen3.5-0.8b": _preset("qwen3.5-0.8b", SMALL_VIT, 24, 1024, 8, 2, 3584, 16, 16, True),
    "qwen3.5-2b": _preset("qwen3.5-2b", MID_VIT, 24, 2048, 8, 2, 6144, 16, 16, True),
    "qwen3.5-4b": _preset("qwen3.5-4b", MID_VIT, 32, 2560, 16, 4, 9216, 16, 32, True),
    "qwen3.5-9b": _preset("qwen3.5-9b", LARGE_VIT, 32, 4096, 16, 4, 12288, 16, 32, False),
    "qwen3.5-27b": _preset("qwen3.5-27b", LARGE_VIT, 64, 5120, 24, 4, 17408, 16, 48, False),
    # a CPU model: 2 ViT layers, 6 LLM layers in an order other than every fourth (linear, full, linear, linear,
    # full, linear), linear heads unlike the attention heads, a quarter of head_dim rotated
    "qwen3.5-tiny": ModelSpec(
        name="qwen3.5-tiny", family="qwen3_5", init_method_std=0.06,
        vision=vision(num_layers=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96,
                      num_position_embeddings=16),
        language=qwen3_5_language(
            num_layers=6, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            vocab_size=384, rotary_base=1000000, norm_eps=1e-6, head_dim=32, mrope_section=(1, 2, 1),
            partial_rotary_factor=0.25, layer_types=(LINEAR, FULL, LINEAR, LINEAR, FULL, LINEAR),
            linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, linear_chunk_size=8)),
}


# Presets: the Qwen/Qwen3.5-*-A* sizes whose config.json facts were found (the facts and where each was read:
# tests/test_qwen3_5_moe.py, PUBLISHED). Common with the dense sizes (_TEXT): vocab 248320, head_dim 256, rope 1e7,
# partial rotary 0.25, mrope [11, 11, 10], linear key / value head dims 128, conv 4, every fourth layer full,
# untied; the ViT is the large one (transformers' Qwen3_5MoeVisionConfig defaults: 27 layers, 1152 wide, 16 heads,
# MLP 4304). The dense ``ffn_hidden_size`` (no layer has a dense MLP) is the shared expert's width.
def _moe_preset(name, layers, hidden, heads, groups, key_heads, value_heads, experts, topk, expert_ffn, shared_ffn):
    return ModelSpec(name=name, vision=LARGE_VIT, family="qwen3_5", language=qwen3_5_language(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=shared_ffn, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        tie_word_embeddings=False, moe=qwen3_5_moe_experts(layers, experts, topk, expert_ffn, shared_ffn), **_TEXT))


MOE_PRESETS: dict[str, ModelSpec] = {
    "qwen3.5-35b-a3b": _moe_preset("qwen3.5-35b-a3b", 40, 2048, 16, 2, 16, 32, 256, 8, 512, 512),
    "qwen3.5-122b-a10b": _moe_preset("qwen3.5-122b-a10b", 48, 3072, 32, 2, 16, 64, 256, 8, 1024, 1024),
    "qwen3.5-397b-a17b": _moe_preset("qwen3.5-397b-a17b", 60, 4096, 32, 2, 16, 64, 512, 10, 1024, 1024),
}
PRESETS.update(MOE_PRESETS)
