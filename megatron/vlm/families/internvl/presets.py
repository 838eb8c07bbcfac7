"""InternVL's published model sizes (tensor-free, no torch): ``PRESETS`` by name; "tiny" is the trainer's default."""
from __future__ import annotations

import dataclasses

from omnibal_ext.model.moe import MoESpec, layer_freq_from_qwen
from omnibal_ext.model.spec import LanguageSpec, ModelSpec

from .costs import NAME, VisionSpec

# --------------------------------------------------------------------------------------------
# Presets.  Sizes of the paper's models are the published ones (InternVL-Chat-V1.5 family):
# InternViT-6B (45 layers used, hidden 3200, 25 heads, MLP 12800, 448px tiles, patch 14, RMSNorm,
# qk-norm, no qkv bias, layer scale starting at 0.1),
# InternLM2-20B (48 layers, hidden 6144, 48 heads, 8 KV heads, MLP 16384, vocabulary 92544, no qkv bias,
# untied embeddings),
# Nous-Hermes-2-Yi-34B (60 layers, hidden 7168, 56 heads, 8 KV heads, MLP 20480, vocabulary 64000).
# --------------------------------------------------------------------------------------------
INTERNVIT_6B = VisionSpec(
    num_layers=45, hidden_size=3200, num_attention_heads=25, ffn_hidden_size=12800,
    image_size=448, patch_size=14, normalization="RMSNorm", norm_eps=1e-6, qkv_bias=False, qk_norm=True,
    layer_scale_init=0.1,
)

PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        family=NAME, name="tiny",
        vision=VisionSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                          image_size=32, patch_size=8),
        language=LanguageSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=192,
                              num_query_groups=2, vocab_size=384),
        # 0.02 suits hidden sizes in the thousands; at 64 it leaves attention uniform for long and
        # the ViT-to-LLM alignment of a model trained from scratch crawls (measured: digits val
        # accuracy 19% vs 47% after 1000 steps with 0.06).
        init_method_std=0.06,
    ),
    "internvl-6b-20b": ModelSpec(
        family=NAME, name="internvl-6b-20b",
        vision=INTERNVIT_6B,
        language=LanguageSpec(num_layers=48, hidden_size=6144, num_attention_heads=48, ffn_hidden_size=16384,
                              num_query_groups=8, vocab_size=92544, rotary_base=1000000),
    ),
    "internvl-6b-34b": ModelSpec(
        family=NAME, name="internvl-6b-34b",
        vision=INTERNVIT_6B,
        language=LanguageSpec(num_layers=60, hidden_size=7168, num_attention_heads=56, ffn_hidden_size=20480,
                              num_query_groups=8, vocab_size=64000, rotary_base=5000000),
    ),
}

# --------------------------------------------------------------------------------------------
# The current InternVL family (InternVL3: InternViT-300M-448px-V2_5 + Qwen2.5).  Sources: the model
# cards of InternVL3-1B/2B/8B (vision part InternViT-300M-448px-V2_5, language part Qwen2.5-0.5B/1.5B/
# 7B-Instruct) and their config.json (vision_config, llm_config), which carry the sizes of
# InternViT-300M-448px-V2_5 (24 layers, hidden 1024, 16 heads, MLP 4096, 448 px, patch 14, LayerNorm)
# and of the Qwen2.5 configs (layers, hidden, heads, KV heads, MLP, rope_theta 1e6).  Vocabulary: the
# checkpoints' embedding has 151674 rows (llm_config.vocab_size: Qwen2.5's tokens + InternVL's special
# tokens), padded here to 151680, the next multiple of 128 (Megatron's --make-vocab-size-divisible-by),
# the padded rows masked out of the softmax.  Features: InternViT's layer scale (0.1) and qkv bias,
# Qwen2's q/k/v bias and RMSNorm epsilon 1e-6.  The output layer is counted untied (a checkpoint's
# config.json says whether it is tied; --hf-checkpoint takes that from it).
# InternVL2.5-26B (InternViT-6B-448px-V2_5, 45 layers used, + InternLM2.5-20B-chat) has the same
# sizes as "internvl-6b-20b" (InternVL-Chat-V1-5) in every field here, so it is no separate preset.
# --------------------------------------------------------------------------------------------
INTERNVIT_300M = VisionSpec(
    num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
    image_size=448, patch_size=14, normalization="LayerNorm", qkv_bias=True, layer_scale_init=0.1,
)
QWEN2_5_VOCAB_INTERNVL = 151680  # 151674 rows in the checkpoints, padded to a multiple of 128
QWEN2_5 = dict(vocab_size=QWEN2_5_VOCAB_INTERNVL, real_vocab_size=151674, rotary_base=1000000, qkv_bias=True,
               norm_eps=1e-6)

