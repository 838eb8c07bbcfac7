"""Tiny random transformers Qwen3.5 models for the HF tests (no download): every parameter perturbed (HF init leaves
norms, A_log, dt_bias and the position table constant, which would hide swapped keys). The LLM has 5 layers in an
order other than every fourth (linear, full, full, linear, linear: the kinds meet both ways), head_dim 16 with a
quarter rotated (partial_rotary_factor 0.25 -> 4 channels, mrope_section [1, 1, 0] interleaved), 4 attention heads
in 2 key-value groups, and linear heads unlike them (2 key heads of 8, 4 value heads of 6, conv kernel 4); the ViT
has 3 heads (TP 2 does not divide them) and a 3 x 3 learned position grid. Two images of 6 x 10 and 8 x 6 patches
(Qwen3-VL's inputs)."""
from __future__ import annotations

import torch
from hf_check import eager, write_qwen_preprocessor
from hf_tiny import perturb
from hf_tiny_qwen3_vl import GRIDS, IMAGE_ID, PATCH, VIDEO_ID, VISION_END, VISION_START, VOCAB, hf_logits, inputs

ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
                "language_model.norm.weight")
EPS = 1e-5  # rms_norm_eps (also the gated norm's): see make_tiny
LAYER_TYPES = ("linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention")

__all__ = ["GRIDS", "IMAGE_ID", "PATCH", "VOCAB", "hf_config", "make_tiny", "eager", "inputs", "hf_logits"]


def hf_config(tie=False, layer_types=LAYER_TYPES, section=(1, 1, 0), factor=0.25, eps=EPS):
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        vision_config=dict(depth=2, hidden_size=24, num_heads=3, intermediate_size=40, out_hidden_size=32,
                           num_position_embeddings=9, patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3, hidden_act="gelu_pytorch_tanh"),
        text_config=dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=48, num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                         vocab_size=VOCAB, rms_norm_eps=eps, tie_word_embeddings=tie, attention_bias=False,
                         linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4,
                         linear_value_head_dim=6, linear_conv_kernel_dim=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "mrope_section": list(section),
                                          "mrope_interleaved": True, "partial_rotary_factor": factor},
                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=tie)


def make_tiny(folder, seed=0, **kw):
    """Save a tiny perturbed Qwen3_5ForConditionalGeneration to ``folder``; returns it (eval, fp32, eager).

    fp32 noise: the Gated DeltaNet's gated norm divides each value head's output by its RMS, so a head whose output
    is near zero (q . k near 0 at a sample's first tokens) turns the fp32 rounding of the rule into relative error
    (transformers' own fp32 logits are ~1e-4 off its fp64 ones at rms_norm_eps 1e-6 and logits of 4). The model
    here keeps that within the 1e-5 comparison: rms_norm_eps 1e-5 and logits of order 1 (embedding and head / 4)."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(hf_config(**kw)).eval()
    perturb(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ZERO_CENTRED):  # 1 + w near 1, as trained ones are
                p.sub_(1.0)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # logits of order 1, not 4
                p.mul_(0.25)
    if kw.get("tie"):
        model.tie_weights()
    model.save_pretrained(str(folder))
    return eager(model)


def write_preprocessor(folder, min_pixels=32 * 32, max_pixels=32 * 32 * 12) -> None:
    """Qwen3-VL's ``preprocessor_config.json`` (patch 16) with a small pixel budget (px): 1 .. 12 merged tokens
    (4 .. 48 patches) per image."""
    write_qwen_preprocessor(folder, PATCH, min_pixels, max_pixels)


def make_tiny_with_tokenizer(folder, seed=0, **kw):
    """A new folder ``folder`` with ``hf_tiny_qwen``'s character tokenizer and ChatML template, ``write_preprocessor``'s
    image settings and a tiny perturbed model (``make_tiny``) whose image/vision token ids are that tokenizer's;
    returns (the model (eval, fp32, eager), the special tokens' ids by name)."""
    import hf_tiny_qwen

    folder.mkdir()
    ids = hf_tiny_qwen.write_tokenizer(folder)
    write_preprocessor(folder)
    model = make_tiny(folder, seed=seed, **kw)
    hf_tiny_qwen.set_token_ids(model, ids)
    model.save_pretrained(str(folder))
    return model, ids


def training_flags(folder, data_cache, seed=3, **kw) -> list[str]:
    """Trainer flags of a fine-tune of a tiny HF Qwen3.5 (``make_tiny_with_tokenizer`` in ``folder/hf``) on
    ``hf_tiny_qwen.write_messages_data``'s photo questions (``folder``); sizes and parallelism are the caller's."""
    import hf_tiny_qwen

    make_tiny_with_tokenizer(folder / "hf", seed, **kw)
    return ["--hf-checkpoint", str(folder / "hf"), "--data-path", hf_tiny_qwen.write_messages_data(folder),
            "--eval-interval", "0", "--seq-length", "256", "--data-cache-dir", str(data_cache)]
