"""``messages`` records in both content forms, for every family, against transformers: a conversation written with
``<image>`` tags (paths in ``images``) and the same one in transformers' structured form (``{"type": "image",
"image" | "path" | "url": PATH}`` parts) give the reader equal samples, and those are what transformers' processor
returns from ``apply_chat_template`` on the structured conversation (it loads the images from the parts itself):
token ids, pixels (Qwen2.5-VL: bit-identical rows; InternVL: as many tiles of the same shape), and labels on the
answers only."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")
import hf_tiny  # noqa: E402
import hf_tiny_qwen  # noqa: E402

from megatron.vlm.data import RecordDataset, TileImages  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.lineages.qwen.data import IMAGE_TOKENS, image_rule  # noqa: E402
from omnibal_ext.model.units import get_preset  # noqa: E402

MAX_PIXELS = 28 * 28 * 24
TURNS = [("Compare <image> with\n<image>.", "Same place."), ("And this <image>?", "A flower.")]


def template(image: str, system: str | None) -> str:
    """A ChatML template taking a string or transformers' structured content (an image part renders ``image``),
    with ``system`` as the default system message (None: none)."""
    default = ("{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n" + system + "<|im_end|>\n{% endif %}"
               if system else "")
    return ("{% for m in messages %}" + default + "<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image +
            "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def records(paths: list[str], key: str) -> tuple[dict, dict]:
    """(string form, structured form with image paths under ``key``) of ``TURNS`` over the images ``paths``."""
    string = {"messages": [m for q, a in TURNS for m in ({"role": "user", "content": q},
                                                         {"role": "assistant", "content": a})], "images": paths}
    left, messages = list(paths), []
    for q, a in TURNS:
        pieces = q.split("<image>")
        parts = [{"type": "text", "text": pieces[0]}]
        for piece in pieces[1:]:
            parts += [{"type": "image", key: left.pop(0)}, {"type": "text", "text": piece}]
        messages += [{"role": "user", "content": [p for p in parts if p.get("text") != ""]},
                     {"role": "assistant", "content": [{"type": "text", "text": a}]}]
    return string, {"messages": messages}


def images_only(processor_class):
    class ImagesOnly(processor_class):
        """transformers' processor without its video processor (which needs torchvision, absent here)."""

        def check_argument_for_proper_class(self, name, arg):
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(
                name, arg)

    return ImagesOnly


def read_both(tmp_path, folder, tokenizer, rule, key):
    """The dataset of one JSONL holding the string and the structured form; the structured messages."""
    pics = hf_tiny_qwen.photos(tmp_path)
    paths = [str(tmp_path / name) for name, _ in (pics[0], pics[5], pics[2])]
    string, structured = records(paths, key)
    ann = tmp_path / "train.jsonl"
    ann.write_text(json.dumps(string) + "\n" + json.dumps(structured) + "\n")
    dataset = RecordDataset(str(ann), tokenizer, rule)
    a, b = dataset[0], dataset[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the two forms: the same sample
    assert (dataset.sample_lengths()[0] == len(a["input_ids"])).all()
    return a, structured["messages"]


def check_labels(sample, tokenizer):
    answers = []
    for _, answer in TURNS:
        answers += tokenizer.encode(answer) + [tokenizer.im_end_id]
    labelled = sample["labels"] != -100  # shifted: label j is token j + 1
    assert sample["input_ids"][1:][labelled[:-1]].tolist() == answers


@pytest.mark.parametrize("key", ["image", "path", "url"])
def test_qwen2_5_vl_both_forms_equal_the_processor(tmp_path, key):
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    folder = tmp_path / "hf"
    folder.mkdir()
    hf_tiny_qwen.write_tokenizer(folder)
    chat = template("<|vision_start|><|image_pad|><|vision_end|>", "You are a helpful assistant.")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat}))
    (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": MAX_PIXELS}))
    tokenizer = build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS)
    rule = image_rule(SimpleNamespace(min_pixels=None, max_pixels=None), get_preset("qwen2.5-vl-tiny"), str(folder))
    ours, messages = read_both(tmp_path, folder, tokenizer, rule, key)

    processor = images_only(Qwen2_5_VLProcessor)(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=MAX_PIXELS),
        tokenizer=AutoTokenizer.from_pretrained(str(folder)), chat_template=chat)
    ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], ref["input_ids"][0])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])  # bit-identical patch rows
    assert [rule.grid(int(w), int(h)) for w, h in ours["image_sizes"]] == [tuple(g) for g in
                                                                           ref["image_grid_thw"].tolist()]
    check_labels(ours, tokenizer)


def test_internvl_both_forms_equal_the_processor(tmp_path):
    from transformers import AutoTokenizer, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    folder = tmp_path / "hf"
    folder.mkdir()
    hf_tiny.write_tokenizer(folder)
    chat = template("<IMG_CONTEXT>", None)  # the processor expands each <IMG_CONTEXT> to <img> + tiles' tokens + </img>
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": chat, "extra_special_tokens": {
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"}}))
    size, per_tile, max_tiles = 32, 4, 12  # 12 // 3 images: up to 4 tiles per image (the reader's multi-image split)
    tokenizer = build_tokenizer(str(folder))
    ours, messages = read_both(tmp_path, folder, tokenizer, TileImages(size, per_tile, max_tiles), "image")

    tiles = GotOcr2ImageProcessorPil(size={"height": size, "width": size}, crop_to_patches=True, min_patches=1,
                                     max_patches=max_tiles // 3)
    processor = images_only(InternVLProcessor)(image_processor=tiles, tokenizer=AutoTokenizer.from_pretrained(
        str(folder)), chat_template=chat, image_seq_length=per_tile)
    ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], ref["input_ids"][0])
    # the same tiles per image (the ids hold their tokens); their pixels follow InternVL's own resize (test_data_tiling)
    assert ours["pixel_values"].shape == ref["pixel_values"].shape and len(ours["pixel_values"]) > 3
    check_labels(ours, tokenizer)
