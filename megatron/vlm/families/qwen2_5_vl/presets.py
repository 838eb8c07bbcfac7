"""Qwen2.5-VL's published model sizes and a CPU model (tensor-free, no torch): ``PRESETS`` by name."""
from __future__ import annotations

from omnibal_ext.model.spec import LanguageSpec, ModelSpec

from .costs import VisionSpec

# --------------------------------------------------------------------------------------------
# Presets: the published config.json of Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct (flat form: top-level text
# fields, vision_config). ViT (all four): depth 32, hidden 1280, 16 heads, intermediate 3420, window 112,
# patch 14, temporal patch 2, merge 2, full attention at 7/15/23/31, out_hidden_size = the LLM width.
# LLM: rope_theta 1e6, rms_norm_eps 1e-6, rope_scaling {type: mrope, mrope_section: [16, 24, 24]}, q/k/v bias.
# Where each fact was checked (copies of the published config.json quoted in public repositories, read with the
# project's code search; the Hub itself is not reachable from here):
# * 3B: config.json quoted whole (hidden 2048, 36 layers, 16 heads, 2 KV heads, intermediate 11008, vocab 151936,
#   tie_word_embeddings true, vision depth 32/hidden 1280/heads 16/intermediate 3420/window 112/fullatt
#   [7, 15, 23, 31], out_hidden_size 2048, mrope_section [16, 24, 24]);
# * 7B: config.json quoted whole (3584, 28 layers, 28/4 heads, 18944, vocab 152064, untied, the same vision_config
#   with out_hidden_size 3584); transformers' module print of the 7B agrees (k/v_proj 512 wide, merger
#   5120 -> 3584);
# * 32B: the text fields of Qwen2.5-VL-32B-Instruct's config.json quoted (5120, 64 layers, 40/8 heads, 27648, vocab
#   152064); its vision_config hidden/intermediate/patch/out_hidden_size 5120 (depth and heads: the shared tower);
# * 72B: its LLM is Qwen2.5-72B, whose config.json is quoted whole (8192, 80 layers, 64/8 heads, 29568, vocab
#   152064, untied); the VL-72B's own config.json was not found, so out_hidden_size 8192 follows the merger's rule.
# --------------------------------------------------------------------------------------------
QWEN2_5_VL_VIT = VisionSpec(num_layers=32, hidden_size=1280, num_attention_heads=16, ffn_hidden_size=3420)
_TEXT = dict(rotary_base=1000000, qkv_bias=True, norm_eps=1e-6, mrope_section=(16, 24, 24))


def _preset(name, layers, hidden, heads, groups, ffn, vocab, tie):
    return ModelSpec(name=name, vision=QWEN2_5_VL_VIT, family="qwen2_5_vl",
                     language=LanguageSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                           num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=vocab,
                                           tie_word_embeddings=tie, **_TEXT))


PRESETS: dict[str, ModelSpec] = {
    "qwen2.5-vl-3b": _preset("qwen2.5-vl-3b", 36, 2048, 16, 2, 11008, 151936, True),
    "qwen2.5-vl-7b": _preset("qwen2.5-vl-7b", 28, 3584, 28, 4, 18944, 152064, False),
    "qwen2.5-vl-32b": _preset("qwen2.5-vl-32b", 64, 5120, 40, 8, 27648, 152064, False),
    "qwen2.5-vl-72b": _preset("qwen2.5-vl-72b", 80, 8192, 64, 8, 29568, 152064, False),
    # a CPU model: 4 ViT layers (full attention at 1 and 3), 3 heads (no TP > 1 divides them), 56 px windows
    "qwen2.5-vl-tiny": ModelSpec(
        name="qwen2.5-vl-tiny", family="qwen2_5_vl", init_method_std=0.06,
        vision=VisionSpec(num_layers=4, hidden_size=48, num_attention_heads=3, ffn_hidden_size=96,
                          fullatt_block_indexes=(1, 3), window_size=56),
        language=LanguageSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=192, vocab_size=384, rotary_base=1000000, qkv_bias=True, norm_eps=1e-6,
                              mrope_section=(2, 3, 3))),
}
