"""`omnibal plan --data META.json` and `omnibal isf --stats META.json` on video data (issue 27, item 6): the meta is
scanned by the family's video rule with the --video-* flags, as `omnibal isf stats --write` scans it; the plan's ViT
segments equal those of the written stats file and brute force of the videos' and images' grids; a flag the family's
video rule does not implement, and the flags on stats files, are refused by name."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

av = pytest.importorskip("av")

from omnibal_ext.model.units import get_preset  # noqa: E402
from video_media import write_media  # noqa: E402

MODEL = "qwen2.5-vl-7b"
REPEAT = 12  # the meta's repeat_time: 36 samples of the 3 records


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """``video_media.write_media``'s three records under a meta JSON that repeats them."""
    d = write_media(tmp_path_factory.mktemp("scan_video_plan"))
    path = d / "meta.json"
    path.write_text(json.dumps({"mix": {"root": str(d), "annotation": "d.jsonl", "repeat_time": REPEAT}}))
    return path


def smart_resize_grid(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(rows, cols) of 14 px patches of Qwen2-VL's smart_resize (28 px factor), written from its documented rule."""
    h, w = round(height / 28) * 28, round(width / 28) * 28
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / 28) * 28, math.floor(width / beta / 28) * 28
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return h // 14, w // 14


def brute_force_segments(items, side: int) -> tuple[float, float, float, float]:
    """(mean full, mean window, max full, max window) squared segment lengths per ViT item over ``items`` ((t,
    rows, cols) per image or video of every sample): one full-attention segment of rows x cols per temporal patch,
    windows of side x side patches per temporal slice from the top left."""
    full_sum = window_sum = total = 0
    full_max = window_max = 0.0
    for t, rows, cols in items:
        full = t * (rows * cols) ** 2
        window = t * sum((min(side, rows - r) * min(side, cols - c)) ** 2
                         for r in range(0, rows, side) for c in range(0, cols, side))
        patches = t * rows * cols
        full_sum, window_sum, total = full_sum + full, window_sum + window, total + patches
        full_max, window_max = max(full_max, full / patches), max(window_max, window / patches)
    return full_sum / total, window_sum / total, full_max, window_max


def test_plan_on_a_video_meta_equals_the_written_stats_and_brute_force(meta, tmp_path, capsys):
    """`omnibal plan --data META.json --video-fps 2` on Qwen2.5-VL: v.mp4 gives 4 frames (2 temporal patches), w.mp4
    6 (3), each frame smart_resized at the video processor's min_pixels (20 x 28 patches each), the image at
    the image processor's (4 x 6).  Its ViT segments (`vision_segments` of the scanned stats) equal those of the
    stats `omnibal isf stats --write` writes of the same data and brute force of the grids; its plan JSON equals the
    plan of the written file; `omnibal isf stats --stats META.json --model` summarises as the written file.  A
    family without video, and a stats file, refuse --video-fps by name."""
    from omnibal_cli import build_parser, scan_metas
    from omnibal_ext.cli import run, scan_defaults
    from omnibal_ext.data.stats import load_stats
    from omnibal_ext.model.sample_time import vision_segments

    spec = get_preset(MODEL)
    written = tmp_path / "stats.json"
    assert run(build_parser(), ["isf", "stats", "--stats", str(meta), "--write", str(written), "--model", MODEL,
                                "--video-fps", "2"]) == 0
    args = scan_defaults()
    args.video_fps = 2.0
    scanned = scan_metas([str(meta)], spec, None, args)
    v = scanned.videos
    assert v.frames.tolist() == [4, 6] * REPEAT and v.temporal.tolist() == [2, 3] * REPEAT
    video_grids = [(2, *smart_resize_grid(64, 96, 128 * 28 * 28, 768 * 28 * 28)),
                   (3, *smart_resize_grid(48, 64, 128 * 28 * 28, 768 * 28 * 28))]
    image_grid = (1, *smart_resize_grid(40, 60, 56 * 56, 28 * 28 * 1280))
    assert video_grids == [(2, 20, 28), (3, 20, 28)] and image_grid == (1, 4, 6)
    assert v.patches.tolist() == [t * r * c for t, r, c in video_grids] * REPEAT
    assert scanned.images.patches.tolist() == [24, 24] * REPEAT
    want = brute_force_segments([video_grids[0], video_grids[1], image_grid, image_grid] * REPEAT,
                                spec.vision.window_patches_side)
    from_file = vision_segments(load_stats([written]), spec)
    got = vision_segments(scanned, spec)
    assert dataclasses.astuple(got) == dataclasses.astuple(from_file)
    assert dataclasses.astuple(got) == pytest.approx(want, rel=1e-12)

    common = ["--model", MODEL, "--gpus", "2", "--gpu-memory", "141", "--device", "h200-141g", "--tp", "1", "--pp",
              "1", "--samples-per-group", "2", "--global-batch-size", "8", "--sim-iterations", "2"]
    docs = []
    for data, extra in ((meta, ["--video-fps", "2"]), (written, [])):
        out = tmp_path / f"plan_{len(docs)}.json"
        assert run(build_parser(), ["plan", "--data", str(data), "--json", str(out)] + common + extra) == 0
        doc = json.loads(out.read_text())
        doc.pop("files")
        doc["isf"].pop("search_seconds")  # the search's own CPU time
        docs.append(doc)
    assert docs[0] == docs[1]
    caps = docs[0]["shapes"]["isf_caps"]  # the ISF cap's micro-batch: the data's largest segments per ViT item
    assert (caps["vision_attn_tokens_sq"] / caps["vision_items"],
            caps["vision_window_tokens_sq"] / caps["vision_items"]) == pytest.approx(want[2:], rel=1e-12)

    summaries = []
    for data, extra in ((meta, ["--model", MODEL, "--video-fps", "2"]), (written, [])):
        out = tmp_path / f"summary_{len(summaries)}.json"
        assert run(build_parser(), ["isf", "stats", "--stats", str(data), "--json", str(out)] + extra) == 0
        summaries.append(json.loads(out.read_text())["all"])
    assert summaries[0] == summaries[1] and summaries[0]["samples_with_video"] == 2 * REPEAT

    capsys.readouterr()
    assert run(build_parser(), ["plan", "--data", str(meta), "--json", str(tmp_path / "x.json"), "--video-fps", "2"]
               + common[:1] + ["internvl3-1b"] + common[2:]) == 1  # InternVL's frames-as-tiles rule has no fps
    err = capsys.readouterr().err
    assert "--video-fps" in err and "internvl" in err
    assert run(build_parser(), ["plan", "--data", str(written), "--json", str(tmp_path / "x.json"),
                                "--video-max-frames", "4"] + common) == 1
    assert "--video-max-frames" in capsys.readouterr().err
