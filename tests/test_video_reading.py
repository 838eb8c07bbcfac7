"""Video records through the reader (megatron/vlm/data/records.py) with InternVL's frames-as-tiles rule
(megatron/vlm/families/internvl/video.py): every record format gives the tiles and the prompt InternVL's fine-tuning
code writes, against an oracle decoded with PyAV here, frames picked by brute force and resized and normalised by
hand; bad videos are named with file:line and --skip-bad-samples leaves them out; the Qwen families' video samples
(pixel rows, grid, time) against the image path and the closed forms."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

av = pytest.importorskip("av")

from megatron.vlm.data import DataValidationError, RecordDataset, TileImages  # noqa: E402
from megatron.vlm.data.template import render_conversation  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.data.video_sampling import VideoOverrides  # noqa: E402
from megatron.vlm.data.video_synthetic import frame_code, write_coded_folder, write_coded_video  # noqa: E402
from megatron.vlm.families.internvl import video as internvl  # noqa: E402

SIZE, TPT = 448, 4  # InternVL's tile side (px); image tokens per tile (small, for short samples)
FRAMES = 4  # --video-min-frames = --video-max-frames: InternVL's count fixed
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TOK = build_tokenizer(None)


def rule(frames: int = FRAMES) -> internvl.FramesAsTiles:
    return internvl.FramesAsTiles(internvl.settings(VideoOverrides(min_frames=frames, max_frames=frames)), SIZE)


def read(path, skip_bad=False, videos=None, seq=None, truncate=False):
    return RecordDataset(str(path), TOK, TileImages(SIZE, TPT, 6), seq, truncate, videos=videos or rule(),
                         skip_bad=skip_bad)


def every_frame(path: str) -> list[np.ndarray]:
    """Every frame of a video file, decoded from the start with PyAV (the oracle's frames)."""
    with av.open(path) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def middles(total: int, count: int) -> list[int]:
    """InternVL's middle frame of each of ``count`` equal segments, by brute force (module docstring)."""
    out = []
    for k in range(min(count, total)):
        frames = [f for f in range(total) if k * total // count <= f < (k + 1) * total // count]
        out.append((frames[0] + frames[-1]) // 2)
    return out + [out[-1]] * (count - len(out))


def tiles_by_hand(frames: list[np.ndarray]) -> torch.Tensor:
    """Each frame resized to SIZE x SIZE (PIL bicubic) and normalised: (v / 255 - mean) / std in float32."""
    out = []
    for f in frames:
        x = np.asarray(Image.fromarray(f).resize((SIZE, SIZE), Image.Resampling.BICUBIC), dtype=np.float64)
        x = (x * (1 / 255)).astype(np.float32)
        out.append(((x - np.float32(MEAN)) / np.float32(STD)).transpose(2, 0, 1))
    return torch.from_numpy(np.stack(out))


def frames_prompt(n: int) -> str:
    return "\n".join(f"Frame-{i}: <image>" for i in range(1, n + 1))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("video_media")
    write_coded_video(str(d / "v.mp4"), 50, 25, 96, 64, gop=10, audio=True)  # 2 s, with an audio track
    write_coded_folder(str(d / "frames"), 9, 64, 48)
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(d / "a.png")
    return d


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_format_gives_internvl_frames_as_tiles_and_prompt(media, tmp_path):
    for name in ("v.mp4", "frames", "a.png"):
        (tmp_path / name).symlink_to(media / name)
    messages = {"messages": [{"role": "user", "content": "<video>\nWhat is shown?"},
                             {"role": "assistant", "content": "Digits."}], "videos": ["v.mp4"]}
    structured = {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"},
                                                             {"type": "text", "text": "\nWhat is shown?"}]},
                               {"role": "assistant", "content": [{"type": "text", "text": "Digits."}]}]}
    internvl_record = {"id": 3, "video": "v.mp4", "conversations": [{"from": "human", "value": "What is shown?"},
                                                                    {"from": "gpt", "value": "Digits."}]}
    folder = {**messages, "videos": ["frames"]}
    mixed = {"messages": [{"role": "user", "content": "<image> then <video>\nWhat is shown?"},
                          {"role": "assistant", "content": "Digits."}], "images": ["a.png"], "videos": ["v.mp4"]}
    data = read(write(tmp_path / "d.jsonl", [messages, structured, internvl_record, folder, mixed]))

    file_frames = every_frame(str(media / "v.mp4"))
    assert [frame_code(f) for f in file_frames] == list(range(50))
    want_file = tiles_by_hand([file_frames[i] for i in middles(50, FRAMES)])
    folder_frames = [np.asarray(Image.open(media / "frames" / f"frame_{i}.png").convert("RGB"))
                     for i in middles(9, FRAMES)]
    want_text = render_conversation([{"from": "human", "value": frames_prompt(FRAMES) + "\nWhat is shown?"},
                                     {"from": "gpt", "value": "Digits."}], TOK, [1] * FRAMES, TPT)[0]
    for i, want_pixels in [(0, want_file), (1, want_file), (2, want_file), (3, tiles_by_hand(folder_frames))]:
        sample = data[i]
        assert sample["pixel_values"].shape == (FRAMES, 3, SIZE, SIZE)
        torch.testing.assert_close(sample["pixel_values"], want_pixels, rtol=0, atol=1e-6)
        assert sample["input_ids"].tolist() == want_text.tolist(), i
        assert sample["image_flags"].tolist() == [1] * FRAMES
    # an image then a video: the image's tiles, then one tile per frame; stats count the frames as tiles
    sample = data[4]
    image_tiles = TileImages(SIZE, TPT, 6).items(60, 40, 1)
    assert len(sample["pixel_values"]) == image_tiles + FRAMES
    torch.testing.assert_close(sample["pixel_values"][image_tiles:], want_file, rtol=0, atol=1e-6)
    want_mixed = render_conversation([{"from": "human", "value": "<image> then " + frames_prompt(FRAMES)
                                       + "\nWhat is shown?"}, {"from": "gpt", "value": "Digits."}], TOK,
                                     [image_tiles] + [1] * FRAMES, TPT)[0]
    assert sample["input_ids"].tolist() == want_mixed.tolist()
    stats = data.sample_stats()
    assert stats.vit.tolist() == [FRAMES] * 4 + [image_tiles + FRAMES]
    assert data.sample_lengths()[0].tolist() == [len(data[i]["input_ids"]) for i in range(5)]
    # the image-free path (no decode) gives the same text
    assert data.sample(4, decode_images=False)["input_ids"].tolist() == want_mixed.tolist()


