"""Balancing with videos (issue 27, item 6): stats carry each video (a scan of real H.264 files, the --video-*
flags applied as the family's rule does), ViT time per temporal patch against brute-force segments and the cost
model, CP runs by predicted time against brute force, the over-budget refusal, plans on video stats and the step
bound a single video sets."""
from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

av = pytest.importorskip("av")

from megatron.vlm.data import RecordDataset, TileImages  # noqa: E402
from megatron.vlm.data.tokenizer import build_tokenizer  # noqa: E402
from megatron.vlm.data.video_sampling import VideoOverrides  # noqa: E402
from megatron.vlm.lineages.qwen import video as qwen_video  # noqa: E402
from omnibal_ext.data.stats import load_stats  # noqa: E402
from omnibal_ext.model.cost_model import DEVICES, analytic_costs  # noqa: E402
from omnibal_ext.model.sample_time import VISION_CODES, sample_times, sample_work, time_coefficients  # noqa: E402
from omnibal_ext.model.shape import MicroBatchShape  # noqa: E402
from omnibal_ext.model.units import get_preset  # noqa: E402
from video_media import write_media  # noqa: E402

TOK = build_tokenizer(None)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """``video_media.write_media``'s folder."""
    return write_media(tmp_path_factory.mktemp("video_balance"))


def test_isf_stats_write_carries_videos_with_the_video_flags(media, tmp_path, capsys):
    """`omnibal isf stats --write` on InternVL (frames as tiles): --video-max-frames 4 samples 4 frames of each
    video (its rule: the flag alone lowers the minimum), one tile and one temporal segment each; images apart; an
    old stats file (no videos) still loads and concatenates as video-free; a flag the rule refuses is refused."""
    from omnibal_cli import build_parser
    from omnibal_ext.cli import run

    out = tmp_path / "s.json"
    assert run(build_parser(), ["isf", "stats", "--stats", str(media / "d.jsonl"), "--write", str(out),
                                "--model", "internvl3-1b", "--video-max-frames", "4"]) == 0
    recs = json.loads(out.read_text())
    assert [r["videos"] for r in recs] == [[{"frames": 4, "width": 96, "height": 64, "patches": 4, "temporal": 4}],
                                           [{"frames": 4, "width": 64, "height": 48, "patches": 4, "temporal": 4}],
                                           []]
    assert [[(i["width"], i["height"]) for i in r["images"]] for r in recs] == [[], [(60, 40)], [(60, 40)]]
    tiles = recs[2]["images"][0]["tiles"]
    assert [r["vit_num"] for r in recs] == [4, tiles + 4, tiles]
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"vit_num": 2, "token_num": 10, "images": []}]))  # no "videos"
    assert load_stats([old]).videos is None
    both = load_stats([out, old])
    assert both.videos.offsets.tolist() == [0, 1, 2, 2, 2] and both.videos.frames.tolist() == [4, 4]
    assert run(build_parser(), ["isf", "stats", "--stats", str(media / "d.jsonl"), "--write", str(out),
                                "--model", "internvl3-1b", "--video-fps", "1"]) == 1
    assert "--video-fps" in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class QwenOneBlock(qwen_video.QwenFrames):
    """A Qwen2-VL video rule with one image block per video (its merged tokens' patches) and one placeholder: the
    reader's side of a Qwen video, enough for stats (the family's own reading is another part's)."""

    def blocks(self, num_frames, width, height, where=None):
        t, gh, gw = qwen_video.video_grid_thw(num_frames, height, width, self.settings, where)
        return [t * gh * gw]

    def text(self, indices, src_fps):
        return "<image>"


def qwen_dataset(media, **flags):
    from megatron.vlm.lineages.qwen.data import PatchImages

    rule = QwenOneBlock(qwen_video.settings(None, VideoOverrides(**flags)))
    return RecordDataset(str(media / "d.jsonl"), TOK, PatchImages(), 4096, videos=rule)


