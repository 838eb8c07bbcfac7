"""Qwen2.5-VL's training data pipeline against transformers: the reader (``messages`` and InternVL records, photos,
the folder's tokenizer, chat template and ``preprocessor_config.json``) gives the token ids, pixel rows and grids of
``Qwen2_5_VLProcessor`` on the template's text; labels cover the answers only; a packed micro-batch carries each
sample's ``get_rope_index`` ids and the ViT fields of its images (window order, boundaries, rotary positions: as
transformers' vision model derives them from the grids); every stage gets what its units read; the scan
refuses an aspect ratio over 200 and video with ``file:line``."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sklearn")
import hf_tiny_qwen  # noqa: E402

from megatron.vlm.stage.batches import StageInputs  # noqa: E402
from megatron.vlm.data.records import DataValidationError, RecordDataset  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.lineages.qwen.data import IMAGE_TOKENS, QWEN_DATA, QwenBatcher, image_rule  # noqa: E402
from omnibal_ext.model.units import get_preset as model_preset  # noqa: E402

MAX_PIXELS = 28 * 28 * 24


def write_folder(tmp_path):
    """The tiny Hugging Face folder's data side: tokenizer, chat template, image processor limits; photos; a
    messages JSONL (one image, two images, text only) with an InternVL-format record mixed in."""
    folder = tmp_path / "hf"
    folder.mkdir()
    ids = hf_tiny_qwen.write_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": MAX_PIXELS}))
    images = tmp_path / "images"
    images.mkdir()
    pics = hf_tiny_qwen.photos(images)
    records = [
        {"messages": [{"role": "user", "content": "<image>What is this?"},
                      {"role": "assistant", "content": pics[0][1]}], "images": [f"images/{pics[0][0]}"]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Compare <image> and <image>."},
                      {"role": "assistant", "content": "left " + pics[5][1]},
                      {"role": "user", "content": "And?"}, {"role": "assistant", "content": "done"}],
         "images": [f"images/{pics[5][0]}", f"images/{pics[2][0]}"]},
        {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]},
        {"image": pics[7][0], "conversations": [{"from": "human", "value": "<image>\nName it."},
                                                {"from": "gpt", "value": pics[7][1]}]},
    ]
    ann = tmp_path / "train.jsonl"
    ann.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    internvl = tmp_path / "internvl.jsonl"
    internvl.write_text(json.dumps(records[3]) + "\n")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"msgs": {"root": ".", "annotation": "train.jsonl"},
                                "ivl": {"root": "images", "annotation": "internvl.jsonl"}}))
    return folder, ids, records, meta, ann


def reference(folder, record, root):
    """What ``Qwen2_5_VLProcessor`` gives for the chat template's text of ``record`` (each image as the template's
    vision block): ``Qwen2VLImageProcessorPil``'s rows and grids, the text tokenized by the folder's tokenizer
    with each ``<|image_pad|>`` repeated for its image's merged patches (the processor's own expansion; the
    processor class itself needs torchvision for its video side)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(folder))
    if "messages" in record:
        messages, paths = record["messages"], record.get("images", [])
    else:
        roles = {"human": "user", "gpt": "assistant"}
        messages = [{"role": roles[m["from"]], "content": m["value"]} for m in record["conversations"]]
        paths = [record["image"]]
    text = tok.apply_chat_template(messages, tokenize=False)
    out = {}
    if paths:
        processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=MAX_PIXELS)
        out = dict(processor(images=[Image.open(root / p) for p in paths], return_tensors="pt"))
        for grid in out["image_grid_thw"].tolist():
            text = text.replace("<image>", "<|vision_start|>" + "<|placeholder|>" * (np.prod(grid) // 4)
                                + "<|vision_end|>", 1)
    ids = tok(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors="pt")["input_ids"]
    out["input_ids"] = ids
    out["mm_token_type_ids"] = (ids == tok.convert_tokens_to_ids("<|image_pad|>")).long()
    answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    return out, answers


def test_reader_matches_processor_and_labels_answers(tmp_path):
    folder, ids, records, meta, _ = write_folder(tmp_path)
    spec = model_preset("qwen2.5-vl-tiny")
    tokenizer = build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS)
    assert tokenizer.img_context_id == ids["<|image_pad|>"]
    assert tokenizer.vocab_size == len(hf_tiny_qwen.QWEN_SPECIALS) + 96  # nothing added
    args = SimpleNamespace(min_pixels=None, max_pixels=None)
    dataset = RecordDataset(str(meta), tokenizer, image_rule(args, spec, str(folder)), max_seq_length=4096)
    assert len(dataset) == 4
    tokens, patches = dataset.sample_lengths()
    roots = [tmp_path, tmp_path, tmp_path, tmp_path / "images"]
    samples = []
    for i, (record, root) in enumerate(zip(records, roots)):
        sample = dataset[i]
        want, answers = reference(folder, record, root)
        assert torch.equal(sample["input_ids"], want["input_ids"][0]), i
        if "pixel_values" in want:
            assert torch.equal(sample["pixel_values"], want["pixel_values"]), i  # bit-identical rows
            grid = want["image_grid_thw"]
            assert int(patches[i]) == int(grid.prod(-1).sum()) == len(sample["pixel_values"])
        else:
            assert patches[i] == 0 and sample["pixel_values"].shape == (0, 1176)
        assert tokens[i] == len(sample["input_ids"])
        labelled = sample["labels"] != -100  # shifted: label j is token j + 1
        assert sample["input_ids"][1:][labelled[:-1]].tolist() == tokenizer.encode("".join(answers)), i
        samples.append({**sample, "sample_id": i})
    # a packed micro-batch: each sample's 3-D RoPE ids are get_rope_index's, the ViT fields those of its images
    model = transformers.Qwen2_5_VLModel(hf_tiny_qwen.hf_config())
    batcher = QWEN_DATA.batcher(spec, tokenizer.img_context_id, dataset.config.images)
    batch = batcher.make(samples, tokenizer.pad_id, packed=True, pad_to_multiple=8)
    start = 0
    grids = []
    for i, record in enumerate(records):
        want, _ = reference(folder, record, roots[i])
        n = len(want["input_ids"][0])
        grid = want.get("image_grid_thw")
        pos, _ = model.get_rope_index(want["input_ids"], mm_token_type_ids=want["mm_token_type_ids"],
                                      image_grid_thw=grid)
        assert torch.equal(batch["mrope_position_ids"][:, 0, start:start + n], pos[:, 0]), i
        grids += [] if grid is None else grid.tolist()
        start += n
    assert batch["tokens"].shape[1] % 8 == 0 and int(batch["cu_seqlens"][-2]) == start
    expected = hf_tiny_qwen.transformers_vit_fields(grids, spec)  # transformers' vision model's own derivation
    assert set(expected) <= set(batch)
    for key in expected:
        got, want = batch[key], expected[key]
        assert (torch.equal(got.long(), want.long()) if isinstance(want, torch.Tensor) else got == want), key
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in samples]))
    # padded (one sample per row): each row's ids restart; a stage gets the fields its units read
    rows = batcher.make(samples[:2], tokenizer.pad_id, packed=False)
    assert torch.equal(rows["mrope_position_ids"][:, 1, :len(samples[1]["input_ids"])],
                       batch["mrope_position_ids"][:, 0, len(samples[0]["input_ids"]):start - tokens[2] - tokens[3]])
    vit_only = batcher.micro_batch(batch, StageInputs.reading({"pixels"})).fields()
    assert "vision_cu_window_seqlens" in vit_only and "mrope_position_ids" not in vit_only and "tokens" not in vit_only
    llm_only = batcher.micro_batch(batch, StageInputs.reading({"packing", "labels"})).fields()
    assert "mrope_position_ids" in llm_only and not any(k.startswith("vision_") for k in llm_only)