def test_frame_count_is_drawn_per_record_and_capped(media, tmp_path):
    (tmp_path / "v.mp4").symlink_to(media / "v.mp4")
    record = {"video": "v.mp4", "conversations": [{"from": "human", "value": "<video>\nq"}, {"from": "gpt",
                                                                                           "value": "a"}]}
    drawn = read(write(tmp_path / "d.jsonl", [record] * 12), videos=internvl.FramesAsTiles(internvl.settings(), SIZE))
    counts = drawn.sample_lengths()[1].tolist()
    assert all(8 <= n <= 32 for n in counts) and len(set(counts)) > 1  # 8..32 frames, one count per record
    assert [len(drawn[i]["pixel_values"]) for i in (0, 5)] == [counts[0], counts[5]]  # loads agree with the scan
    capped = read(tmp_path / "d.jsonl", videos=internvl.FramesAsTiles(
        internvl.settings(VideoOverrides(max_frames=5)), SIZE))
    assert set(capped.sample_lengths()[1].tolist()) == {5}  # --video-max-frames alone caps (and lowers the min)


def test_truncation_keeps_or_drops_a_video_whole(media, tmp_path):
    (tmp_path / "v.mp4").symlink_to(media / "v.mp4")
    record = {"messages": [{"role": "user", "content": "<video>\nq"}, {"role": "assistant", "content": "a"}],
              "videos": ["v.mp4"]}
    full = read(write(tmp_path / "d.jsonl", [record]))
    ids = full[0]["input_ids"]
    starts = (ids == TOK.img_start_id).nonzero().flatten().tolist()
    assert len(starts) == FRAMES
    seq = starts[2] + 3  # inside the third frame's block
    sample = read(tmp_path / "d.jsonl", seq=seq, truncate=True)[0]
    assert int(sample["image_flags"].sum()) == 0 and len(sample["pixel_values"]) == 1  # no frame: the dummy tile
    assert sample["input_ids"].tolist() == ids[:starts[0]].tolist()  # cut before the video's first block
    kept = read(tmp_path / "d.jsonl", seq=len(ids) - 1, truncate=True)[0]  # the cut after the video keeps it
    assert int(kept["image_flags"].sum()) == FRAMES
    with pytest.raises(DataValidationError, match=r"d.jsonl:1: sample is \d+ tokens .* --video-max-frames"):
        read(tmp_path / "d.jsonl", seq=seq)