def segments_brute_force(t: int, rows: int, cols: int, side: int) -> tuple[list[int], list[int]]:
    """The ViT's attention segments of a video of t x rows x cols patches, as the Qwen ViTs make them: one
    full-attention segment per temporal patch (transformers' cu_seqlens: rows*cols repeated t times) and, per
    temporal slice, windows of side x side patches from the top left (ragged at the edges)."""
    full = [rows * cols] * t
    windows = [min(side, rows - r) * min(side, cols - c)
               for _ in range(t) for r in range(0, rows, side) for c in range(0, cols, side)]
    return full, windows


@pytest.mark.parametrize("model", ["qwen2.5-vl-7b", "qwen3-vl-8b"])
def test_qwen_video_time_is_per_temporal_patch(media, model):
    """Qwen2-VL's rule at --video-fps 2: v.mp4 (2 s) gives 4 frames, w.mp4 (3 s) 6 (floored to the temporal patch
    2: 2 and 3 temporal patches); each frame smart_resized from its size (64 x 96 -> 280 x 392 px at the
    default min_pixels: 20 x 28 patches). The stats hold them; each sample's ViT time equals the cost model of
    the brute-force segments (full attention per temporal patch, windows per slice), not one segment per video."""
    ds = qwen_dataset(media, fps=2.0)
    stats = ds.sample_stats()
    v = stats.videos
    assert v.offsets.tolist() == [0, 1, 2, 2] and v.frames.tolist() == [4, 6] and v.temporal.tolist() == [2, 3]
    # smart_resize by hand: area below min_pixels 128*28*28 -> scaled up, each side ceil'd to 28 px
    grids = []
    for w, h in ((96, 64), (64, 48)):
        beta = np.sqrt(128 * 28 * 28 / (w * h))
        grids.append((int(np.ceil(h * beta / 28)) * 2, int(np.ceil(w * beta / 28)) * 2))
    assert v.patches.tolist() == [2 * grids[0][0] * grids[0][1], 3 * grids[1][0] * grids[1][1]]
    assert stats.vit.tolist() == (stats.images.per_sample(stats.images.patches) + v.per_sample(v.patches)).tolist()
    spec = get_preset(model)
    device = DEVICES["h200-141g"]
    work = sample_work(stats, spec, ds.image_grids())
    vit, _ = sample_times(work, time_coefficients(spec, device))
    side = spec.vision.window_patches_side if model.startswith("qwen2.5") else None
    image_grid = ds.image_grids()
    for i in range(len(stats)):
        full, windows = [], []
        if i < 2:
            f, w = segments_brute_force(int(v.temporal[i]), *grids[i], side or 10 ** 9)
            full, windows = full + f, windows + w
        for k in range(stats.images.offsets[i], stats.images.offsets[i + 1]):
            f, w = segments_brute_force(1, int(image_grid[0][k]), int(image_grid[1][k]), side or 10 ** 9)
            full, windows = full + f, windows + w
        shape = MicroBatchShape(int(stats.vit[i]), int(stats.tokens[i]), llm_attn_tokens_sq=float(stats.tokens[i]) ** 2,
                                vision_attn_tokens_sq=float(sum(s * s for s in full)),
                                vision_window_tokens_sq=float(sum(s * s for s in windows)))
        costs = analytic_costs(spec, shape, 1, device, attention="flash")
        assert vit[i] == pytest.approx(sum(u.fwd_s + u.bwd_s for u in costs.units if u.code in VISION_CODES),
                                       rel=1e-9)
    # one segment per video would cost more: the model attends per temporal patch
    assert work.vit_full_sq[0] == pytest.approx(2 * (grids[0][0] * grids[0][1]) ** 2)
    assert work.vit_full_sq[0] < float(v.patches[0]) ** 2


