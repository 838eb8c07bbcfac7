"""Tiny random transformers Qwen2.5-VL models for the HF tests (no download): every parameter perturbed (HF init
leaves norms and biases constant, which would hide swapped keys). The ViT has 3 heads (TP 2 does not divide
them), full attention at layers 1 and 2 of 4 (windows before and after), 56 px windows (2 x 2 merged tokens);
the LLM's mrope_section is [2, 1, 1] (not the published [16, 24, 24]). Two images whose merged grids (3 x 5 and
4 x 3) are no multiples of the window."""
from __future__ import annotations

import json

import torch
from hf_check import eager, write_char_tokenizer
from hf_tiny import perturb

VOCAB, IMAGE_ID, VISION_START, VISION_END = 300, 290, 288, 289
GRIDS = ((1, 6, 10), (1, 8, 6))  # patches (t, h, w)


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
    return eager(model)


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


def inputs_with_token_ids(ids: dict, grids=GRIDS, seed=1):
    """``inputs`` in the ids of ``write_tokenizer``'s tokenizer (``ids``: its special tokens by name): the image
    token ids made this tokenizer's; text ids moved past its special tokens."""
    batch = inputs(grids, seed)
    tokens = batch["input_ids"]
    roles = {IMAGE_ID: "<|image_pad|>", VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>"}
    where = {old: tokens == old for old in roles}
    tokens[(tokens < len(ids)) & ~sum(where.values()).bool()] += 100
    for old, name in roles.items():
        tokens[where[old]] = ids[name]
    batch["mm_token_type_ids"] = (tokens == ids["<|image_pad|>"]).long()
    return batch


def hf_logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits[0].float()


QWEN_SPECIALS = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
SPECIAL_IDS = {t: i for i, t in enumerate(QWEN_SPECIALS)}  # write_tokenizer's ids of the special tokens
QWEN_TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
                 "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(folder) -> dict:
    """A character-level WordLevel tokenizer with Qwen2.5-VL's special tokens and a Qwen2-style ChatML chat
    template (a default system message) in ``folder``; returns its special tokens' ids by name."""
    return write_char_tokenizer(folder, QWEN_SPECIALS, QWEN_TEMPLATE, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def set_token_ids(model, ids: dict) -> None:
    """Point the config's image/video/vision start/end token ids at ``write_tokenizer``'s."""
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is None:
            continue
        for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
            if hasattr(config, key):
                setattr(config, key, ids[token])


def make_tiny_with_tokenizer(folder, seed=0, make=None, write_preprocessor=None, **kw):
    """A new folder ``folder`` with ``write_tokenizer``'s tokenizer, ``write_preprocessor(folder)``'s image settings
    (None: none written) and a tiny perturbed model (``make``, default ``make_tiny``; the Qwen3-VL and Qwen3.5 tiny
    modules pass theirs) whose image/vision token ids are that tokenizer's; returns (the model (eval, fp32, eager),
    the special tokens' ids)."""
    folder.mkdir()
    ids = write_tokenizer(folder)
    if write_preprocessor is not None:
        write_preprocessor(folder)
    model = (make or make_tiny)(folder, seed=seed, **kw)
    set_token_ids(model, ids)
    model.save_pretrained(str(folder))
    return model, ids


def photos(folder, shapes=((0, 0, 640, 427), (100, 50, 420, 410), (0, 200, 640, 300), (300, 0, 380, 427))) -> list:
    """Crops of scikit-learn's two sample photographs (china.jpg, flower.jpg: 640 x 427 px) as JPEG and PNG files
    of several sizes and aspect ratios (up to 6.4) in ``folder``; returns (file name, subject) pairs."""
    import os

    import sklearn
    from PIL import Image

    source = os.path.join(os.path.dirname(sklearn.__file__), "datasets", "images")
    out = []
    for subject in ("china", "flower"):
        with Image.open(os.path.join(source, f"{subject}.jpg")) as im:
            im.load()
            for k, box in enumerate(shapes):
                name = f"{subject}{k}.{'png' if k % 2 else 'jpg'}"
                im.crop(box).save(os.path.join(folder, name))
                out.append((name, subject))
    return out


QUESTIONS = ("<image>What is shown?", "Name the photo: <image>", "<image>\nWhich one?")


def write_messages_data(folder) -> str:
    """A messages JSONL: one-image questions (the answer names the photo) and two-image ones (both, in order)."""
    images = folder / "images"
    images.mkdir()
    pics = photos(images)
    lines = []
    for k, (name, subject) in enumerate(pics):
        for q in QUESTIONS:
            lines.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": subject}],
                          "images": [f"images/{name}"]})
        other, second = pics[(k + 3) % len(pics)]
        lines.append({"messages": [{"role": "user", "content": "<image> then <image>: which?"},
                                   {"role": "assistant", "content": f"{subject}, {second}"}],
                      "images": [f"images/{name}", f"images/{other}"]})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(path)


def training_flags(tmp_path, data_cache, seed=3) -> list[str]:
    """Trainer flags of a fine-tune of a tiny HF Qwen2.5-VL (its tokenizer; ``write_messages_data`` photos kept
    small by --max-pixels) written under ``tmp_path``; the run's sizes and parallelism are the caller's."""
    hf = tmp_path / "hf"
    make_tiny_with_tokenizer(hf, seed)
    return ["--hf-checkpoint", str(hf), "--data-path", write_messages_data(tmp_path), "--max-pixels",
            str(28 * 28 * 12), "--eval-interval", "0", "--seq-length", "256", "--data-cache-dir", str(data_cache)]


def transformers_vit_fields(grids, spec) -> dict:
    """The ViT fields of a Qwen2.5-VL micro-batch of images ``grids`` ((t, h, w) patches each) as transformers' own
    vision model derives them from ``grid_thw`` (``transformers.vision_utils``: the window order of the merged
    tokens, the window and image boundaries, the (h, w) rotary positions), in the form our batcher carries them:
    the patch order (each merged token's patches in a row), its inverse over merged tokens, the rotary positions in
    that order, and the boundaries with their largest segment."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    v = spec.vision
    grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    unit = v.spatial_merge_size ** 2
    window_index, cu_windows = get_vision_window_index(grid_thw, v.spatial_merge_size, v.window_size, v.patch_size)
    patch_index = (window_index[:, None] * unit + torch.arange(unit)).reshape(-1)
    cu_images = get_vision_cu_seqlens(grid_thw)
    return {"image_grid_thw": grid_thw, "vision_patch_index": patch_index,
            "vision_merged_inverse": torch.argsort(window_index),
            "vision_rotary_ids": get_vision_position_ids(grid_thw, v.spatial_merge_size)[patch_index],
            "vision_cu_window_seqlens": cu_windows, "vision_max_window_seqlen": int(cu_windows.diff().max()),
            "vision_cu_seqlens": cu_images, "vision_max_seqlen": int(cu_images.diff().max())}