def test_bad_videos_are_named_and_skipped(media, tmp_path):
    (tmp_path / "v.mp4").symlink_to(media / "v.mp4")
    data = (media / "v.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[:len(data) // 2])
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 100)
    (tmp_path / "empty").mkdir()
    good = {"messages": [{"role": "user", "content": "<video>\nq"}, {"role": "assistant", "content": "a"}],
            "videos": ["v.mp4"]}
    records = [good, {**good, "videos": ["cut.mp4"]}, {**good, "videos": ["junk.mp4"]},
               {**good, "videos": ["empty"]}, {**good, "videos": []}, {**good, "videos": ["v.mp4", "v.mp4"]},
               {**good, "videos": ["missing.mp4"]}, good]
    path = write(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataValidationError) as e:
        read(path)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert len(lines) == 6
    assert lines[0].startswith(f"{path}:2: video {tmp_path / 'cut.mp4'}: ")  # truncated (or unreadable) file
    assert lines[1].startswith(f"{path}:3: video {tmp_path / 'junk.mp4'}: unreadable")
    assert lines[2] == f"{path}:4: video {tmp_path / 'empty'}: frame folder without images (zero decodable frames)"
    assert lines[3] == f"{path}:5: 1 <video> placeholder(s) in the messages but 0 video(s) in 'videos'"
    assert lines[4] == f"{path}:6: 1 <video> placeholder(s) in the messages but 2 video(s) in 'videos'"
    assert lines[5].startswith(f"{path}:7: video {tmp_path / 'missing.mp4'}: no such file")
    kept = read(path, skip_bad=True)
    assert len(kept) == 2 and [kept.where(i) for i in range(2)] == [f"{path}:1", f"{path}:8"]
    assert len(kept.scan.skipped) == 6


def test_a_family_without_a_video_rule_refuses_video_records(media, tmp_path):
    (tmp_path / "v.mp4").symlink_to(media / "v.mp4")
    path = write(tmp_path / "d.jsonl", [{"video": "v.mp4", "conversations": [
        {"from": "human", "value": "<video>\nq"}, {"from": "gpt", "value": "a"}]}])
    with pytest.raises(DataValidationError, match=r"d.jsonl:1: 1 video\(s\): the model family does not read videos"):
        RecordDataset(str(path), TOK, TileImages(SIZE, TPT, 6))


