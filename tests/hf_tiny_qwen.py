"""Tiny random transformers Qwen2.5-VL models for the HF tests (no download): every parameter perturbed (HF init
leaves norms and biases constant, which would hide swapped keys). The ViT has 3 heads (TP 2 does not divide
them), full attention at layers 1 and 2 of 4 (windows before and after), 56 px windows (2 x 2 merged tokens);
the LLM's mrope_section is [2, 1, 1] (not the published [16, 24, 24]). Two images whose merged grids (3 x 5 and
4 x 3) are no multiples of the window."""
from __future__ import annotations

import torch

VOCAB, IMAGE_ID, VISION_START, VISION_END = 300, 290, 288, 289
GRIDS = ((1, 6, 10), (1, 8, 6))  # patches (t, h, w)


def perturb(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * noise if (p.dim() > 1 or name.endswith("bias")) else 1.0 + 0.3 * noise)


def hf_config(tie=False, depth=4, full=(1, 2), llm_layers=2, section=(2, 1, 1)):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        vision_config=dict(depth=depth, hidden_size=24, num_heads=3, intermediate_size=40, out_hidden_size=32,
                           window_size=56, fullatt_block_indexes=list(full), patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3),
        text_config=dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                         num_hidden_layers=llm_layers, vocab_size=VOCAB, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "mrope_section": list(section)},
                         bos_token_id=None, eos_token_id=None),
        image_token_id=IMAGE_ID, video_token_id=VOCAB - 1, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=tie)


def make_tiny(folder, seed=0, **kw):
    """Save a tiny perturbed Qwen2_5_VLForConditionalGeneration to ``folder``; returns it (eval, fp32, eager)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(hf_config(**kw)).eval()
    perturb(model, seed)
    if kw.get("tie"):
        model.tie_weights()
    model.save_pretrained(str(folder))
    model.config._attn_implementation = "eager"
    model.model.visual.config._attn_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"
    return model


def inputs(grids=GRIDS, seed=1):
    """What the processor returns: input_ids [1, s] (text, then per image vision_start, its merged tokens,
    vision_end), pixel_values [patches, 1176], image_grid_thw [n, 3], mm_token_type_ids [1, s]."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for t, h, w in grids:
        ids += torch.randint(0, VISION_START, (3,), generator=g).tolist() + [VISION_START]
        ids += [IMAGE_ID] * (t * h * w // 4) + [VISION_END]
    ids += torch.randint(0, VISION_START, (5,), generator=g).tolist()
    ids = torch.tensor([ids])
    patches = sum(t * h * w for t, h, w in grids)
    return {"input_ids": ids, "pixel_values": torch.randn(patches, 3 * 2 * 14 * 14, generator=g),
            "image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (ids == IMAGE_ID).long()}


def hf_logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits[0].float()
