"""The qwen3.5-4b preset is Qwen3.5-4B's config.json.

Where the facts were read: the LLM in a Swift test's config.json and onnx_tool's Qwen3_5_4B (32 layers, hidden 2560,
16 / 4 heads, FFN 9216, linear 16 key / 32 value heads, tied; tests/test_qwen3_5_model.py's notes); the whole
config.json (the same LLM, and the ViT: depth 24, hidden 1024, 16 heads, intermediate 4096, out_hidden_size 2560,
patch 16, merge 2, 2304 positions, no DeepStack; head_dim 256, linear heads of 128, conv kernel 4, layer_types
[L, L, L, F] x 8, mrope_section [11, 11, 10] interleaved, partial_rotary_factor 0.25, rope_theta 1e7, vocab 248320)
in a Rust engine's test of a Qwen3.5-4B fine-tune (``CHANDRA_CONFIG_JSON``: a fine-tune keeps the architecture),
found with the search tool (find_string '"out_hidden_size": 2560')."""
from omnibal_ext.model.units import get_preset, role_summary

LINEAR, FULL = "linear_attention", "full_attention"


def test_qwen3_5_4b_is_the_published_size():
    spec = get_preset("qwen3.5-4b")
    v, lang = spec.vision, spec.language
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.ffn_hidden_size) == (24, 1024, 16, 4096)
    assert (v.patch_size, v.spatial_merge_size, v.num_position_embeddings, v.deepstack_visual_indexes) == \
        (16, 2, 2304, ())
    assert (lang.num_layers, lang.hidden_size, lang.num_attention_heads, lang.kv_groups, lang.ffn_hidden_size) == \
        (32, 2560, 16, 4, 9216)
    assert (lang.linear_num_key_heads, lang.linear_num_value_heads, lang.linear_key_head_dim,
            lang.linear_value_head_dim, lang.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert (lang.kv_channels, lang.rotary_dim, lang.vocab_size, lang.rotary_base, lang.mrope_section,
            lang.tie_word_embeddings) == (256, 64, 248320, 10000000, (11, 11, 10), True)
    assert lang.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 8
    assert role_summary(spec).startswith("I v*24 P E t*32 L")