def test_cp_runs_balance_predicted_time_videos_whole():
    """CP runs of whole images and videos: each item's time (``grid_vit_time_units``) equals the cost model of its
    brute-force segments, and the runs' largest time is the best contiguous cut (brute force); a long video of few
    patches per frame and a large image of equal patches weigh differently in time."""
    from omnibal_ext.model.cp_split import image_runs
    from omnibal_ext.model.sample_time import TIME_UNIT_S, grid_vit_time_units

    spec = get_preset("qwen2.5-vl-7b")
    device = DEVICES["h200-141g"]
    grids = [(1, 40, 48), (8, 12, 20), (1, 12, 20), (4, 24, 24), (1, 64, 60)]
    times = grid_vit_time_units(spec, grids, device)
    for (t, r, c), got in zip(grids, times):
        full, windows = segments_brute_force(t, r, c, spec.vision.window_patches_side)
        shape = MicroBatchShape(t * r * c, 0, vision_attn_tokens_sq=float(sum(s * s for s in full)),
                                vision_window_tokens_sq=float(sum(s * s for s in windows)))
        costs = analytic_costs(spec, shape, 1, device, attention="flash")
        want = sum(u.fwd_s + u.bwd_s for u in costs.units if u.code in VISION_CODES) / TIME_UNIT_S
        assert got == pytest.approx(want, rel=1e-6)
    # (8, 12, 20) has the patches of (1, 40, 48) (1920 each) but a fraction of its full-attention work
    assert times[1] < times[0]
    for cp in (2, 3):
        runs = image_runs(times, cp)
        assert [i for r in runs for i in r] == list(range(len(grids)))
        best = min(max(int(times[a:e].sum()) for a, e in zip((0,) + cut, cut + (len(grids),)))
                   for cut in itertools.combinations_with_replacement(range(len(grids) + 1), cp - 1))
        assert max(int(times[r.start:r.stop].sum()) for r in runs) == best


def test_a_video_over_a_cp_rank_budget_is_refused_with_flags_that_fit(media):
    """--omnibal-isf-qv 1600 at CP 2 gives each rank 800 patches; at --video-fps 2 v.mp4 has 2 and w.mp4 3 temporal
    patches of 560: refused naming the largest's file:line and the flags; the --video-max-frames it names, applied
    by the rule, fits."""
    from megatron.training.flags import ArgumentError
    from megatron.training.isf import check_videos_fit_cp_ranks

    spec = get_preset("qwen2.5-vl-7b")
    ds = qwen_dataset(media, fps=2.0)
    check_videos_fit_cp_ranks(1, spec, ds, 1600)
    with pytest.raises(ArgumentError) as e:
        check_videos_fit_cp_ranks(2, spec, ds, 1600)
    msg = str(e.value)
    assert f"{media / 'd.jsonl'}:2: a video of 6 frames" in msg and "800 patches" in msg
    assert "--video-max-frames 2" in msg
    assert "--video-max-pixels" not in msg  # 400 patches a frame is below the rule's min_pixels
    fitted = qwen_dataset(media, fps=2.0, max_frames=2).sample_stats().videos
    assert fitted.patches.max() <= 800
    check_videos_fit_cp_ranks(2, spec, qwen_dataset(media, fps=2.0, max_frames=2), 1600)


def video_mix_records(n=120, seed=0):
    """Stats records of a video and image mix: every third sample one video of 2-16 temporal patches of 8-22 x
    8-30 patches, the others one image of 8-58 x 8-58 patches; tokens its merged patches plus 50-600 text."""
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        if i % 3 == 0:
            t, gh, gw = int(rng.integers(2, 17)), 2 * int(rng.integers(4, 12)), 2 * int(rng.integers(4, 16))
            videos = [{"frames": 2 * t, "width": gw * 14, "height": gh * 14, "patches": t * gh * gw, "temporal": t}]
            images = []
        else:
            gh, gw = 2 * int(rng.integers(4, 30)), 2 * int(rng.integers(4, 30))
            images, videos = [{"width": gw * 14, "height": gh * 14, "patches": gh * gw}], []
        p = sum(x["patches"] for x in videos + images)
        recs.append({"vit_num": p, "token_num": p // 4 + int(rng.integers(50, 600)), "images": images,
                     "videos": videos})
    return recs


