"""PyAV decoding and frame folders (megatron/vlm/data/video_decode.py) on H.264 files made here.

Each frame of a test video shows its own index (video_synthetic.coded_frame), so the oracle is the index written:
a decoded frame must read back as the index asked for, whatever H.264 did to its pixels.
"""
import os

import numpy as np
import pytest

from megatron.vlm.data.video_decode import VideoError, decode_frames, folder_frame_files, probe_video
from megatron.vlm.data.video_synthetic import coded_frame, frame_code, write_coded_folder, write_coded_video
from omnibal_ext.errors import UserError

pytest.importorskip("av")

# (seconds, fps, width, height): the range, 1-8 s, 6-30 fps, 64x48 to 224x160
SHAPES = [(1, 6, 64, 48), (3, 25, 96, 64), (8, 30, 224, 160)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    out = {}
    for seconds, fps, w, h in SHAPES:
        out[(seconds, fps, w, h)] = write_coded_video(str(root / f"v{seconds}_{fps}_{w}x{h}.mp4"),
                                                      seconds * fps, fps, w, h, audio=(fps == 25))
    out["gop"] = write_coded_video(str(root / "gop.mp4"), 8 * 30, 30, 64, 48, gop=15)
    return out


def test_coded_frames_read_back_exactly():
    for i in (0, 1, 255, 1000, 65535):
        assert frame_code(coded_frame(i, 64, 48)) == i


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{}s_{}fps_{}x{}".format(*s))
def test_probe_and_every_frame(videos, shape):
    seconds, fps, w, h = shape
    info = probe_video(videos[shape])
    assert (info.fps, info.num_frames, info.width, info.height) == (fps, seconds * fps, w, h)
    assert info.duration_s == pytest.approx(seconds)
    decoded = decode_frames(videos[shape], info, range(info.num_frames), seek=False)
    assert decoded.frames.shape == (info.num_frames, h, w, 3) and decoded.frames.dtype == np.uint8
    assert [frame_code(f) for f in decoded.frames] == list(range(info.num_frames))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{}s_{}fps_{}x{}".format(*s))
def test_sampled_frames_any_order_with_repeats(videos, shape):
    info = probe_video(videos[shape])
    n = info.num_frames
    asked = [n - 1, 0, n // 2, n // 2, n // 3 + 1]
    decoded = decode_frames(videos[shape], info, asked)
    assert [frame_code(f) for f in decoded.frames] == asked
    assert decoded.indices == tuple(asked)


def test_seeking_decodes_a_clip_not_the_whole_file(videos):
    path = videos["gop"]  # 240 frames, a keyframe every 15
    info = probe_video(path)
    clip = list(range(180, 196, 2))  # 0.5 s at 15 fps, 6 s into the file
    with_seek = decode_frames(path, info, clip)
    without = decode_frames(path, info, clip, seek=False)
    assert [frame_code(f) for f in with_seek.frames] == clip == [frame_code(f) for f in without.frames]
    assert without.decoded == clip[-1] + 1  # from the start to the last wanted frame, then stops
    assert with_seek.decoded <= 15 + len(range(180, 195))  # from the keyframe at or before 180
    # far-apart frames (over reseek_gap_s apart): a new seek for each; the keyframe interval is 0.5 s
    spread = [3, 100, 230]
    far = decode_frames(path, info, spread, reseek_gap_s=1.0)
    assert [frame_code(f) for f in far.frames] == spread
    assert far.decoded <= 3 * 16
    assert decode_frames(path, info, spread).decoded == 231  # gaps of 3.2 and 4.3 s < the default 5 s: no seek
    assert decode_frames(path, info, [3, 230]).decoded <= 2 * 16  # 7.6 s apart: seeks again


def test_audio_track_is_ignored(videos):
    path = videos[(3, 25, 96, 64)]
    import av

    with av.open(path) as container:
        assert len(container.streams.audio) == 1  # the file has one
    info = probe_video(path)
    assert info.num_frames == 75
    assert [frame_code(f) for f in decode_frames(path, info, [0, 74, 37]).frames] == [0, 74, 37]


def test_frame_folder(tmp_path):
    folder = write_coded_folder(str(tmp_path / "frames"), 12, 64, 48)  # frame_0.png .. frame_11.png
    (tmp_path / "frames" / "notes.txt").write_text("not a frame")
    names = [os.path.basename(f) for f in folder_frame_files(folder)]
    assert names == [f"frame_{i}.png" for i in range(12)]  # frame_2 before frame_10
    info = probe_video(folder)
    assert (info.is_folder, info.fps, info.num_frames, info.width, info.height) == (True, 24.0, 12, 64, 48)
    assert probe_video(folder, folder_fps=6).fps == 6.0
    decoded = decode_frames(folder, info, [11, 2, 10])
    assert [frame_code(f) for f in decoded.frames] == [11, 2, 10] and decoded.decoded == 3


def test_bad_folders_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(VideoError, match=r"^d.jsonl:2: video .*empty: frame folder without images"):
        probe_video(str(empty), where="d.jsonl:2")
    folder = write_coded_folder(str(tmp_path / "mixed"), 3, 64, 48)
    from PIL import Image

    Image.fromarray(coded_frame(3, 32, 32)).save(os.path.join(folder, "frame_3.png"))
    info = probe_video(folder)
    with pytest.raises(VideoError, match="frame frame_3.png is 32x32 px"):
        decode_frames(folder, info, range(info.num_frames))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "0.png").write_bytes(b"not a png")
    with pytest.raises(VideoError, match=r"frame 0.png is unreadable"):
        probe_video(str(tmp_path / "broken"))


def test_truncated_file_is_refused_naming_it(tmp_path):
    path = write_coded_video(str(tmp_path / "full.mp4"), 48, 24, 160, 120, gop=12, faststart=True)
    data = open(path, "rb").read()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 2])  # the index survives (faststart), half the frames do not
    info = probe_video(str(cut))
    assert info.num_frames == 48  # the header still promises them
    early = decode_frames(str(cut), info, [0, 5])  # frames before the cut are fine
    assert [frame_code(f) for f in early.frames] == [0, 5]
    with pytest.raises(VideoError, match=r"^m.jsonl:7: video .*cut.mp4: truncated"):
        decode_frames(str(cut), info, [0, 47], where="m.jsonl:7")
    # without faststart the index is at the end: a truncated copy does not even open as a video
    plain = write_coded_video(str(tmp_path / "plain.mp4"), 48, 24, 160, 120)
    data = open(plain, "rb").read()
    (tmp_path / "plain_cut.mp4").write_bytes(data[: len(data) // 2])
    with pytest.raises(VideoError, match=r"^m.jsonl:8: video .*plain_cut.mp4: "):
        probe_video(str(tmp_path / "plain_cut.mp4"), where="m.jsonl:8")


def test_zero_decodable_frames_and_unreadable_files(tmp_path):
    path = write_coded_video(str(tmp_path / "v.mp4"), 24, 12, 64, 48, faststart=True)
    data = bytearray(open(path, "rb").read())
    at = data.find(b"mdat") + 4
    data[at:] = bytes(len(data) - at)  # every frame's data zeroed, the header intact
    (tmp_path / "zero.mp4").write_bytes(bytes(data))
    info = probe_video(str(tmp_path / "zero.mp4"))
    with pytest.raises(VideoError, match=r"zero.mp4: .*zero decodable frames"):
        decode_frames(str(tmp_path / "zero.mp4"), info, [0, 23])
    (tmp_path / "junk.mp4").write_bytes(b"junk" * 100)
    with pytest.raises(VideoError, match=r"junk.mp4: unreadable"):
        probe_video(str(tmp_path / "junk.mp4"))
    with pytest.raises(VideoError, match=r"missing.mp4: no such file"):
        probe_video(str(tmp_path / "missing.mp4"))
    assert issubclass(VideoError, UserError)


def test_bench_video_decode_runs(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_video_decode", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "bench_video_decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--out", str(tmp_path), "--quick", "--seconds", "10", "--sizes", "64x48", "--gop", "15"]) == 0
    import json

    rows = json.loads((tmp_path / "video_decode.json").read_text())["rows"]
    seek, plain = [r for r in rows if r["seek"]], [r for r in rows if not r["seek"]]
    assert len(seek) == len(plain) == 1 and seek[0]["sampled_per_clip"] == 16
    assert seek[0]["decoded_per_clip"] <= plain[0]["decoded_per_clip"]
