#!/usr/bin/env python
"""Benchmark of the data level: random batching vs ISF + balanced steps.

On the three InternVL SFT stats files shipped in data/omnibal_stats/ (OmniBal's published ai2d,
chartqa and docvqa stats) and on the same data resampled to 1.2M samples (the paper's mix size): PadRatio, DistRatio (LLM
tokens and ViT tiles), fill, samples per group, and the time of the threshold search and of the
grouping (wall and CPU seconds of this single-threaded process).

    python scripts/bench_isf.py [--stats-dir DIR] [--dp 8] [--samples-per-group 4] [--json OUT]
        [--qwen-model qwen2.5-vl-7b] [--min-pixels PX --max-pixels PX] [--scan-images DIR ...]

Targets: LLM and ViT DistRatio <= 0.02 at token fill >= 0.95 with ~4 samples/group at DP 8;
1.2M grouping + search <= 3 s on one core.

Qwen2.5-VL at native resolution (``--qwen-model``, not with ``--no-qwen``): each sample's ViT and LLM time is
predicted by the cost model (``omnibal_ext.model.sample_time``: ``--qwen-device``, TP 1, flash attention), and
three batchings are compared in time at DP 8: random (K samples per device), ISF by counts (patches and tokens)
and ISF in time. Two datasets: (1) the published stats with one image per sample whose size is drawn to give the
sample's InternVL tile count (``omnibal_ext.data.native.derive_native_stats``: the stats hold no sizes, so these
are sizes consistent with the tiles, not the real ones), and (2) with ``--scan-images``, the real image files
found under the given folders (sizes read from their headers; each sample gets one of them, drawn uniformly,
and the text length of a random sample of the published stats). Target: ISF in time reaches a DistRatio in
time <= 0.01 (ViT and LLM). The images' patches follow the model's ViT (patch and merge sizes) and the pixel
budget of ``--min-pixels``/``--max-pixels`` (Qwen2.5-VL's by default; a Qwen3-VL model:
``--qwen-model qwen3-vl-8b --min-pixels 65536 --max-pixels 16777216``, its published budget).

A video and image mix (``--video-mix N``, or ``--video-only`` for this part alone): N samples, ``--video-share`` of
them (1/3) one video each, the rest the published stats' images with drawn sizes (as above).  The videos' durations
follow LLaVA-Video-178K's published duration buckets (``LLAVA_VIDEO_BUCKETS``: the rows of its subsets per bucket
as its Hugging Face dataset viewer lists them, uniform within a bucket); their frame sizes are a STATED
distribution (``VIDEO_SIZES``: no published resolution statistics were found); frames sampled by Qwen2-VL's video
rule at ``--video-fps`` (2), 4 to ``--video-max-frames`` (64), floored to the temporal patch, each frame
smart_resized within ``--video-max-pixels`` (200704 = 256 merged tokens); text from a random published sample.
Balance is in predicted time with each video's ViT attention per temporal patch, as the Qwen ViTs attend it.
Target: ISF in time <= 0.01 DistRatio in time (ViT and LLM) at DP 8, against random and ISF by counts.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (puts the repository on the path)

from omnibal_ext.data.cli import format_table  # noqa: E402
from omnibal_ext.data.search import SearchConfig, random_baseline, search_params  # noqa: E402
from omnibal_ext.data.isf import isf_group  # noqa: E402
from omnibal_ext.data.search import evaluate_grouping, step_matrix_epoch0  # noqa: E402
from omnibal_ext.data.native import derive_native_stats, native_patches  # noqa: E402
from omnibal_ext.data.search_time import (run_isf_in_time, random_baseline_time,  # noqa: E402
                                          steps_time_metrics)
from omnibal_ext.data.stats import ImageStats, SampleStats, load_stats, resample  # noqa: E402
from omnibal_ext.model.cost_model import get_device  # noqa: E402
from omnibal_ext.model.sample_time import TIME_UNIT_S, sample_time_units  # noqa: E402
from omnibal_ext.model.units import get_preset  # noqa: E402

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff")
TIME_KEYS = ("dist_ratio_vit_time", "dist_ratio_llm_time", "dist_ratio_time", "dist_ratio_vit", "dist_ratio_llm",
             "fill_llm_time", "samples_per_group")



def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def bench_one(name: str, vit, tokens, cfg: SearchConfig) -> dict:
    rnd = random_baseline(vit, tokens, cfg.dp_size, cfg.samples_per_group, cfg.seed)
    search, ws, cs = timed(lambda: search_params(vit, tokens, cfg))
    keys = [tuple(search.best["assembly_key"]), ("tiles", 0.0)]
    grouping, wg, cg = timed(lambda: isf_group(vit, tokens, search.params, seed=cfg.seed))
    (metrics, asm), wa, ca = timed(lambda: evaluate_grouping(grouping, cfg.dp_size, cfg.sp, search.params.qt,
                                                             search.params.qv, seed=cfg.seed, keys=keys))
    print(f"\n== {name}: {len(vit)} samples, DP {cfg.dp_size}, target {cfg.samples_per_group} samples/group")
    print(format_table({"random": rnd, "isf": metrics}))
    p = search.params
    print(f"params qt={p.qt} qv={p.qv} qt_min={p.qt_min} qv_min={p.qv_min} iters={p.iters}; "
          f"{len(grouping)} groups, {grouping.report['leftover_groups']} leftover; "
          f"{len(search.candidates)} candidates")
    total_w, total_c = ws + wg + wa, cs + cg + ca
    print(f"time (wall / cpu s): search {ws:.2f}/{cs:.2f}, grouping {wg:.2f}/{cg:.2f}, "
          f"assembly {wa:.2f}/{ca:.2f}, total {total_w:.2f}/{total_c:.2f}")
    return {
        "samples": int(len(vit)), "random": rnd, "isf": metrics, "params": p.to_dict(),
        "groups": len(grouping), "report": grouping.report, "candidates": len(search.candidates),
        "assembly_key": list(asm.key),
        "seconds": {"search_wall": ws, "search_cpu": cs, "group_wall": wg, "group_cpu": cg,
                    "assembly_wall": wa, "assembly_cpu": ca, "total_wall": total_w, "total_cpu": total_c},
    }


def scan_image_sizes(dirs, min_side: int = 28) -> list[tuple[int, int, str]]:
    """(width, height, path) of every readable image file under ``dirs`` with both sides >= ``min_side`` px,
    one per (file size, name) (copies of one file in several places count once); sizes from the headers."""
    from PIL import Image

    found, seen = [], set()
    for d in dirs:
        for path in sorted(Path(d).rglob("*")):
            if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
                continue
            try:
                key = (path.stat().st_size, path.name)
                if key in seen:
                    continue
                with Image.open(path) as im:
                    w, h = im.size
            except (OSError, ValueError, Image.DecompressionBombError):
                continue
            if min(w, h) >= min_side and max(w, h) / min(w, h) <= 200:
                seen.add(key)
                found.append((int(w), int(h), str(path)))
    return found


def native_rule(spec, args) -> dict:
    """``native_patches`` keywords of ``spec``'s images: its ViT's patch and merge sizes, the pixel budget of
    --min-pixels/--max-pixels (default: the module's)."""
    budget = {k: v for k, v in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels)) if v is not None}
    return dict(patch=spec.vision.patch_size, merge=spec.vision.spatial_merge_size, **budget)


