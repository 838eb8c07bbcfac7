"""A small video-and-image data folder for the video balancing tests (no download): two H.264 videos (v.mp4: 2 s
at 25 fps, 96 x 64 px; w.mp4: 3 s at 10 fps, 64 x 48 px), a 60 x 40 px image (a.png) and ``d.jsonl``'s three
records in InternVL's messages format: a video; an image and a video; an image."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

RECORDS = [{"messages": [{"role": "user", "content": "<video>what?"}, {"role": "assistant", "content": "a"}],
            "videos": ["v.mp4"]},
           {"messages": [{"role": "user", "content": "<image>and<video>?"}, {"role": "assistant", "content": "b"}],
            "images": ["a.png"], "videos": ["w.mp4"]},
           {"messages": [{"role": "user", "content": "<image>only"}, {"role": "assistant", "content": "c"}],
            "images": ["a.png"]}]


def write_media(folder: Path) -> Path:
    """Write the videos, the image and ``d.jsonl`` into ``folder``; returns ``folder``."""
    from megatron.vlm.data.video_synthetic import write_coded_video

    write_coded_video(str(folder / "v.mp4"), 50, 25, 96, 64, gop=10)
    write_coded_video(str(folder / "w.mp4"), 30, 10, 64, 48, gop=10)
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(folder / "a.png")
    (folder / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return folder
