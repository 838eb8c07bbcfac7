"""scripts/bench_e2e.py --videos: the video and image mix's videos are H.264 files of 1-8 s at 6-30 fps (read back
with PyAV), and the trainer's scan counts each video per temporal patch, as the Qwen2-VL video processor's rules
give in closed form (bench flags: 1 frame per second, 2 to 6 frames floored to the temporal patch of 2; every frame
enlarged to the 128 x 28 x 28 px minimum: 280 x 392 px, 20 x 28 = 560 patches per temporal patch)."""
import json
import math
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytest.importorskip("av")
sys.path.insert(0, str(ROOT / "scripts"))
import benchlib as bl  # noqa: E402


def test_video_mix_counts_every_video_per_temporal_patch(tmp_path):
    import av

    path = bl.write_video_mix(tmp_path / "data", 12, 56, video_share=0.5, num_videos=4)
    records = [json.loads(line) for line in open(path)]
    expected_items, expected_sq, videos = [], 0, 0
    for r in records:
        if "videos" in r:
            with av.open(str(Path(path).parent / r["videos"][0])) as f:
                stream = f.streams.video[0]
                frames, fps = stream.frames, float(stream.average_rate)
            seconds = frames / fps
            assert 1 <= seconds <= 8 and 6 <= fps <= 30 and "<video>" in r["messages"][0]["content"]
            n = min(max(math.floor(seconds), 2), 6)  # 1 fps, 2..6 frames
            t = n // 2  # temporal patches of 2 frames
            expected_items.append(t * 560)
            expected_sq += t * 560**2
            videos += 1
        else:
            k = len(r.get("images", []))
            expected_items.append(16 * k if k else None)  # a 56 px image: 4 x 4 patches; text only: a dummy item
            expected_sq += k * 16**2
    assert 0 < videos < len(records)
    flags = bl.trainer_argv({"--model": "qwen2.5-vl-tiny", **bl.VIDEO_FLAGS, "--data-path": path,
                             "--seq-length": bl.VIDEO_SEQ_LENGTH, "--micro-batch-size": 2,
                             "--global-batch-size": 2, "--data-cache-dir": str(tmp_path / "cache")})
    tokens, items, groups, sums = bl.trainer_isf_data(flags + ["--omnibal-isf"], 1)
    assert [e for e in expected_items if e] == [int(i) for i, e in zip(items, expected_items) if e]
    assert sums["videos"] == videos and sums["vit_full_sq"] == expected_sq
    assert 1 <= groups <= len(records) and len(tokens) == len(records)