def scanned_stats(sizes, published: SampleStats, n: int, seed: int, rule: dict) -> SampleStats:
    """``n`` one-image samples: an image of ``sizes`` (drawn uniformly) and the text tokens of a random published
    sample (its tokens less InternVL's 256 per tile), plus the image's merged patches (``rule``: ``native_rule``)."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(sizes), n)
    w = np.array([s[0] for s in sizes], dtype=np.int64)[pick]
    h = np.array([s[1] for s in sizes], dtype=np.int64)[pick]
    text = (published.tokens - 256 * published.vit)[rng.integers(0, len(published), n)]
    patches = native_patches(h, w, **rule)
    images = ImageStats(np.arange(n + 1, dtype=np.int64), w, h, patches)
    return SampleStats(np.ones(n, dtype=np.int64), text + patches // rule["merge"] ** 2, np.zeros(n, dtype=np.int32),
                       ["scanned"], images)


def bench_native(name: str, stats: SampleStats, spec, device, cfg: SearchConfig) -> dict:
    """Random, ISF by counts and ISF in time on one native-resolution dataset, balance in predicted time."""
    times = sample_time_units(stats, spec, device)
    patches, tokens = stats.patches, stats.tokens
    rnd = random_baseline_time(patches, tokens, times, cfg.dp_size, cfg.samples_per_group, cfg.seed)
    counts = search_params(patches, tokens, cfg)
    g = isf_group(patches, tokens, counts.params, seed=cfg.seed)
    m_counts, asm = evaluate_grouping(g, cfg.dp_size, cfg.sp, counts.params.qt, counts.params.qv, seed=cfg.seed,
                                      keys=[tuple(counts.best["assembly_key"]), ("tiles", 0.0)])
    steps = step_matrix_epoch0(len(g), asm.width, asm.order, cfg.seed)
    m_counts.update(steps_time_metrics(steps, g, times))
    m_counts["fill_llm_time"] = float("nan")  # no time cap
    plan, wt, ct = timed(lambda: run_isf_in_time(patches, tokens, times, cfg))
    rows = {"random": rnd, "isf-counts": m_counts, "isf-time": plan.metrics}
    print(f"\n== {name}: {len(stats)} samples, {spec.name} on {device.name}, DP {cfg.dp_size}, "
          f"K {cfg.samples_per_group}; patches/sample mean {patches.mean():.0f}, tokens mean {tokens.mean():.0f}")
    head = f"{'batching':<11}" + "".join(f"{k:>21}" for k in TIME_KEYS)
    print(head + "\n" + "-" * len(head))
    for k, m in rows.items():
        print(f"{k:<11}" + "".join(f"{m[c]:>21.4f}" for c in TIME_KEYS))
    p = plan.params
    print(f"ISF in time: caps {p.qv} patches, {p.qt} tokens, vit {p.vit_time * TIME_UNIT_S * 1e3:.1f} ms, "
          f"llm {p.llm_time * TIME_UNIT_S * 1e3:.1f} ms; {len(plan.grouping)} groups; search+grouping "
          f"{plan.seconds_search + plan.seconds_group:.2f} s wall, {ct:.2f} s cpu; ISF by counts: caps "
          f"{counts.params.qv} patches, {counts.params.qt} tokens")
    return {"samples": len(stats), "model": spec.name, "device": device.name, "rows": rows,
            "params_time": p.to_dict(), "params_counts": counts.params.to_dict(),
            "patches_mean": float(patches.mean()), "tokens_mean": float(tokens.mean()),
            "seconds": {"time_plan_wall": wt, "time_plan_cpu": ct}}


# LLaVA-Video-178K (lmms-lab/LLaVA-Video-178K, arXiv 2410.02713): rows of its subsets per duration bucket, thousands,
# as the dataset viewer lists them (academic + youtube + nextqa + perceptiontest; activitynet lists no count)
LLAVA_VIDEO_BUCKETS = {(0, 30): 66.2 + 539 + 11 + 1.79, (30, 60): 88.8 + 171 + 13.7 + 0.618,
                       (60, 120): 35.2 + 202 + 9.33, (120, 180): 28.2 + 206 + 0.113}
BENCH_DATE = "2026-12-02"
VIDEO_SIZES = {(640, 360): 0.4, (854, 480): 0.3, (1280, 720): 0.3}  # stated (w, h) px: share of videos


def video_mix_stats(images: SampleStats, published: SampleStats, n: int, share: float, seed: int, spec,
                    fps: float, max_frames: int, max_pixels: int) -> SampleStats:
    """``n`` samples: a ``share`` of them one video each (module docstring), the rest drawn from ``images``
    (one-image native-resolution stats)."""
    from omnibal_ext.data.stats import VideoStats

    rng = np.random.default_rng(seed)
    n_video = int(round(n * share))
    img = images.subset(rng.integers(0, len(images), n - n_video))
    buckets = list(LLAVA_VIDEO_BUCKETS)
    weights = np.array([LLAVA_VIDEO_BUCKETS[b] for b in buckets])
    pick = rng.choice(len(buckets), n_video, p=weights / weights.sum())
    lo = np.array([b[0] for b in buckets])[pick]
    hi = np.array([b[1] for b in buckets])[pick]
    duration = rng.uniform(np.maximum(lo, 1), hi)
    tp = spec.vision.temporal_patch_size
    frames = np.clip(np.floor(duration * fps), 4, max_frames).astype(np.int64) // tp * tp
    sizes = list(VIDEO_SIZES)
    which = rng.choice(len(sizes), n_video, p=list(VIDEO_SIZES.values()))
    w = np.array([s[0] for s in sizes], dtype=np.int64)[which]
    h = np.array([s[1] for s in sizes], dtype=np.int64)[which]
    per_frame = native_patches(h, w, min_pixels=128 * 28 * 28, max_pixels=max_pixels,
                               patch=spec.vision.patch_size, merge=spec.vision.spatial_merge_size)
    temporal = frames // tp
    patches = temporal * per_frame
    text = (published.tokens - 256 * published.vit)[rng.integers(0, len(published), n_video)]
    merge = spec.vision.spatial_merge_size ** 2
    vit = np.concatenate([img.patches, patches])
    tokens = np.concatenate([img.tokens, text + patches // merge])
    offsets_img = np.concatenate([img.images.offsets, np.full(n_video, img.images.offsets[-1])])
    images_all = ImageStats(offsets_img, img.images.width, img.images.height, img.images.patches)
    offsets_vid = np.concatenate([np.zeros(n - n_video, np.int64), np.arange(n_video + 1, dtype=np.int64)])
    videos = VideoStats(offsets_vid, frames, w, h, patches, temporal)
    order = rng.permutation(n)
    mixed = SampleStats(vit, tokens, np.zeros(n, dtype=np.int32), ["video-mix"], images_all, videos)
    return mixed.subset(order)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stats-dir", type=Path, default=bl.STATS_DIR)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--samples-per-group", type=float, default=4.0)
    ap.add_argument("--resample", type=int, default=1_200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--no-qwen", action="store_true", help="skip the Qwen2.5-VL native-resolution part")
    ap.add_argument("--qwen-model", default="qwen2.5-vl-7b")
    ap.add_argument("--qwen-device", default="h200-141g")
    ap.add_argument("--min-pixels", type=int, default=None,
                    help="native-resolution pixel budget per image, px (default: Qwen2.5-VL's; Qwen3-VL's: 65536)")
    ap.add_argument("--max-pixels", type=int, default=None,
                    help="(default: Qwen2.5-VL's 1003520; Qwen3-VL's: 16777216)")
    ap.add_argument("--scan-images", nargs="+", metavar="DIR", default=[],
                    help="folders whose image files give the scanned dataset's sizes")
    ap.add_argument("--scan-samples", type=int, default=40_000)
    ap.add_argument("--video-mix", type=int, default=0, metavar="N",
                    help="samples of the video and image mix (0: none)")
    ap.add_argument("--video-only", action="store_true", help="only the video and image mix (--video-mix, default "
                                                                  "40000)")
    ap.add_argument("--video-share", type=float, default=1 / 3, help="share of the mix's samples with a video")
    ap.add_argument("--video-fps", type=float, default=2.0)
    ap.add_argument("--video-max-frames", type=int, default=64)
    ap.add_argument("--video-max-pixels", type=int, default=200704)
    args = ap.parse_args(argv)
    try:
        files = bl.stats_files(args.stats_dir)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 1
    stats = load_stats(files)
    cfg = SearchConfig(dp_size=args.dp, samples_per_group=args.samples_per_group, seed=args.seed)
    out = {"files": [str(f) for f in files], "dp_size": args.dp, "samples_per_group": args.samples_per_group}
    if args.video_only:
        return video_part(args, stats, cfg, out)
    out["real"] = bench_one("real stats", stats.vit, stats.tokens, cfg)
    big = resample(stats, args.resample, args.seed)
    out["resampled"] = bench_one(f"resampled to {args.resample}", big.vit, big.tokens, cfg)
    checks = {}
    for key in ("real", "resampled"):
        m = out[key]["isf"]
        checks[f"{key}: dist_llm<=0.02"] = m["dist_ratio_llm"] <= 0.02
        checks[f"{key}: dist_vit<=0.02"] = m["dist_ratio_vit"] <= 0.02
        checks[f"{key}: fill_llm>=0.95"] = m["fill_llm"] >= 0.95
    if not args.no_qwen:
        spec, device = get_preset(args.qwen_model), get_device(args.qwen_device)
        rule = native_rule(spec, args)
        derived = derive_native_stats(stats, seed=args.seed, **rule)
        out["qwen_published"] = bench_native(f"{spec.name}, published stats with drawn sizes", derived, spec, device,
                                             cfg)
        if args.scan_images:
            sizes = scan_image_sizes(args.scan_images)
            if not sizes:
                print(f"no image files under {args.scan_images}", file=sys.stderr)
                return 1
            scanned = scanned_stats(sizes, stats, args.scan_samples, args.seed, rule)
            out["qwen_scanned"] = bench_native(f"{spec.name}, {len(sizes)} scanned image files", scanned, spec,
                                               device, cfg)
            out["qwen_scanned"]["images"] = {"files": len(sizes), "dirs": args.scan_images,
                                             "width_median": float(np.median([s[0] for s in sizes])),
                                             "height_median": float(np.median([s[1] for s in sizes]))}
        for key in ("qwen_published", "qwen_scanned"):
            if key in out:
                add_time_checks(checks, key, out[key])
    if args.video_mix:
        video_part(args, stats, cfg, out, checks)
    s = out["resampled"]["seconds"]
    checks["1.2M search+grouping <= 3 s (cpu)"] = s["total_cpu"] <= 3.0
    checks["1.2M search+grouping <= 3 s (wall)"] = s["total_wall"] <= 3.0
    return finish(args, out, checks)


def add_time_checks(checks: dict, key: str, result: dict) -> None:
    """The targets of a native-resolution part ``result`` (``bench_native``'s) into ``checks``: ISF in time's
    DistRatio of ViT and LLM time at most 0.01."""
    m = result["rows"]["isf-time"]
    checks[f"{key}: isf-time dist_vit_time<=0.01"] = m["dist_ratio_vit_time"] <= 0.01
    checks[f"{key}: isf-time dist_llm_time<=0.01"] = m["dist_ratio_llm_time"] <= 0.01


def finish(args, out: dict, checks: dict) -> int:
    """``checks`` into ``out["targets"]``, printed PASS / FAIL; ``out`` written to ``--json``."""
    out["targets"] = checks
    print("\ntargets:")
    for k, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {k}")
    if args.json:
        bl.write_json(args.json, out)
    return 0


def video_part(args, stats: SampleStats, cfg: SearchConfig, out: dict, checks: dict | None = None) -> int:
    """The video and image mix (module docstring) into ``out["qwen_video_mix"]``, its targets into ``checks``;
    alone (``checks`` None): its targets printed, the JSON written."""
    alone = checks is None
    checks = {} if alone else checks
    spec, device = get_preset(args.qwen_model), get_device(args.qwen_device)
    rule = native_rule(spec, args)
    derived = derive_native_stats(stats, seed=args.seed, **rule)
    n = args.video_mix or 40_000
    mix = video_mix_stats(derived, stats, n, args.video_share, args.seed, spec, args.video_fps,
                          args.video_max_frames, args.video_max_pixels)
    v = mix.videos
    res = bench_native(f"{spec.name}, video and image mix ({len(v.patches)} videos, LLaVA-Video-178K durations)",
                       mix, spec, device, cfg)
    res["videos"] = {"count": int(len(v.patches)), "share": args.video_share, "frames_mean": float(v.frames.mean()),
                     "frames_max": int(v.frames.max()), "patches_mean": float(v.patches.mean()),
                     "patches_max": int(v.patches.max()), "temporal_mean": float(v.temporal.mean()),
                     "fps": args.video_fps, "max_frames": args.video_max_frames, "max_pixels": args.video_max_pixels,
                     "durations": {f"{a}-{b} s": w for (a, b), w in LLAVA_VIDEO_BUCKETS.items()},
                     "durations_source": "lmms-lab/LLaVA-Video-178K dataset viewer: rows per subset (thousands)",
                     "sizes_stated": {f"{w}x{h}": p for (w, h), p in VIDEO_SIZES.items()}}
    res["date"] = BENCH_DATE
    out["qwen_video_mix"] = res
    add_time_checks(checks, "qwen_video_mix", res)
    return finish(args, out, checks) if alone else 0


if __name__ == "__main__":
    sys.exit(main())