def test_text_only_micro_batch_feeds_one_unused_image(tmp_path):
    folder, _, _, _, ann = write_folder(tmp_path)
    spec = model_preset("qwen2.5-vl-tiny")
    tokenizer = build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS)
    dataset = RecordDataset(str(ann), tokenizer, image_rule(SimpleNamespace(min_pixels=None, max_pixels=None), spec,
                                                            None), max_seq_length=4096)  # a JSONL as --data-path
    batch = QwenBatcher(spec, tokenizer.img_context_id, dataset.config.images).make([dataset[2]], 0, packed=True)
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2]] and batch["pixel_values"].shape == (4, 1176)
    assert not (batch["tokens"] == tokenizer.img_context_id).any() and batch["sample_tiles"].tolist() == [0]


def test_pixel_limits_flags_override_the_folder(tmp_path):
    folder, _, _, meta, _ = write_folder(tmp_path)
    spec = model_preset("qwen2.5-vl-tiny")
    tokenizer = build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS)
    small = image_rule(SimpleNamespace(min_pixels=None, max_pixels=28 * 28 * 4), spec, str(folder))
    dataset = RecordDataset(str(meta), tokenizer, small, max_seq_length=4096)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    def patches(*names):  # the folder's min_pixels, the flag's max_pixels
        sizes = [Image.open(tmp_path / "images" / n).size for n in names]
        return sum(h * w // 196 for h, w in (smart_resize(hh, ww, 28, 3136, 28 * 28 * 4) for ww, hh in sizes))

    assert dataset.sample_lengths()[1].tolist() == [patches("china0.jpg"), patches("flower1.png", "china2.jpg"), 0,
                                                    patches("flower3.png")]
    from omnibal_ext.errors import UserError

    with pytest.raises(UserError, match="--min-pixels/--max-pixels: .*min_pixels 5000 > max_pixels 3136"):
        image_rule(SimpleNamespace(min_pixels=5000, max_pixels=3136), spec, str(folder))


def test_scan_refuses_aspect_over_200_and_video_with_file_line(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_tiny_qwen.write_tokenizer(folder)
    Image.new("RGB", (2010, 10), (200, 10, 10)).save(tmp_path / "thin.png")  # aspect 201
    Image.new("RGB", (2000, 10), (200, 10, 10)).save(tmp_path / "ok.png")  # aspect 200: accepted
    good = {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
            "images": ["ok.png"]}
    ann = tmp_path / "bad.jsonl"
    ann.write_text("\n".join(json.dumps(r) for r in [
        good, {**good, "images": ["thin.png"]}, {**good, "videos": ["a.mp4"]},
        {"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}]}]) + "\n")
    spec = model_preset("qwen2.5-vl-tiny")
    tokenizer = build_tokenizer(str(folder), image_tokens=IMAGE_TOKENS)
    rule = image_rule(SimpleNamespace(min_pixels=None, max_pixels=None), spec, None)
    with pytest.raises(DataValidationError) as e:
        RecordDataset(str(ann), tokenizer, rule, max_seq_length=4096)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("3 problem(s)")
    assert f"{ann}:2: image {tmp_path}/thin.png: image of 2010x10 px" in lines[1]
    assert "aspect ratio of 201.0" in lines[1]
    assert f"{ann}:3: 0 <video> placeholder(s) in the messages but 1 video(s) in 'videos'" in lines[2]
    assert f"{ann}:4: 1 <video> placeholder(s) in the messages but 0 video(s) in 'videos'" in lines[3]


def test_isf_stats_write_records_each_image(tmp_path, capsys):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from omnibal_cli import main as omnibal

    folder, _, records, meta, ann = write_folder(tmp_path)
    hf_tiny_qwen.hf_config().save_pretrained(str(folder))  # config.json: the model (and so the family)
    out = tmp_path / "stats.json"
    assert omnibal(["isf", "stats", "--stats", str(meta), "--hf-checkpoint", str(folder), "--write", str(out)]) == 0
    assert "wrote the stats of 4 samples" in capsys.readouterr().out
    stats = json.loads(out.read_text())
    roots = [tmp_path, tmp_path, tmp_path, tmp_path / "images"]
    for entry, record, root in zip(stats, records, roots):
        paths = record.get("images") or ([record["image"]] if "image" in record else [])
        images = []
        for p in paths:
            width, height = Image.open(root / p).size
            h, w = smart_resize(height, width, 28, 3136, MAX_PIXELS)  # the folder's limits
            images.append({"width": width, "height": height, "patches": h * w // 196})
        assert entry["images"] == images
        assert entry["vit_num"] == sum(i["patches"] for i in images)
        assert entry["token_num"] == len(reference(folder, record, root)[0]["input_ids"][0])

