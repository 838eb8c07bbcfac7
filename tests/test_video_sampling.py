"""Frame sampling, resize sizes, timestamps and settings (megatron/vlm/data/video_sampling.py, each family's
video.py) against
transformers 5.23 where its code runs without torchvision, else against the rule written out here.

What runs without torchvision (checked): ``transformers.video_utils`` (``VideoMetadata``), the module-level
``smart_resize`` of ``video_processing_qwen3_vl`` and of ``image_processing_pil_qwen2_vl`` (the function the
Qwen2-VL video processor copies), and the plain methods ``Qwen3VLVideoProcessor.sample_frames``,
``get_num_of_video_patches`` and ``Qwen3VLProcessor._calculate_timestamps`` (called from the class dict on a
stand-in ``self``: the class itself refuses to instantiate).  ``video_processing_qwen2_vl`` imports
torchvision at the top: its sampling is written out here from its source (with torch's own ``arange``).
"""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.vlm.data import video_sampling as vs
from megatron.vlm.data.video_decode import VideoError
from megatron.vlm.data.video_sampling import VideoOverrides, VideoSettings
from megatron.vlm.families.internvl import video as internvl
from megatron.vlm.lineages.qwen import video as qwen2
from megatron.vlm.lineages.qwen.qwen3_vit import video as qwen3
from omnibal_ext.errors import UserError

q3 = pytest.importorskip("transformers.models.qwen3_vl.video_processing_qwen3_vl")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_qwen2_smart_resize  # noqa: E402
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

# (frames, source fps): 1-8 s at 6-30 fps, a 30-s and a 2-min file, a one-frame and a three-frame video
VIDEOS = [(6, 6.0), (7, 6.0), (17, 8.5), (30, 30.0), (48, 24.0), (75, 25.0), (101, 12.0), (240, 30.0),
          (900, 30.0), (3600, 29.97), (1, 30.0), (3, 10.0)]


SETTINGS = {"qwen2_vl": lambda overrides=VideoOverrides(), folder=None: qwen2.settings(folder, overrides),
            "qwen3_vl": lambda overrides=VideoOverrides(), folder=None: qwen3.settings(folder, overrides),
            "internvl": lambda overrides=VideoOverrides(), folder=None: internvl.settings(overrides)}


def video_settings(processor, folder=None, overrides=VideoOverrides()):
    return SETTINGS[processor](overrides, folder)