def test_qwen_video_samples(media, tmp_path):
    """What the Qwen families' samples hold for a video: a still video of two identical frames gives the image
    path's pixel rows exactly and grid (1, gh, gw); a coded file gives its frames' grid, Qwen2.5-VL's
    second_per_grid_ts and Qwen3-VL's timestamps by their closed forms."""
    from megatron.vlm.lineages.qwen import video as qwen2
    from megatron.vlm.lineages.qwen.image_processing import ImageProcessorConfig, preprocess_image
    from megatron.vlm.lineages.qwen.qwen3_vit import video as qwen3
    from megatron.vlm.lineages.qwen.qwen3_vit.image_processing import PUBLISHED

    still = tmp_path / "still"
    still.mkdir()
    image = Image.open(media / "frames" / "frame_3.png").convert("RGB")
    for i in range(2):
        shutil.copy(media / "frames" / "frame_3.png", still / f"{i}.png")
    s2 = qwen2.settings()
    video = qwen2.QwenFrames(s2).video_sample(str(still))
    rows, grid = preprocess_image(image, ImageProcessorConfig(min_pixels=s2.min_pixels, max_pixels=s2.max_pixels))
    assert video.grid_thw == grid and np.array_equal(video.pixel_values, rows)
    assert video.tokens == grid[1] * grid[2] // 4
    s3 = qwen3.settings()
    video = qwen3.Qwen3Frames(s3, PUBLISHED).video_sample(str(still))
    rows, grid = preprocess_image(image, ImageProcessorConfig(**{**vars(PUBLISHED), "min_pixels": s3.min_pixels // 2,
                                                                 "max_pixels": s3.max_pixels // 2}))
    assert video.grid_thw == grid and np.array_equal(video.pixel_values, rows)
    # a 2-s file at 25 fps sampled at 2 fps
    s2 = qwen2.settings(overrides=VideoOverrides(fps=2.0))
    video = qwen2.QwenFrames(s2).video_sample(str(media / "v.mp4"))
    assert len(video.indices) == 4 and video.grid_thw[0] == 2
    assert video.second_per_grid_ts == pytest.approx(2 / (4 / 50 * 25))  # 2 frames per patch / sampled fps
    assert len(video.pixel_values) == video.grid_thw[0] * video.grid_thw[1] * video.grid_thw[2]
    video = qwen3.Qwen3Frames(qwen3.settings(), PUBLISHED).video_sample(str(media / "v.mp4"))
    idx = np.linspace(0, 49, 4).round().astype(int).tolist()
    assert list(video.indices) == idx
    assert video.timestamps == pytest.approx([(idx[0] + idx[1]) / 2 / 25, (idx[2] + idx[3]) / 2 / 25])


@pytest.mark.slow
def test_tiny_internvl_trains_on_a_video_and_image_mix_at_pp2_with_isf(tmp_path):
    """The built-in tiny model (InternVL family, 32-px tiles) at PP2 with --omnibal-isf on H.264 videos (1-3 s,
    6-30 fps, 64x48 to 96x64, frame folders too) mixed with images: the loss falls."""
    from launch import run_training

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    records = []
    for k in range(24):
        answer = str(k % 10)
        if k % 3 == 0:
            Image.fromarray(np.full((32 + k, 40, 3), 25 * (k % 10), np.uint8)).save(data / f"i{k}.png")
            records.append({"messages": [{"role": "user", "content": "<image>\nWhich shade?"},
                                         {"role": "assistant", "content": answer}], "images": [f"i{k}.png"]})
            continue
        fps = int(rng.choice([6, 12, 30]))
        size = [(64, 48), (96, 64)][k % 2]
        if k % 4 == 1:
            write_coded_folder(str(data / f"f{k}"), 6 + k % 5, *size)
            name = f"f{k}"
        else:
            name = f"v{k}.mp4"
            write_coded_video(str(data / name), fps * (1 + k % 3), fps, *size)
        records.append({"video": name, "conversations": [{"from": "human", "value": "<video>\nHow long?"},
                                                         {"from": "gpt", "value": answer}]})
    write(data / "train.jsonl", records)
    flags = ["--model", "tiny", "--data-path", str(data / "train.jsonl"), "--pipeline-model-parallel-size", "2",
             "--omnibal-isf", "--train-iters", "12", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--video-max-frames", "4", "--seq-length", "512", "--lr", "3e-3", "--lr-warmup-iters", "1",
             "--eval-interval", "0", "--data-cache-dir", str(tmp_path / "cache"), "--seed", "3"]
    found, _ = run_training(2, flags, tmp_path, "video")
    losses = [r["lm loss"] for r in found]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