PRESETS.update({
    "internvl3-1b": ModelSpec(  # Qwen2.5-0.5B
        family=NAME, name="internvl3-1b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=24, hidden_size=896, num_attention_heads=14, ffn_hidden_size=4864,
                              num_query_groups=2, **QWEN2_5),
    ),
    "internvl3-2b": ModelSpec(  # Qwen2.5-1.5B
        family=NAME, name="internvl3-2b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=28, hidden_size=1536, num_attention_heads=12, ffn_hidden_size=8960,
                              num_query_groups=2, **QWEN2_5),
    ),
    "internvl3-8b": ModelSpec(  # Qwen2.5-7B
        family=NAME, name="internvl3-8b",
        vision=INTERNVIT_300M,
        language=LanguageSpec(num_layers=28, hidden_size=3584, num_attention_heads=28, ffn_hidden_size=18944,
                              num_query_groups=4, **QWEN2_5),
    ),
})

# --------------------------------------------------------------------------------------------
# InternVL3.5 (dense): InternViT-300M-448px-V2_5 (InternViT-6B-448px-V2_5 for 38B) + Qwen3. Sources: the
# InternVL3.5 quick-start table (OpenGVLab's InternVL docs: vision / language parameters 0.3B / 0.8B, 2.0B, 4.4B,
# 8.2B, 14.8B and 5.5B / 32.8B), the llm_config of OpenGVLab/InternVL3_5-1B and -8B (Qwen3-0.6B and Qwen3-8B:
# model_type qwen3, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, no attention bias, vocab_size 151936, no
# tie_word_embeddings key: Qwen3Config's default, untied) and the Qwen3 configs of the other language parts
# (Qwen3-1.7B, -4B, -14B, -32B). Their language parameters equal the table's only untied (Qwen3-0.6B/1.7B/4B are
# tied as text models, not inside InternVL3.5). tests/test_internvl3_5.py checks the numbers and the totals.
# --------------------------------------------------------------------------------------------
QWEN3 = dict(vocab_size=151936, rotary_base=1000000, norm_eps=1e-6, head_dim=128, qk_norm=True, qkv_bias=False)


def _internvl3_5(name: str, vision: VisionSpec, layers: int, hidden: int, heads: int, groups: int, ffn: int
                 ) -> ModelSpec:
    return ModelSpec(family=NAME, name=name, vision=vision, language=LanguageSpec(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=ffn, **QWEN3))


PRESETS.update({
    "internvl3.5-1b": _internvl3_5("internvl3.5-1b", INTERNVIT_300M, 28, 1024, 16, 8, 3072),  # Qwen3-0.6B
    "internvl3.5-2b": _internvl3_5("internvl3.5-2b", INTERNVIT_300M, 28, 2048, 16, 8, 6144),  # Qwen3-1.7B
    "internvl3.5-4b": _internvl3_5("internvl3.5-4b", INTERNVIT_300M, 36, 2560, 32, 8, 9728),  # Qwen3-4B
    "internvl3.5-8b": _internvl3_5("internvl3.5-8b", INTERNVIT_300M, 36, 4096, 32, 8, 12288),  # Qwen3-8B
    "internvl3.5-14b": _internvl3_5("internvl3.5-14b", INTERNVIT_300M, 40, 5120, 40, 8, 17408),  # Qwen3-14B
    "internvl3.5-38b": _internvl3_5("internvl3.5-38b", INTERNVIT_6B, 64, 5120, 64, 8, 25600),  # Qwen3-32B
})


# --------------------------------------------------------------------------------------------
# InternVL3.5-MoE: InternViT-300M-448px-V2_5 + Qwen3-30B-A3B (30B-A3B) and InternViT-6B-448px-V2_5 + Qwen3-235B-A22B
# (241B-A28B). The Qwen3-MoE configs: 48 / 94 layers, hidden 2048 / 4096, 32 / 64 heads, 4 KV heads, head_dim 128,
# intermediate_size 6144 / 12288 (no dense layer uses it: decoder_sparse_step 1, no mlp_only_layers), 128 experts of
# moe_intermediate_size 768 / 1536, top 8 with norm_topk_prob true, rope_theta 1e6, vocab 151936, untied.
# tests/test_internvl3_5_moe.py checks the numbers and the totals.
# --------------------------------------------------------------------------------------------
def _internvl3_5_moe(name: str, vision: VisionSpec, layers: int, hidden: int, heads: int, ffn: int, expert_ffn: int
                     ) -> ModelSpec:
    dense = _internvl3_5(name, vision, layers, hidden, heads, 4, ffn)
    moe = MoESpec(num_experts=128, topk=8, ffn_hidden_size=expert_ffn, layer_freq=layer_freq_from_qwen(layers, 1))
    return dense.replace(language=dataclasses.replace(dense.language, moe=moe))


PRESETS.update({
    "internvl3.5-30b-a3b": _internvl3_5_moe("internvl3.5-30b-a3b", INTERNVIT_300M, 48, 2048, 32, 6144, 768),
    "internvl3.5-241b-a28b": _internvl3_5_moe("internvl3.5-241b-a28b", INTERNVIT_6B, 94, 4096, 64, 12288, 1536),
})
