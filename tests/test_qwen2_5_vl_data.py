"""Qwen2.5-VL data-side building blocks against transformers (the reference, used only here).

Image preprocessing: bit-identical pixel rows and grid_thw to ``Qwen2VLImageProcessorPil``; positions: equal
to ``Qwen2_5_VLModel.get_rope_index`` (with ``mm_token_type_ids``); windows and rotary ids: equal to what
``Qwen2_5_VisionTransformerPretrainedModel.forward`` computes, and the forward's output unchanged when ours
are passed in as its precomputed inputs.  Tiny images and configs: the whole file runs in seconds.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLImageProcessorPil  # noqa: E402
from transformers import vision_utils as ref_vision  # noqa: E402
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as ref_image  # noqa: E402

from megatron.vlm.data.messages import (ImageRef, MessagesRecordError,  # noqa: E402
                                        parse_messages_line, parse_messages_record, read_messages_jsonl)
from megatron.vlm.lineages.qwen.image_processing import (ImageProcessorConfig, ImageSizeError,  # noqa: E402
                                                               preprocess_image, resized_grid, smart_resize)
from megatron.vlm.lineages.qwen.positions import (ImageTokenError, mrope_position_ids,  # noqa: E402
                                                        packed_mrope_position_ids)
from megatron.vlm.lineages.qwen.vision_windows import rotary_position_ids, vision_windows  # noqa: E402
from omnibal_ext.errors import UserError  # noqa: E402

IMAGE, VIDEO, VSTART, VEND = 60, 61, 62, 63


def photo(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A synthetic photo: per-channel gradients plus noise, uint8."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    base = 255 * (0.5 * y + 0.3 * x * np.array([1.0, 0.4, 0.7]) + 0.2 * np.sin(7 * x + 3 * y))
    noise = rng.normal(0, 20, size=(height, width, 3))
    image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, size=(height, width), dtype=np.uint8), "L")
        image.putalpha(alpha)
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def reference(processor, image):
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


# ---------------------------------------------------------------- image preprocessing

def test_smart_resize_matches_reference_everywhere():
    rng = random.Random(0)
    sizes = [(h, w) for h in (1, 13, 14, 27, 28, 42, 56, 70, 98, 111) for w in (1, 28, 42, 70, 300, 5000)]
    sizes += [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(3000)]
    limits = [(56 * 56, 28 * 28 * 1280), (3136, 12845056), (100_000, 200_000)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in limits:
            assert smart_resize(h, w, 28, lo, hi) == ref_image.smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_smart_resize_refuses_aspect_over_200_naming_where():
    assert smart_resize(56, 11200) == ref_image.smart_resize(56, 11200)  # exactly 200: accepted
    with pytest.raises(ValueError):
        ref_image.smart_resize(56, 11201)
    with pytest.raises(UserError, match=r"^data/train\.jsonl:7: .*aspect ratio of 200\.0.* at most 200"):
        smart_resize(56, 11201, where="data/train.jsonl:7")
    with pytest.raises(ImageSizeError, match="aspect ratio"):
        preprocess_image(photo(11201 // 10, 5), where="x.jsonl:1")  # 1120 x 5 px: 224
    with pytest.raises(UserError, match="empty"):
        smart_resize(0, 10)


@pytest.mark.parametrize("height,width", [(56, 11200), (11200, 56), (30, 40), (1000, 700), (333, 517), (28, 28),
                                          (5, 900)])
def test_pixels_bit_identical_default_config(height, width):
    image = photo(height, width, seed=height + width)
    ref_pixels, ref_grid = reference(Qwen2VLImageProcessorPil(), image)
    rows, grid = preprocess_image(image)
    assert rows.dtype == np.float32 and ref_pixels.dtype == np.float32
    assert np.array_equal(rows, ref_pixels)
    assert torch.equal(torch.from_numpy(rows), torch.from_numpy(ref_pixels))
    assert np.array_equal(np.array([grid]), ref_grid)
    assert rows.shape == (grid[1] * grid[2], 3 * 2 * 14 * 14)
    assert resized_grid(height, width) == grid


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA"])
def test_pixels_bit_identical_other_modes(mode):
    image = photo(90, 130, seed=3, mode=mode)
    if mode == "P":
        image.info["transparency"] = 5
    ref_pixels, ref_grid = reference(Qwen2VLImageProcessorPil(), image)
    rows, grid = preprocess_image(image)
    assert np.array_equal(rows, ref_pixels) and np.array_equal(np.array([grid]), ref_grid)


FOLDER_CONFIGS = {
    # the published Qwen2.5-VL file: top-level min/max pixels
    "published": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                  "processor_class": "Qwen2_5_VLProcessor"},
    # newer files: size only; a small longest_edge makes the 1000x700 photo shrink; other mean/std
    "size": {"size": {"shortest_edge": 6272, "longest_edge": 120000}, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "resample": 3, "rescale_factor": 0.00392156862745098},
    # both: min/max pixels win over size
    "both": {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "min_pixels": 50000,
             "max_pixels": 90000},
}


@pytest.mark.parametrize("name", sorted(FOLDER_CONFIGS))
def test_pixels_bit_identical_folder_config(tmp_path, name):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(FOLDER_CONFIGS[name]))
    ours = ImageProcessorConfig.from_folder(str(tmp_path))
    ref = Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    for height, width in ((1000, 700), (30, 40), (333, 517)):
        image = photo(height, width, seed=width)
        ref_pixels, ref_grid = reference(ref, image)
        rows, grid = preprocess_image(image, ours)
        assert np.array_equal(rows, ref_pixels), (name, height, width)
        assert np.array_equal(np.array([grid]), ref_grid)


def test_folder_config_nested_and_defaults(tmp_path):
    assert ImageProcessorConfig.from_folder(str(tmp_path)) == ImageProcessorConfig()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 1}))  # ignored: nested wins
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"max_pixels": 77777}}))
    assert ImageProcessorConfig.from_folder(str(tmp_path)).max_pixels == 77777
    assert Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path)).size.longest_edge == 77777
    with pytest.raises(UserError, match="do_normalize = false"):
        ImageProcessorConfig.from_dict({"do_normalize": False})
    with pytest.raises(UserError, match="size must be"):
        ImageProcessorConfig.from_dict({"size": {"height": 448, "width": 448}})
    with pytest.raises(UserError, match="image_mean"):
        ImageProcessorConfig.from_dict({"image_mean": [0.5, 0.5]})


# ---------------------------------------------------------------- M-RoPE positions

@pytest.fixture(scope="module")
def tiny_vl():
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                           fullatt_block_indexes=[1], window_size=112),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    return Qwen2_5_VLModel(config).eval()


def build_sample(pieces, rng):
    """pieces: ints (that many text tokens) and grids (an image block)."""
    ids, grids = [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += rng.integers(2, 50, size=piece).tolist()
        else:
            grids.append(piece)
            ids += [VSTART] + [IMAGE] * (piece[0] * piece[1] * piece[2] // 4) + [VEND]
    return ids, grids


SAMPLES = {
    "text only": [9],
    "one image, text around": [5, (1, 4, 6), 4],
    "image first": [(1, 8, 4), 3],
    "image last": [3, (1, 2, 10)],
    "two images, text between": [2, (1, 6, 4), 3, (1, 4, 12), 5],
    "two frames": [2, (2, 4, 4), 3],
}


def reference_rope(model, ids, grids):
    input_ids = torch.tensor([ids])
    grid = torch.tensor(grids) if grids else None
    pos, delta = model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == IMAGE).int(), image_grid_thw=grid)
    return pos[:, 0], int(delta.reshape(-1)[0])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_mrope_matches_get_rope_index(tiny_vl, name):
    ids, grids = build_sample(SAMPLES[name], np.random.default_rng(1))
    ref_pos, ref_delta = reference_rope(tiny_vl, ids, grids)
    pos, delta = mrope_position_ids(ids, grids, IMAGE)
    assert pos.shape == (3, len(ids)) and pos.dtype == np.int64
    assert torch.equal(torch.from_numpy(pos), ref_pos) and delta == ref_delta


def test_mrope_packed_row_restarts_per_sample(tiny_vl):
    rng = np.random.default_rng(2)
    samples = [build_sample(SAMPLES[name], rng) for name in sorted(SAMPLES)]
    ids = [t for s, _ in samples for t in s] + [0, 0, 0]  # 3 padding tokens
    cu = np.concatenate([[0], np.cumsum([len(s) for s, _ in samples])])
    pos, deltas = packed_mrope_position_ids(ids, cu, [g for _, g in samples], IMAGE)
    for k, (sample_ids, grids) in enumerate(samples):
        ref_pos, ref_delta = reference_rope(tiny_vl, sample_ids, grids)
        assert torch.equal(torch.from_numpy(pos[:, cu[k]:cu[k + 1]]), ref_pos) and deltas[k] == ref_delta
    assert pos[:, -3:].tolist() == [[0, 1, 2]] * 3


def test_mrope_adjacent_images_and_refusals():
    ids = [7, 8] + [IMAGE] * 2 + [IMAGE] * 3 + [9]  # grids (1,2,4) then (1,2,6), no token between
    pos, delta = mrope_position_ids(ids, [(1, 2, 4), (1, 2, 6)], IMAGE)
    assert pos.tolist() == [[0, 1, 2, 2, 4, 4, 4, 7], [0, 1, 2, 2, 4, 4, 4, 7], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert delta == 0
    with pytest.raises(ImageTokenError, match=r"^f\.jsonl:3: 5 image placeholder tokens but .* need 6"):
        mrope_position_ids(ids, [(1, 2, 4), (1, 2, 8)], IMAGE, where="f.jsonl:3")
    with pytest.raises(ImageTokenError, match="cuts it"):
        mrope_position_ids([IMAGE, 5, IMAGE], [(1, 2, 4)], IMAGE)


# ---------------------------------------------------------------- vision windows and rotary ids

GRID_SETS = [
    [(1, 10, 14)],  # merged 5 x 7: ragged windows of 4 x 4
    [(1, 8, 8)],  # merged 4 x 4: exactly one window (the reference pads an empty row and column)
    [(1, 18, 6), (1, 4, 22)],  # two images, both ragged
    [(2, 6, 10), (1, 16, 18)],  # two frames, then 8 x 9 merged
]


@pytest.mark.parametrize("window_size", [112, 56])
@pytest.mark.parametrize("grids", GRID_SETS, ids=str)
def test_windows_and_rotary_ids_match_reference(tiny_vl, grids, window_size):
    visual = tiny_vl.visual
    grid = torch.tensor(grids)
    ref_index, ref_cu_windows = ref_vision.get_vision_window_index(grid, visual.spatial_merge_size, window_size,
                                                                   visual.patch_size)
    ours = vision_windows(grids, window_size, visual.patch_size, visual.spatial_merge_size)
    assert torch.equal(torch.from_numpy(ours.merged_index), ref_index)
    assert torch.equal(torch.from_numpy(ours.cu_window_seqlens), ref_cu_windows)
    assert torch.equal(torch.from_numpy(ours.merged_inverse), torch.argsort(ref_index))
    assert torch.equal(torch.from_numpy(ours.cu_seqlens), ref_vision.get_vision_cu_seqlens(grid))
    patches = int(grid.prod(-1).sum())
    permuted = visual.permute_input_for_window_attn(torch.arange(patches)[:, None], ref_index, patches)[:, 0]
    assert torch.equal(torch.from_numpy(ours.patch_index), permuted)
    assert torch.equal(torch.from_numpy(ours.patch_index[ours.patch_inverse]), torch.arange(patches))
    ref_ids = ref_vision.get_vision_position_ids(grid, visual.spatial_merge_size)
    assert torch.equal(torch.from_numpy(rotary_position_ids(grids, visual.spatial_merge_size)), ref_ids)


def test_vision_forward_unchanged_with_our_indices(tiny_vl):
    """The reference encoder accepts precomputed indices: ours give the very same output (and a wrong
    permutation would not)."""
    visual = tiny_vl.visual
    grids = [(1, 10, 14), (2, 6, 10)]
    grid = torch.tensor(grids)
    x = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    ours = vision_windows(grids, visual.window_size, visual.patch_size, visual.spatial_merge_size)
    with torch.no_grad():
        expected = visual(x, grid).pooler_output
        got = visual(x, grid, window_index=torch.from_numpy(ours.merged_index),
                     cu_window_seqlens=torch.from_numpy(ours.cu_window_seqlens),
                     cu_seqlens=torch.from_numpy(ours.cu_seqlens),
                     position_ids=torch.from_numpy(rotary_position_ids(grids))).pooler_output
        wrong = visual(x, grid, window_index=torch.from_numpy(ours.merged_index[::-1].copy()),
                       cu_window_seqlens=torch.from_numpy(ours.cu_window_seqlens)).pooler_output
    assert torch.equal(got, expected) and not torch.equal(wrong, expected)
    assert ours.max_window_seqlen == 64 and ours.max_seqlen == 140


# ---------------------------------------------------------------- messages records

def test_messages_record_to_turns():
    record = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "<image>Compare with <image>."},
                           {"role": "assistant", "content": "Same."},
                           {"role": "user", "content": "And <image>"},
                           {"role": "assistant", "content": "Different."}],
              "images": ["a.jpg", "b.jpg", "c.png"]}
    conv = parse_messages_record(record, "d.jsonl:4")
    assert [t.role for t in conv.turns] == ["system", "user", "assistant", "user", "assistant"]
    assert conv.turns[1].segments == (ImageRef(0, "a.jpg"), "Compare with ", ImageRef(1, "b.jpg"), ".")
    assert conv.turns[3].segments == ("And ", ImageRef(2, "c.png"))
    assert conv.turns[1].text == "<image>Compare with <image>."
    assert conv.images == ("a.jpg", "b.jpg", "c.png") and conv.where == "d.jsonl:4"
    text_only = parse_messages_line('{"messages": [{"role": "user", "content": "hi"}, '
                                    '{"role": "assistant", "content": "yo"}], "videos": []}', "t:1")
    assert text_only.images == () and text_only.turns[0].segments == ("hi",)


@pytest.mark.parametrize("line,error", [
    ('{"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], '
     '"images": ["a", "b"]}', "1 <image> placeholder.* but 2 image"),
    ('{"messages": [{"role": "user", "content": "<image><image>x"}, {"role": "assistant", "content": "y"}], '
     '"images": ["a"]}', "2 <image> placeholder.* but 1 image"),
    ('{"messages": [{"role": "human", "content": "x"}, {"role": "assistant", "content": "y"}]}', "role = 'human'"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"]}', "not valid JSON"),
    ('["a"]', "JSON object"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant answer"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}]}', "only come first"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<image>"}], '
     '"images": ["a"]}', "they go in user messages"),
])
def test_messages_record_refusals(line, error):
    with pytest.raises(MessagesRecordError, match=r"^data/x\.jsonl:12: .*" + error):
        parse_messages_line(line, "data/x.jsonl:12")


def test_read_messages_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    good = '{"messages": [{"role": "user", "content": "<image>q"}, {"role": "assistant", "content": "a"}], ' \
           '"images": ["i.png"]}'
    path.write_text(good + "\n\n" + good + "\n" + '{"messages": [{"role": "tool", "content": "x"}]}\n')
    records = read_messages_jsonl(str(path))
    assert [c.where for c in (next(records), next(records))] == [f"{path}:1", f"{path}:3"]
    with pytest.raises(UserError, match=rf"^{path}:4: messages\[0\]\.role = 'tool'"):
        next(records)
