"""Qwen3-VL's (and Qwen3-VL-MoE's) published model sizes and a CPU model (tensor-free, no torch): ``PRESETS``."""
from __future__ import annotations

from dataclasses import replace

from omnibal_ext.model.moe import MoESpec, layer_freq_from_qwen
from omnibal_ext.model.spec import ModelSpec

from .costs import qwen3_language
from megatron.vlm.lineages.qwen.vision_costs import VisionSpec

# --------------------------------------------------------------------------------------------
# Presets: the published config.json of Qwen/Qwen3-VL-{2B,4B,8B,32B}-Instruct (nested form written by
# transformers 4.57: text_config with rope_scaling {mrope_interleaved: true, mrope_section: [24, 20, 20]},
# rope_theta 5e6, head_dim 128, no qkv bias, rms_norm_eps 1e-6, vocab 151936; vision_config with patch 16,
# temporal patch 2, merge 2, num_position_embeddings 2304, hidden_act gelu_pytorch_tanh, out_hidden_size = the LLM
# width). The facts and where each was read are in tests/test_qwen3_vl_model.py (PUBLISHED).
# --------------------------------------------------------------------------------------------
SMALL_VIT = VisionSpec(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                       deepstack_visual_indexes=(5, 11, 17))
LARGE_VIT = VisionSpec(num_layers=27, hidden_size=1152, num_attention_heads=16, ffn_hidden_size=4304,
                       deepstack_visual_indexes=(8, 16, 24))
_TEXT = dict(rotary_base=5000000, norm_eps=1e-6, head_dim=128, vocab_size=151936,
             mrope_section=(24, 20, 20))



def _preset(name, vit, layers, hidden, heads, groups, ffn, tie):
    return ModelSpec(name=name, vision=vit, family="qwen3_vl",
                     language=qwen3_language(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                             num_query_groups=groups, ffn_hidden_size=ffn, tie_word_embeddings=tie,
                                             **_TEXT))


PRESETS: dict[str, ModelSpec] = {
    "qwen3-vl-2b": _preset("qwen3-vl-2b", SMALL_VIT, 28, 2048, 16, 8, 6144, True),
    "qwen3-vl-4b": _preset("qwen3-vl-4b", SMALL_VIT, 36, 2560, 32, 8, 9728, True),
    "qwen3-vl-8b": _preset("qwen3-vl-8b", LARGE_VIT, 36, 4096, 32, 8, 12288, False),
    "qwen3-vl-32b": _preset("qwen3-vl-32b", LARGE_VIT, 64, 5120, 64, 8, 25600, False),
    # a CPU model: 4 ViT layers with DeepStack at the first and the last, 3 heads (no TP > 1 divides them), a
    # 4 x 4 position table (smaller than most images' grids), 4 LLM layers
    "qwen3-vl-tiny": ModelSpec(
        name="qwen3-vl-tiny", family="qwen3_vl", init_method_std=0.06,
        vision=VisionSpec(num_layers=4, hidden_size=48, num_attention_heads=3, ffn_hidden_size=96,
                          num_position_embeddings=16, deepstack_visual_indexes=(0, 3)),
        language=qwen3_language(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                ffn_hidden_size=192, vocab_size=384, rotary_base=1000000, norm_eps=1e-6, head_dim=16,
                                mrope_section=(2, 3, 3))),
}

# --------------------------------------------------------------------------------------------
# Qwen3-VL-MoE (transformers' Qwen3VLMoeForConditionalGeneration): Qwen/Qwen3-VL-30B-A3B-Instruct and
# -235B-A22B-Instruct: the large ViT (27 layers, DeepStack at 8, 16, 24) and a Qwen3-MoE decoder (every layer MoE:
# decoder_sparse_step 1, no mlp_only_layers; 128 experts, top 8, renormalised; untied; head_dim 128, rope_theta 5e6,
# mrope_section [24, 20, 20]). The facts and where each was read are in tests/test_qwen3_vl_moe.py (PUBLISHED).
# --------------------------------------------------------------------------------------------
def _moe_preset(name, layers, hidden, heads, groups, ffn, expert_ffn):
    dense = _preset(name, LARGE_VIT, layers, hidden, heads, groups, ffn, False)
    moe = MoESpec(num_experts=128, topk=8, ffn_hidden_size=expert_ffn, layer_freq=layer_freq_from_qwen(layers, 1))
    return dense.replace(language=replace(dense.language, moe=moe))


PRESETS.update({
    "qwen3-vl-30b-a3b": _moe_preset("qwen3-vl-30b-a3b", 48, 2048, 32, 4, 6144, 768),
    "qwen3-vl-235b-a22b": _moe_preset("qwen3-vl-235b-a22b", 94, 4096, 64, 4, 12288, 1536),
})
