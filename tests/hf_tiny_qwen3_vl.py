"""Tiny random transformers Qwen3-VL models for the HF tests (no download): every parameter perturbed (HF init
leaves norms, biases and the position table constant, which would hide swapped keys). The ViT has 3 heads (TP 2
does not divide them), DeepStack at its first and last layer (0 and 3 of 4), a 3 x 3 learned position grid (smaller
than the images' patch grids, so the interpolation matters); the LLM has an explicit head_dim (16, not hidden /
heads = 8) and interleaved mrope_section [2, 3, 3] (not the published [24, 20, 20]). Two images of 6 x 10 and
8 x 6 patches."""
from __future__ import annotations

import torch
from hf_check import eager, write_qwen_preprocessor
from hf_tiny import perturb

VOCAB, IMAGE_ID, VIDEO_ID, VISION_START, VISION_END = 300, 290, 291, 288, 289
GRIDS = ((1, 6, 10), (1, 8, 6))  # patches (t, h, w)
PATCH = 16


def hf_config(tie=False, depth=4, deepstack=(0, 3), llm_layers=3, section=(2, 3, 3), positions=9):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        vision_config=dict(depth=depth, hidden_size=24, num_heads=3, intermediate_size=40, out_hidden_size=32,
                           num_position_embeddings=positions, deepstack_visual_indexes=list(deepstack),
                           patch_size=PATCH, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           hidden_act="gelu_pytorch_tanh"),
        text_config=dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=48, num_hidden_layers=llm_layers, vocab_size=VOCAB, rms_norm_eps=1e-6,
                         tie_word_embeddings=tie, attention_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                                          "mrope_section": list(section), "mrope_interleaved": True},
                         bos_token_id=None, eos_token_id=None, pad_token_id=None),
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=tie)