def test_plan_takes_video_stats(tmp_path):
    """The plan's ViT segments per item (``vision_segments``: its micro-batch shapes and memory) count a video per
    temporal patch (brute force over the records); `omnibal plan` on a stats file with videos plans ISF in time with
    a ViT cap that holds the largest video."""
    from omnibal_cli import build_parser
    from omnibal_ext.cli import run
    from omnibal_ext.model.sample_time import vision_segments

    recs = video_mix_records()
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(recs))
    spec = get_preset("qwen2.5-vl-7b")
    side = spec.vision.window_patches_side
    full_sum = window_sum = items = 0
    full_max = window_max = 0.0
    for r in recs:
        for m in r["images"] + r["videos"]:
            t = m.get("temporal", 1)
            full, windows = segments_brute_force(t, m["height"] // 14, m["width"] // 14, side)
            f, w = sum(s * s for s in full), sum(s * s for s in windows)
            full_sum, window_sum, items = full_sum + f, window_sum + w, items + m["patches"]
            full_max, window_max = max(full_max, f / m["patches"]), max(window_max, w / m["patches"])
    seg = vision_segments(load_stats([path]), spec)
    assert (seg.mean_full, seg.mean_window) == pytest.approx((full_sum / items, window_sum / items), rel=1e-12)
    assert (seg.max_full, seg.max_window) == pytest.approx((full_max, window_max), rel=1e-12)
    out = tmp_path / "plan.json"
    assert run(build_parser(), ["plan", "--data", str(path), "--model", "qwen2.5-vl-7b", "--gpus", "8", "--gpu-memory",
                                "141", "--device", "h200-141g", "--tp", "1", "--pp", "1", "--sim-iterations", "2",
                                "--json",
                                str(out)]) == 0
    flags = json.loads(out.read_text())["trainer_flags"]
    assert flags["--omnibal-isf-qv"] >= max(m["patches"] for r in recs for m in r["videos"])
    assert "--omnibal-isf-vit-time" in flags


def test_a_video_over_the_mean_rank_load_sets_the_bound(tmp_path, capsys):
    """`omnibal isf search --model` on a video mix with one very long video: the JSON's ``bound`` names it, its
    time over the mean group time, and the step bound equals the DistRatio of its step with every other rank at
    the mean (closed form: ``metrics.dist_ratio_one``); without it no sample sets a bound."""
    from omnibal_ext.data.metrics import dist_ratio_one
    from omnibal_ext.cli import run
    from omnibal_cli import build_parser

    recs = video_mix_records(240)
    doc = {}
    for name, extra in (("plain", []), ("long", [{"frames": 256, "width": 448, "height": 336, "temporal": 128,
                                                   "patches": 128 * 24 * 32}])):
        data = [dict(r) for r in recs]
        if extra:
            data[7] = {"vit_num": extra[0]["patches"], "token_num": extra[0]["patches"] // 4 + 100, "images": [],
                       "videos": extra}
        path, out = tmp_path / f"{name}.json", tmp_path / f"{name}_out.json"
        path.write_text(json.dumps(data))
        assert run(build_parser(), ["isf", "search", "--stats", str(path), "--model", "qwen2.5-vl-7b", "--dp", "4",
                                    "--samples-per-group", "4", "--json", str(out)]) == 0
        doc[name] = json.loads(out.read_text())
    assert doc["plain"]["bound"] is None
    b = doc["long"]["bound"]
    assert b["sample"] == 7 and b["time"] > b["mean_rank_load"] and b["ratio"] == pytest.approx(b["time"] /
                                                                                                  b["mean_rank_load"])
    assert b["step_dist_ratio_bound"] == pytest.approx(dist_ratio_one([b["time"]] + [b["mean_rank_load"]] * 3))
    assert "sample 7 takes" in capsys.readouterr().out
