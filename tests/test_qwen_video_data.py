"""Qwen2.5-VL and Qwen3-VL video records through the reader and the batcher, against transformers: a record with a
video before an image (an H.264 file made with PyAV here) on the tiny HF folders with their tokenizer; the
sample's ``<|video_pad|>`` blocks (Qwen3-VL: each temporal patch after its ``<{t:.1f} seconds>``, t from the
closed form), the micro-batch's mm_token_type_ids, ViT item order (the video's rows first) and its 3-D RoPE ids
== the model classes' ``get_rope_index`` given the grids and (Qwen2.5-VL) ``second_per_grid_ts`` by closed form."""
import argparse
import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("av")
import hf_tiny_qwen as q25  # noqa: E402
import hf_tiny_qwen3_vl as q3  # noqa: E402

from megatron.vlm.data import RecordDataset  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.data.images import MediaOverrides  # noqa: E402
from megatron.vlm.data.video_sampling import DEFAULT_FOLDER_FPS, VideoOverrides  # noqa: E402
from megatron.vlm.data.video_synthetic import write_coded_video  # noqa: E402

FRAMES, FPS = 7, 6  # Qwen2.5-VL takes every frame: 7 -> padded to 8, t = 4; Qwen3-VL samples 2 fps (min 4 frames)
WIDTH, HEIGHT = 64, 48


def args(**kw):
    """The image and video flags the families' rules read (``MediaOverrides``), the video ones from ``kw``."""
    base = dict(video_fps=None, video_min_frames=None, video_max_frames=None,
                video_max_pixels=None, video_total_pixels=None, video_folder_fps=DEFAULT_FOLDER_FPS)
    return MediaOverrides(video=VideoOverrides.from_args(argparse.Namespace(**{**base, **kw})))


def record_data(folder):
    write_coded_video(str(folder / "v.mp4"), FRAMES, FPS, WIDTH, HEIGHT)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(folder / "a.png")
    path = folder / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "<video>Then <image>: which?"},
                                             {"role": "assistant", "content": "both"}],
                                "videos": ["v.mp4"], "images": ["a.png"]}) + "\n")
    return path


def read(family, hf, data):
    from megatron.vlm.stage.components import runtime_family
    from megatron.vlm.hf.convert import HFSource

    spec = HFSource.open(str(hf)).spec
    assert spec.family == family
    side = runtime_family(spec).data
    tok = build_tokenizer(str(hf), image_tokens=side.image_tokens)
    images, videos = side.image_rule(args(), spec, str(hf)), side.video_rule(args(), spec, str(hf))
    sample = RecordDataset(str(data), tok, images, videos=videos)[0]
    batch = side.batcher(spec, tok.img_context_id, images).make([sample], tok.pad_id, packed=True)
    return tok, sample, batch, videos


def test_qwen2_5_vl_video_record_tokens_and_positions(tmp_path):
    model, ids = q25.make_tiny_with_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}}))
    tok, sample, batch, _ = read("qwen2_5_vl", tmp_path / "hf", record_data(tmp_path))
    tokens = batch["tokens"].reshape(-1)
    video_grid = (4, 4, 4)  # 8 frames of 56 x 56 px (48 x 64 rounded to 28 within the budget)
    assert int((tokens == ids["<|video_pad|>"]).sum()) == 4 * 4 * 4 // 4
    types = batch["mm_token_type_ids"].reshape(-1)
    assert torch.equal(types, (tokens == ids["<|image_pad|>"]).long() + 2 * (tokens == ids["<|video_pad|>"]).long())
    assert tuple(batch["image_grid_thw"][0].tolist()) == video_grid and batch["vision_item_types"].tolist() == [2, 1]
    image_grid = tuple(batch["image_grid_thw"][1].tolist())
    assert batch["pixel_values"].shape[0] == 64 + image_grid[1] * image_grid[2]
    seconds = 2 / FPS  # every frame taken: 2 frames per temporal patch at the source rate
    want, _ = model.model.get_rope_index(tokens[None], types[None], torch.tensor([image_grid]),
                                         torch.tensor([video_grid]), torch.tensor([seconds]))
    assert torch.equal(batch["mrope_position_ids"], want)