def make_tiny(folder, seed=0, **kw):
    """Save a tiny perturbed Qwen3VLForConditionalGeneration to ``folder``; returns it (eval, fp32, eager)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(hf_config(**kw)).eval()
    perturb(model, seed)
    if kw.get("tie"):
        model.tie_weights()
    model.save_pretrained(str(folder))
    return eager(model)


def inputs(grids=GRIDS, seed=1):
    """What the processor returns: input_ids [1, s] (text, then per image vision_start, its merged tokens,
    vision_end), pixel_values [patches, 3*2*16*16], image_grid_thw [n, 3], mm_token_type_ids [1, s] (1 on image
    tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for t, h, w in grids:
        ids += torch.randint(0, VISION_START, (3,), generator=g).tolist() + [VISION_START]
        ids += [IMAGE_ID] * (t * h * w // 4) + [VISION_END]
    ids += torch.randint(0, VISION_START, (5,), generator=g).tolist()
    ids = torch.tensor([ids])
    patches = sum(t * h * w for t, h, w in grids)
    return {"input_ids": ids, "pixel_values": torch.randn(patches, 3 * 2 * PATCH * PATCH, generator=g),
            "image_grid_thw": torch.tensor(grids), "mm_token_type_ids": (ids == IMAGE_ID).long()}


def hf_logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits[0].float()


def write_preprocessor(folder, min_pixels=32 * 32, max_pixels=32 * 32 * 16) -> None:
    """Qwen3-VL's ``preprocessor_config.json`` (patch 16) with a small pixel budget (px): by default 1 .. 16 merged
    tokens (4 .. 64 patches) per image."""
    write_qwen_preprocessor(folder, PATCH, min_pixels, max_pixels)


def make_tiny_with_tokenizer(folder, seed=0, **kw):
    """``hf_tiny_qwen.make_tiny_with_tokenizer`` (its tokenizer and chat template) with ``write_preprocessor``'s image
    settings and ``make_tiny``'s model; returns (the model (eval, fp32, eager), the special tokens' ids by name)."""
    import hf_tiny_qwen

    return hf_tiny_qwen.make_tiny_with_tokenizer(folder, seed, make_tiny, write_preprocessor, **kw)


def inputs_with_token_ids(ids: dict, grids=GRIDS, seed=1):
    """``inputs`` in the ids of ``hf_tiny_qwen.write_tokenizer``'s tokenizer (``ids``: its special tokens by name):
    the image tokens made that tokenizer's; other text ids moved past its special tokens."""
    batch = inputs(grids, seed)
    tokens = batch["input_ids"]
    roles = {IMAGE_ID: "<|image_pad|>", VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>"}
    where = {old: tokens == old for old in roles}
    text = ~sum(where.values()).bool()
    tokens[text] = tokens[text] % 100 + len(ids)
    for old, name in roles.items():
        tokens[where[old]] = ids[name]
    batch["mm_token_type_ids"] = (tokens == ids["<|image_pad|>"]).long()
    return batch


def colour_images(folder, count=12, seed=0) -> list[tuple[str, str]]:
    """``count`` small photo-like RGB images (JPEG and PNG, 40..150 px a side, aspect ratios up to ~3.5): a
    dominant red, green or blue with gradients and noise; returns (file name, colour name) pairs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        colour = ("red", "green", "blue")[k % 3]
        h, w = (int(x) for x in rng.integers(40, 150, size=2))
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([60 + 40 * np.sin(x / (7 + k)), 60 + 40 * np.cos(y / (5 + k)), 50 + 0 * x], -1)
        base[..., k % 3] += 120
        pixels = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
        name = f"{colour}{k}.{'png' if k % 2 else 'jpg'}"
        Image.fromarray(pixels, "RGB").save(folder / name)
        out.append((name, colour))
    return out


QUESTIONS = ("<image>What colour is it?", "Name the colour: <image>", "<image>\nWhich colour?")


def structured(text: str, paths: list[str]) -> list[dict]:
    """``text``'s ``<image>`` tags as transformers' image parts (``paths`` in order), the rest as text parts."""
    pieces = text.split("<image>")
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for path, piece in zip(paths, pieces[1:]):
        parts.append({"type": "image", "image": path})
        parts += [{"type": "text", "text": piece}] if piece else []
    return parts


def write_messages_data(folder, structured_content: bool = False) -> str:
    """A ``messages`` JSONL over ``colour_images``: one-image questions (the answer names the colour) and two-image
    ones (both, in order); the content strings with ``<image>`` tags and an ``images`` list, or with
    ``structured_content`` transformers' structured lists (``{"type": "image", "image": PATH}`` parts); returns its
    path."""
    import json

    images = folder / "images"
    images.mkdir()
    pics = colour_images(images)

    def record(question, paths, answer):
        if not structured_content:
            return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                    "images": paths}
        return {"messages": [{"role": "user", "content": structured(question, paths)},
                             {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}

    lines = []
    for k, (name, colour) in enumerate(pics):
        for q in QUESTIONS:
            lines.append(record(q, [f"images/{name}"], colour))
        other, second = pics[(k + 4) % len(pics)]
        lines.append(record("<image> then <image>: which?", [f"images/{name}", f"images/{other}"],
                            f"{colour}, {second}"))
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


# Qwen3-VL-MoE: top-2 of 6 experts of width 20 (H 32 != 2I 40, so the two expert layouts have other shapes), layer 1
# of 3 dense (mlp_only_layers); DeepStack features go to layers 0 (MoE) and 1 (dense)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=20, mlp_only_layers=[1], decoder_sparse_step=1)


def hf_moe_config(tie=False, llm_layers=3, **moe):
    from transformers import Qwen3VLMoeConfig

    dense = hf_config(tie=tie, llm_layers=llm_layers)
    text = {k: v for k, v in dense.text_config.to_dict().items() if k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
        "num_hidden_layers", "vocab_size", "rms_norm_eps", "attention_bias", "rope_parameters")}
    vision = {k: v for k, v in dense.vision_config.to_dict().items() if k in (
        "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "num_position_embeddings",
        "deepstack_visual_indexes", "patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels",
        "hidden_act")}
    return Qwen3VLMoeConfig(
        vision_config=vision, text_config={**text, **MOE, **moe, "bos_token_id": None, "eos_token_id": None,
                                           "pad_token_id": None},
        image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=tie)


def make_tiny_moe(folder, seed=0, published=False, **kw):
    """Save a tiny perturbed Qwen3VLMoeForConditionalGeneration to ``folder``; returns it (eval, fp32, eager).
    ``published``: the fused expert tensors written transposed ([E, H, 2I], [E, I, H]), as the published files
    hold them (a 5.x save_pretrained writes the in-memory [E, 2I, H], [E, H, I])."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(hf_moe_config(**kw)).eval()
    perturb(model, seed)
    if kw.get("tie"):
        model.tie_weights()
    model.save_pretrained(str(folder))
    if published:
        path = f"{folder}/model.safetensors"
        tensors = load_file(path)
        tensors = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   else v for k, v in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
    return eager(model)