def _qwen3_self(s: VideoSettings, **extra):
    return SimpleNamespace(fps=s.fps, min_frames=s.min_frames, max_frames=s.max_frames,
                           temporal_patch_size=s.temporal_patch_size, patch_size=s.patch_size,
                           merge_size=s.merge_size, size={"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels},
                           cap_pixels_per_frame=s.cap_pixels_per_frame, max_video_tokens=s.max_video_tokens, **extra)


@pytest.mark.parametrize("fps,min_frames,max_frames", [(2.0, 4, 768), (0.5, 4, 768), (4.0, 2, 16), (1.0, 8, 9)])
def test_qwen3_vl_indices_equal_transformers(fps, min_frames, max_frames):
    s = video_settings("qwen3_vl", overrides=VideoOverrides(fps=fps, min_frames=min_frames, max_frames=max_frames))
    hf_sample = vars(q3.Qwen3VLVideoProcessor)["sample_frames"]
    for total, src_fps in VIDEOS:
        ours = qwen3.frame_indices(total, src_fps, s)
        theirs = hf_sample(_qwen3_self(s), VideoMetadata(total_num_frames=total, fps=src_fps))
        assert ours == theirs.tolist(), (total, src_fps)


def _qwen2_vl_rule(total, src_fps, fps, min_frames, max_frames, tp):
    """Qwen2VLVideoProcessor.sample_frames (transformers 5.23), written out from its source."""
    max_frames = math.floor(min(max_frames, total) / tp) * tp
    n = total / src_fps * fps
    n = min(max(n, min_frames), max_frames, total)
    n = math.floor(n / tp) * tp
    return torch.arange(0, total, total / n).int().tolist()


@pytest.mark.parametrize("fps,min_frames,max_frames", [(2.0, 4, 768), (1.0, 4, 768), (6.0, 2, 24)])
def test_qwen2_vl_indices_equal_the_processors_rule(fps, min_frames, max_frames):
    s = video_settings("qwen2_vl", overrides=VideoOverrides(fps=fps, min_frames=min_frames, max_frames=max_frames))
    assert s.sample_frames  # a rate given turns sampling on
    for total, src_fps in VIDEOS:
        if total < 2:
            continue  # transformers divides by zero there; we keep every frame (below)
        assert qwen2.frame_indices(total, src_fps, s) == _qwen2_vl_rule(
            total, src_fps, fps, min_frames, max_frames, 2), (total, src_fps)
    # torch's float arange holds n + 1 values for some counts; transformers keeps them, so do we
    for total in range(2, 160):
        for n in range(2, total + 1, 2):
            # a 1-s video of `total` frames sampled at n fps: n frames exactly
            rate = VideoSettings(**{**vars(s), "fps": float(n), "min_frames": 1, "max_frames": total})
            ours = qwen2.frame_indices(total, float(total), rate)
            assert ours == _qwen2_vl_rule(total, float(total), float(n), 1, total, 2), (total, n)
            assert ours == torch.arange(0, total, total / n).int().tolist()
    assert qwen2.frame_indices(1, 30.0, s) == [0]


def test_qwen2_vl_does_not_sample_by_default():
    s = video_settings("qwen2_vl")
    assert not s.sample_frames
    assert qwen2.frame_indices(75, 25.0, s) == list(range(75))
    assert vs.temporal_padded(list(range(75)), 2) == list(range(75)) + [74]


def _internvl_middles(total, count, pad):
    """InternVL's 'middle' sampling, by brute force: segment k holds the frames f with
    floor(k * total / segments) <= f < floor((k + 1) * total / segments); take its middle."""
    segments = min(count, total)
    out = []
    for k in range(segments):
        frames = [f for f in range(total) if k * total // segments <= f < (k + 1) * total // segments]
        out.append((frames[0] + frames[-1]) // 2)
    return out + [out[-1]] * (count - segments) if pad else out


def test_internvl_indices_and_count():
    for total in list(range(1, 80)) + [240, 900, 3601]:
        for count in (1, 8, 17, 32):
            assert internvl.frame_indices(total, count) == _internvl_middles(total, count, True)
            assert internvl.frame_indices(total, count, pad=False) == _internvl_middles(total, count, False)
    s = video_settings("internvl")
    assert (s.min_frames, s.max_frames) == (8, 32)
    counts = {internvl.frame_count(s, seed) for seed in range(400)}
    assert counts == set(range(8, 33))  # uniform over 8..32, each reproducible from its seed
    assert internvl.frame_count(s, 7) == internvl.frame_count(s, 7)
    capped = video_settings("internvl", overrides=VideoOverrides(max_frames=4))
    assert {internvl.frame_count(capped, seed) for seed in range(50)} == {4}
    rule = internvl.FramesAsTiles(capped, 448)
    assert rule.frame_indices(3, 24.0, 0, is_folder=True) == [0, 1, 2]  # a folder is not padded
    assert rule.frame_indices(3, 24.0, 0, is_folder=False) == [0, 1, 2, 2]


@pytest.mark.parametrize("size", [(48, 64), (160, 224), (1080, 1920), (30, 900), (2000, 3000)])
def test_qwen2_vl_resize_equals_transformers(size):
    h, w = size
    s = video_settings("qwen2_vl", overrides=VideoOverrides(max_pixels=200_000))
    assert qwen2.video_resize(16, h, w, s) == hf_qwen2_smart_resize(h, w, 28, s.min_pixels, 200_000)
    # with the folder's cap_pixels_per_frame: an even share of max_video_tokens' pixels (written out here)
    capped = VideoSettings(**{**vars(s), "cap_pixels_per_frame": True, "max_video_tokens": 2000})
    for n in (2, 16, 64):
        cap = max(min(200_000, int(2000 * 28 * 28 * 0.9) * 2 // n), int(s.min_pixels * 1.05))
        assert qwen2.video_resize(n, h, w, capped) == hf_qwen2_smart_resize(h, w, 28, s.min_pixels, cap)


@pytest.mark.parametrize("size", [(48, 64), (160, 224), (20, 30), (720, 1280), (30, 900)])
@pytest.mark.parametrize("frames", [2, 3, 16, 64, 300])
@pytest.mark.parametrize("cap", [False, True])
def test_qwen3_vl_resize_and_grid_equal_transformers(size, frames, cap):
    h, w = size
    s = VideoSettings(**{**vars(video_settings("qwen3_vl", overrides=VideoOverrides(total_pixels=4_000_000))),
                         "cap_pixels_per_frame": cap})
    grid = qwen3.video_grid_thw(frames, h, w, s)
    patches = vars(q3.Qwen3VLVideoProcessor)["get_num_of_video_patches"](_qwen3_self(s), frames, h, w, {})
    assert grid[0] * grid[1] * grid[2] == patches
    if not cap:
        assert qwen3.video_resize(frames, h, w, s) == q3.smart_resize(frames, h, w, 2, 32, s.min_pixels, 4_000_000)
    assert grid[0] == -(-frames // 2)


def test_qwen3_vl_refuses_a_single_frame():
    s = video_settings("qwen3_vl")
    with pytest.raises(VideoError, match="^d.jsonl:3: a video of 1 frame"):
        qwen3.video_resize(1, 48, 64, s, where="d.jsonl:3")
    with pytest.raises(ValueError):
        q3.smart_resize(1, 48, 64, 2, 32, s.min_pixels, s.max_pixels)  # transformers refuses it too


def test_qwen3_vl_timestamps_equal_transformers():
    s = video_settings("qwen3_vl")
    for total, src_fps in VIDEOS:
        if total < 2:
            continue
        indices = qwen3.frame_indices(total, src_fps, s)
        ours = qwen3.timestamps(indices, src_fps, 2)
        theirs = Qwen3VLProcessor._calculate_timestamps(None, np.array(indices), src_fps, 2)
        assert ours == theirs
        assert len(ours) == qwen3.video_grid_thw(len(indices), 48, 64, s)[0]
    assert [qwen3.timestamp_text(t) for t in qwen3.timestamps([0, 12, 24], 24.0)] == \
        ["<0.2 seconds>", "<1.0 seconds>"]  # (0 + 0.5) / 2 = 0.25 -> 0.2 (Python rounds half to even)


def test_second_per_grid_ts_equals_transformers():
    s = video_settings("qwen2_vl", overrides=VideoOverrides(fps=2.0))
    for total, src_fps in VIDEOS:
        indices = qwen2.frame_indices(total, src_fps, s)
        meta = VideoMetadata(total_num_frames=total, fps=src_fps, frames_indices=indices)
        assert qwen2.second_per_grid_ts(len(indices), total, src_fps, 2) == pytest.approx(2 / meta.sampled_fps,
                                                                                      rel=1e-12)
    assert qwen2.second_per_grid_ts(16, 240, 30.0) == pytest.approx(1.0)  # 2 fps sampled, 2 frames per patch


def test_settings_from_folder_files_and_flags(tmp_path):
    # a published Qwen3-VL video_preprocessor_config.json (size per video, no fps: the class's 2)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "video_processor_type": "Qwen3VLVideoProcessor"}))
    s = video_settings("qwen3_vl", str(tmp_path))
    assert (s.min_pixels, s.max_pixels, s.fps, s.min_frames, s.max_frames) == (4096, 25165824, 2.0, 4, 768)
    s = video_settings("qwen3_vl", str(tmp_path), VideoOverrides(fps=1.0, max_frames=64, total_pixels=10**6,
                                                                  folder_fps=30.0))
    assert (s.fps, s.max_frames, s.max_pixels, s.folder_fps) == (1.0, 64, 10**6, 30.0)
    # a Qwen2.5-VL folder with only preprocessor_config.json: transformers' video processor reads it
    q25 = tmp_path / "q25"
    q25.mkdir()
    (q25 / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056,
                                                              "patch_size": 14}))
    s = video_settings("qwen2_vl", str(q25))
    assert (s.min_pixels, s.max_pixels, s.sample_frames) == (3136, 12845056, False)
    s = video_settings("qwen2_vl", str(q25), VideoOverrides(max_pixels=50_000, min_frames=2))
    assert (s.max_pixels, s.min_frames, s.sample_frames, s.fps) == (50_000, 2, True, 2.0)
    # a nested processor_config.json wins, as in transformers
    (q25 / "processor_config.json").write_text(json.dumps({"video_processor": {"fps": 4, "do_sample_frames": True}}))
    s = video_settings("qwen2_vl", str(q25))
    assert (s.fps, s.sample_frames, s.max_pixels) == (4.0, True, 28 * 28 * 768)


def test_flags_a_family_does_not_implement_are_refused():
    with pytest.raises(UserError, match="--video-total-pixels is not implemented for qwen2_vl"):
        video_settings("qwen2_vl", overrides=VideoOverrides(total_pixels=10**6))
    with pytest.raises(UserError, match="--video-max-pixels is not implemented for qwen3_vl"):
        video_settings("qwen3_vl", overrides=VideoOverrides(max_pixels=10**5))
    for name in ("fps", "max_pixels", "total_pixels"):
        with pytest.raises(UserError, match=f"--video-{name.replace('_', '-')} is not implemented for internvl"):
            video_settings("internvl", overrides=VideoOverrides(**{name: 2}))
    with pytest.raises(UserError, match="min_frames 9 > max_frames 8"):
        video_settings("qwen3_vl", overrides=VideoOverrides(min_frames=9, max_frames=8))
    with pytest.raises(UserError, match="fps"):
        video_settings("qwen3_vl", overrides=VideoOverrides(fps=0.0))


def test_load_video_decodes_the_sampled_frames(tmp_path):
    pytest.importorskip("av")
    from megatron.vlm.data.video import load_video
    from megatron.vlm.data.video_synthetic import frame_code, write_coded_video

    path = write_coded_video(str(tmp_path / "v.mp4"), 150, 30, 96, 64)  # 5 s
    s = video_settings("qwen3_vl")
    rule = qwen3.Qwen3Frames(s)
    clip = load_video(path, rule, where="d.jsonl:1")
    assert list(clip.indices) == qwen3.frame_indices(150, 30.0, s) and len(clip.indices) == 10
    assert [frame_code(f) for f in clip.frames] == list(clip.indices)
    part = load_video(path, rule, clip_s=(2.0, 4.0))  # frames 60..119, sampled as a video of their own
    assert list(part.indices) == [60 + i for i in qwen3.frame_indices(60, 30.0, s)]
    assert [frame_code(f) for f in part.frames] == list(part.indices)
    with pytest.raises(VideoError, match="clip 9-10 s holds no frame"):
        load_video(path, rule, clip_s=(9.0, 10.0))