def test_qwen3_vl_video_record_timestamps_and_positions(tmp_path):
    model, ids = q3.make_tiny_with_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 16}, "patch_size": 16}))
    tok, sample, batch, rule = read("qwen3_vl", tmp_path / "hf", record_data(tmp_path))
    tokens = batch["tokens"].reshape(-1)
    n = max(4, int(FRAMES / FPS * 2))
    idx = np.linspace(0, FRAMES - 1, n).round().astype(int)
    stamps = [(idx[i] + idx[i + 1]) / 2 / FPS for i in range(0, n, 2)]
    per_patch = int((tokens == ids["<|video_pad|>"]).sum()) // len(stamps)
    block = [ids["<|vision_start|>"]] + [ids["<|video_pad|>"]] * per_patch + [ids["<|vision_end|>"]]
    want_ids = [i for t in stamps for i in tok.encode(f"<{t:.1f} seconds>") + block]
    have = tokens.tolist()
    assert any(have[k:k + len(want_ids)] == want_ids for k in range(len(have))), tok.decode(have)
    types = batch["mm_token_type_ids"].reshape(-1)
    assert torch.equal(types, (tokens == ids["<|image_pad|>"]).long() + 2 * (tokens == ids["<|video_pad|>"]).long())
    grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
    assert batch["vision_item_types"].tolist() == [2] * len(stamps) + [1]
    t, (_, gh, gw) = len(stamps), grids[0]
    assert grids[:t] == [(1, gh, gw)] * t
    keys = batch["tile_keys"]  # drop path per video: its blocks' rows share a key, the image's another
    video_rows = t * gh * gw
    assert len(set(keys[:video_rows].tolist())) == 1 and keys[video_rows] != keys[0]
    want, _ = model.model.get_rope_index(tokens[None], types[None], torch.tensor([grids[-1]]),
                                         torch.tensor([(t, gh, gw)]))
    assert torch.equal(batch["mrope_position_ids"], want)


def test_qwen2_5_vl_video_pixels_equal_the_pil_image_processor_per_frame(tmp_path):
    """Each temporal patch's rows: frame 2k's values in the patch's first frame slot and frame 2k+1's in the
    second, each as transformers' ``Qwen2VLImageProcessorPil`` makes that frame alone (its smart_resize with the
    video bounds is the video rule's size); an odd last frame is repeated."""
    from transformers import Qwen2VLImageProcessorPil

    from megatron.vlm.data.video import load_video
    from megatron.vlm.lineages.qwen import video as qwen2

    write_coded_video(str(tmp_path / "v.mp4"), 5, 6, 96, 64)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 12}}))
    s = qwen2.settings(str(tmp_path))
    rule = qwen2.QwenFrames(s)
    ours = rule.video_sample(str(tmp_path / "v.mp4"))
    frames = load_video(str(tmp_path / "v.mp4"), rule).frames
    processor = Qwen2VLImageProcessorPil(min_pixels=s.min_pixels, max_pixels=s.max_pixels)
    t, gh, gw = ours.grid_thw
    assert t == 3
    rows = ours.pixel_values.reshape(t, gh * gw, 3, 2, 14 * 14)
    for k in range(t):
        for slot in range(2):
            frame = frames[min(2 * k + slot, len(frames) - 1)]
            out = processor(images=Image.fromarray(frame), return_tensors="np")
            assert tuple(out["image_grid_thw"][0]) == (1, gh, gw)
            want = out["pixel_values"].reshape(gh * gw, 3, 2, 14 * 14)[:, :, 0]
            assert np.array_equal(rows[k, :, :, slot], want), (k, slot)


def test_a_video_processor_of_another_patch_size_is_refused(tmp_path):
    from megatron.vlm.lineages.qwen.data import video_rule
    from megatron.vlm.hf.convert import HFSource
    from omnibal_ext.errors import UserError

    q25.make_tiny_with_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "video_preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(UserError, match=r"patch_size .*\(16, 2, 2\) differ from the model's vision_config \(14, 2, 2\)"):
        video_rule(args(), HFSource.open(str(tmp_path / "hf")).spec, str(tmp_path / "hf"))
