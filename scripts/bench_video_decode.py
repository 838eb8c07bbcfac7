#!/usr/bin/env python
"""Video decode throughput of one data-loader worker (one process, one decoder thread).

Data: H.264 files made here (megatron/vlm/data/video_synthetic.py: index-coded frames, libx264 crf 23,
x264's default keyframe placement unless --gop), ``--seconds`` long (30) at ``--fps`` (30), at each size of
``--sizes``.  Each clip is ``--clip-seconds`` (8) at a random start, sampled at ``--sample-fps`` (2): 16 frames,
Qwen3-VL's rule (``families/qwen3_vl/video.frame_indices``) over the clip's frames.  Decoded with keyframe
seeking (``decode_frames``) and without (from the file's start).  Per row: clips/s, sampled frames/s, and
frames the decoder produced per clip.  Compare clips/s x workers with the samples/s a trainer step consumes.

Outputs: a table on stdout and ``--json`` (default video_decode.json in ``--out``).

``--loader-vs-step``: whether the loader is hidden behind the trainer's step.  ``--train-videos`` H.264 files
(``--train-seconds`` s at ``--fps``, ``--train-size``) are written with a one-turn record each; one process (one
DataLoader worker) loads every sample as the trainer's dataset does (``RecordDataset.sample``: decode the rule's
frames with keyframe seeking, resize, normalise; the built-in tiny model's frames-as-tiles rule at
``--video-max-frames``), giving samples/s per worker; then the trainer (``pretrain_vlm.py --model tiny``, one rank,
``--num-workers 1``) trains on the same records and its steady ms/iteration (median after 2 warm-up iterations)
gives the samples/s a step consumes.  Workers needed = consumed / per worker (rounded up); the loader is hidden when
``--num-workers`` >= that.  The JSON gets the row ``loader_vs_step``.

Usage: python scripts/bench_video_decode.py [--out DIR] [--json OUT] [--clips N] [--quick] [--loader-vs-step]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from megatron.vlm.data.video_decode import decode_frames, probe_video  # noqa: E402
from megatron.vlm.data.video_sampling import VideoOverrides  # noqa: E402
from megatron.vlm.lineages.qwen.qwen3_vit.video import frame_indices, settings  # noqa: E402
from megatron.vlm.data.video_synthetic import frame_code, write_coded_video  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder for the videos and the JSON (default: a temporary one)")
    p.add_argument("--json", default=None, help="JSON output path (default: OUT/video_decode.json)")
    p.add_argument("--seconds", type=int, default=30, help="length of each source file in s")
    p.add_argument("--fps", type=int, default=30, help="source frame rate")
    p.add_argument("--sizes", default="224x160,640x360", help="source sizes, WxH comma-separated")
    p.add_argument("--gop", type=int, default=None, help="frames between keyframes (default: x264's choice)")
    p.add_argument("--clip-seconds", type=float, default=8.0)
    p.add_argument("--sample-fps", type=float, default=2.0)
    p.add_argument("--clips", type=int, default=20, help="clips timed per row")
    p.add_argument("--quick", action="store_true", help="5 clips per row, the smaller size only")
    p.add_argument("--loader-vs-step", action="store_true", help="per-worker loading against the trainer's step")
    p.add_argument("--train-videos", type=int, default=16)
    p.add_argument("--train-seconds", type=int, default=8)
    p.add_argument("--train-size", default="224x160")
    p.add_argument("--video-max-frames", type=int, default=16)
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=4)
    return p.parse_args(argv)


def loader_vs_step(args, out: str) -> dict:
    """The ``--loader-vs-step`` row (module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchlib as bl
    from megatron.vlm.data import RecordDataset, TileImages
    from megatron.vlm.data.tokenizer import build_tokenizer
    from megatron.vlm.families.internvl.video import FramesAsTiles
    from megatron.vlm.families.internvl.video import settings as internvl_settings
    from omnibal_ext.model.units import get_preset

    data = os.path.join(out, "train")
    os.makedirs(data, exist_ok=True)
    w, h = (int(v) for v in args.train_size.split("x"))
    records = []
    for k in range(args.train_videos):
        name = f"t{k}.mp4"
        write_coded_video(os.path.join(data, name), args.train_seconds * args.fps, args.fps, w, h)
        records.append({"video": name, "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                                         {"from": "gpt", "value": f"scene {k}"}]})
    jsonl = os.path.join(data, "train.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    spec = get_preset("tiny")
    rule = FramesAsTiles(internvl_settings(VideoOverrides(max_frames=args.video_max_frames)), spec.vision.image_size)
    dataset = RecordDataset(jsonl, build_tokenizer(None), TileImages(spec.vision.image_size, spec.tokens_per_tile, 6),
                            2048, videos=rule)
    t0 = time.perf_counter()
    frames = sum(int(dataset.sample(i)["pixel_values"].shape[0]) for i in range(len(dataset)))
    per_worker = len(dataset) / (time.perf_counter() - t0)
    flags = ["--model", "tiny", "--data-path", jsonl, "--train-iters", str(args.train_iters), "--micro-batch-size",
             str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size), "--video-max-frames",
             str(args.video_max_frames), "--seq-length", "2048", "--num-workers", "1", "--eval-interval", "0",
             "--data-cache-dir", os.path.join(out, "cache")]
    run = bl.run_trainer(flags, os.path.join(out, "run"), "step", nproc=1, timeout=1800)
    step = bl.rates(bl.steady(run.records, 2))
    consumed = args.global_batch_size / (step["ms_per_iter"] / 1e3)
    needed = int(np.ceil(consumed / per_worker))
    return {"videos": args.train_videos, "video": f"{args.train_seconds} s at {args.fps} fps, {args.train_size}, H.264",
            "frames_per_sample": frames / len(dataset), "model": "tiny (InternVL family, frames as 32-px tiles)",
            "loader_samples_per_s_per_worker": per_worker, "step_ms": step["ms_per_iter"],
            "samples_per_step": args.global_batch_size, "step_samples_per_s": consumed, "workers_needed": needed,
            "hidden_with_workers": needed, "hidden_with_1_worker": needed <= 1, "trainer_ranks": 1,
            "machine": "this CPU host (shared, 2 cores), one trainer rank"}


def bench_row(path: str, args, seek: bool, rng: np.random.Generator) -> dict:
    info = probe_video(path)
    s = settings(overrides=VideoOverrides(fps=args.sample_fps))
    clip_frames = int(round(args.clip_seconds * info.fps))
    starts = rng.integers(0, info.num_frames - clip_frames + 1, size=args.clips)
    decoded = sampled = 0
    t0 = time.perf_counter()
    for start in starts:
        indices = [int(start) + i for i in frame_indices(clip_frames, info.fps, s)]
        out = decode_frames(path, info, indices, seek=seek)
        decoded += out.decoded
        sampled += len(indices)
        assert frame_code(out.frames[-1]) == indices[-1]  # the right frames, not just fast ones
    seconds = time.perf_counter() - t0
    return {"size": f"{info.width}x{info.height}", "seek": seek, "clips": len(starts),
            "clips_per_s": len(starts) / seconds, "frames_per_s": sampled / seconds,
            "sampled_per_clip": sampled / len(starts), "decoded_per_clip": decoded / len(starts),
            "ms_per_clip": 1000 * seconds / len(starts)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.clips = 5
        args.sizes = args.sizes.split(",")[0]
    out = args.out or tempfile.mkdtemp(prefix="bench_video_")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for size in (args.sizes.split(",") if args.clips > 0 else []):
        w, h = (int(v) for v in size.split("x"))
        path = os.path.join(out, f"src_{w}x{h}.mp4")
        t0 = time.perf_counter()
        write_coded_video(path, args.seconds * args.fps, args.fps, w, h, gop=args.gop)
        print(f"# wrote {path} ({args.seconds} s at {args.fps} fps) in {time.perf_counter() - t0:.1f} s", flush=True)
        for seek in (True, False):
            rows.append(bench_row(path, args, seek, rng))
    header = f"{'source':>9} {'seek':>5} {'clips/s':>8} {'frames/s':>9} {'ms/clip':>8} {'decoded/clip':>13}"
    print(header)
    for r in rows:
        print(f"{r['size']:>9} {'yes' if r['seek'] else 'no':>5} {r['clips_per_s']:8.2f} {r['frames_per_s']:9.1f} "
              f"{r['ms_per_clip']:8.1f} {r['decoded_per_clip']:13.1f}")
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "json")},
              "clip": f"{args.clip_seconds:g} s at {args.sample_fps:g} fps from {args.seconds} s files",
              "workers": 1, "decoder_threads": 1, "rows": rows, "date": "2026-12-02"}
    if args.loader_vs_step:
        row = loader_vs_step(args, out)
        result["loader_vs_step"] = row
        print(f"loader: {row['loader_samples_per_s_per_worker']:.2f} samples/s per worker "
              f"({row['frames_per_sample']:.0f} frames each); trainer step {row['step_ms']:.0f} ms for "
              f"{row['samples_per_step']} samples = {row['step_samples_per_s']:.2f} samples/s; workers needed to hide "
              f"the loader: {row['workers_needed']}")
    path = args.json or os.path.join(out, "video_decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# json: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
