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
# the seed of the untied and the tied model of the logits tests: of seeds 0 .. 40, the one whose two models'
# transformers fp32 logits are closest to the exact ones (``oracle_error``: 3.6e-6 untied, 3.4e-6 tied; seed 0's
# untied model is 1.1e-5 off, seed 5's 8e-5, so a 1e-5 comparison with them would judge transformers' rounding)
SEEDS = (26, 26)
LAYER_TYPES = ("linear_attention", "full_attention", "full_attention", "linear_attention", "linear_attention")

__all__ = ["GRIDS", "IMAGE_ID", "PATCH", "VOCAB", "SEEDS", "hf_config", "make_tiny", "perturb_zero_centred", "eager",
           "inputs", "hf_logits", "oracle_error", "delta_rule_fp64"]


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

    fp32 noise: the Gated DeltaNet's gated norm divides each value head's output by its RMS (with rms_norm_eps), so
    a head whose output is small (q . k near 0, or values cancelling in the state) turns the rounding of its inputs
    into relative error, and how much depends on the seed: transformers' own fp32 logits are 3e-6 .. 1.1e-4 off the
    exact ones (``oracle_error``) over seeds 0 .. 40 here. The model keeps that small with rms_norm_eps 1e-5 and
    logits of order 1 (embedding and head / 4); ``SEEDS`` are the pair the 1e-5 comparisons use."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(hf_config(**kw)).eval()
    perturb_zero_centred(model, seed)
    if kw.get("tie"):
        model.tie_weights()
    model.save_pretrained(str(folder))
    return eager(model)


def perturb_zero_centred(model, seed) -> None:
    """``hf_tiny.perturb`` for a Qwen3.5 model: its zero-centred norms' weights near 0 (1 + w near 1, as trained ones
    are), the embedding and head / 4 (logits of order 1)."""
    perturb(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ZERO_CENTRED):
                p.sub_(1.0)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.mul_(0.25)


def oracle_error(model, batch) -> float:
    """max |``model``'s fp32 logits on ``batch`` - the exact ones|: the model in float64 with transformers' chunked
    delta rule (which computes in float32 whatever its inputs) replaced by ``delta_rule_fp64``."""
    import copy
    from unittest import mock

    from transformers.models.qwen3_5 import modeling_qwen3_5

    m64 = copy.deepcopy(model).double()
    with torch.no_grad(), mock.patch.object(modeling_qwen3_5, "torch_chunk_gated_delta_rule", delta_rule_fp64):
        exact = m64(**{k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}).logits[0]
    return (hf_logits(model, batch).double() - exact).abs().max().item()


def delta_rule_fp64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=True, **_):
    """The gated delta rule token by token in float64, with transformers' chunked rule's signature ([b, s, heads,
    dim] inputs; q and k scaled by rsqrt(|x|^2 + 1e-6), q by 1 / sqrt(d_k); key heads shared by consecutive value
    heads): per token S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. Returns (o, the final state or
    None)."""
    assert initial_state is None and use_qk_l2norm_in_kernel
    q, k, v, g, beta = (x.double() for x in (query, key, value, g, beta))
    group = v.shape[2] // k.shape[2]
    q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q, k = q.repeat_interleave(group, 2) / q.shape[-1] ** 0.5, k.repeat_interleave(group, 2)
    state = torch.zeros(*k.shape[:1], k.shape[2], k.shape[3], v.shape[3], dtype=torch.float64)
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out.to(query.dtype), (state.to(query.dtype) if output_final_state else None)


def write_preprocessor(folder, min_pixels=32 * 32, max_pixels=32 * 32 * 12) -> None:
    """Qwen3-VL's ``preprocessor_config.json`` (patch 16) with a small pixel budget (px): 1 .. 12 merged tokens
    (4 .. 48 patches) per image."""
    write_qwen_preprocessor(folder, PATCH, min_pixels, max_pixels)


def make_tiny_with_tokenizer(folder, seed=0, make=make_tiny, **kw):
    """``hf_tiny_qwen.make_tiny_with_tokenizer`` (its character tokenizer and ChatML template) with
    ``write_preprocessor``'s image settings and the model of ``make`` (``make_tiny`` or the MoE one); returns (the
    model (eval, fp32, eager), the special tokens' ids by name)."""
    import hf_tiny_qwen

    return hf_tiny_qwen.make_tiny_with_tokenizer(folder, seed, make, write_preprocessor, **kw)


def training_flags(folder, data_cache, seed=3, make=make_tiny, **kw) -> list[str]:
    """Trainer flags of a fine-tune of a tiny HF Qwen3.5 (``make_tiny_with_tokenizer`` with ``make`` in
    ``folder/hf``) on ``hf_tiny_qwen.write_messages_data``'s photo questions (``folder``); sizes and parallelism are
    the caller's."""
    import hf_tiny_qwen

    make_tiny_with_tokenizer(folder / "hf", seed, make, **kw)
    return ["--hf-checkpoint", str(folder / "hf"), "--data-path", hf_tiny_qwen.write_messages_data(folder),
            "--eval-interval", "0", "--seq-length", "256", "--data-cache-dir", str(data_cache)]
