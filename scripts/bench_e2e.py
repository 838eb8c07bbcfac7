#!/usr/bin/env python
"""End-to-end benchmark of the three OmniBal levels, measured on this machine, side by side.

The fixed heterogeneous tiny VLM of scripts/benchlib.py (ViT layers heavier than LLM layers) is trained
with PP=2 on CPU on the stats-matched synthetic data (megatron/vlm/data/synthetic.py: per-sample tiles
and text lengths drawn from the InternVL SFT stats files in data/omnibal_stats/), four ways:

=========  ===============================  ===================  ===================================
row        batching                         pipeline layout      recompute
=========  ===============================  ===================  ===================================
baseline   random, K samples padded         Megatron default     full, every layer
+data      ISF packed groups (--omnibal-isf) Megatron default     full, every layer
+model     ISF                              searched (auto)      full, every layer
+memory    ISF                              searched (auto)      adaptive at budget B (auto)
=========  ===============================  ===================  ===================================

Same work in every row: each run trains exactly ONE EPOCH of the same N samples (so every row sees
the same samples and the same total tokens; ``tokens_seen`` checks it from the logs).  Random
batching makes N/K micro-batches, ISF makes G groups of varying size, so N is chosen (from
``--samples`` upward, in steps of m*K*DP) such that both N/K and G are multiples of m*DP: the
baseline then runs N/(m K DP) iterations and the ISF rows G/(m DP), each consuming every sample
once.  ms/iteration is therefore NOT comparable across rows (an ISF iteration holds a different
number of samples); the speed-up is the ratio of samples/s (steady state: samples over time of the
iterations after the warm-up), which over the same sample set equals the ratio of epoch times.
The machine is shared and noisy: after the first pass the four rows run ``--repeats`` - 1 more
times, alternating, and each row's speed pools the steady iterations of all its runs.

Memory budget B (the same for every row): the device the paper's premise describes, one on which the
Megatron default cannot train without recomputation.  The baseline's epoch is also run once without
recompute (``budget_reference``, not a row) and B = 0.9 x its measured peak (static + activations,
busiest stage).  The rows with full recompute fit B (checked); +memory plans the least recompute
that fits it, and its measured peak is checked against B.  If the planner finds no plan for the
searched layout at B, B is raised to the planner's least need and the JSON says so.

Prediction per row (``predicted_ms_per_iter``): the 1F1B simulator (omnibal_ext.model.simulate) with
the row's layout and recompute, unit costs from the profile the +model run measures (the trainer's
profiler, at the ISF caps) calibrated to the row's mean measured micro-batch shape
(omnibal_ext.model.cost_model.calibrated_costs: per-kind seconds per FLOP from the profile, FLOPs at
the shape), m micro-batches.

``--model qwen2.5-vl``: the same four rows on the tiny Qwen2.5-VL (``qwen2.5-vl-tiny``: 4 ViT layers, full
attention at 1 and 3, 56 px windows; 4 LLM layers) with the same stats-matched samples, each tile a 56 px image
(4 x 4 patches, one window, 4 merged LLM tokens, as the hetero model's 4 per tile): its ViT items are patches
(16 per image), the predicted shapes' ViT segments one image (= one window) each.

``--model qwen3-vl``: the same on the tiny Qwen3-VL (``qwen3-vl-tiny``: 4 ViT layers with DeepStack at 0 and 3, 4 LLM
layers), each tile a 64 px image kept at 64 px (``--min-pixels``/``--max-pixels`` 4096): 4 x 4 patches of 16 px, 4
merged LLM tokens, one full-attention segment per image; the DeepStack features travel with the activations
wherever the searched layout cuts.

``--model qwen3.5``: the same images on the tiny Qwen3.5 (``qwen3.5-tiny``: Qwen3-VL's ViT without DeepStack, 2
layers; a hybrid LLM of 6 layers, Gated DeltaNet (linear attention) at 0, 2, 3, 5 and gated full attention at 1, 4):
the searched layout places three layer kinds.

ISF groups: the bench counts them as the trainer's ISF does (``isf_group_count``): by counts for the tiled family,
in predicted time for the native-resolution ones (Qwen), and checks each ISF run's own group count against it.
Self-checks against noise: "each level adds speed" allows a row to be slower than the one before by the larger of
``LEVEL_TOLERANCE`` and the two rows' run-to-run spread, and says NOISY (neither PASS nor FAIL) when a row's runs
spread by more than ``NOISE_LIMIT``.

``--model qwen2.5-vl --videos``: the same four rows on a mix of H.264 videos and images
(``benchlib.write_video_mix``): the stats-matched samples, a seeded quarter of them holding one video instead of
their images (a pool of 24 written with PyAV: 64 x 48 to 112 x 84 px, 1-8 s, 6-30 fps), read at 1 frame per second,
2 to 6 frames (``benchlib.VIDEO_FLAGS``; the processor enlarges each frame to its 128 x 28 x 28 px minimum: 560
patches per temporal patch, 35x a 56 px image).  The samples' tokens, ViT items and ISF groups are the trainer's own
(``benchlib.trainer_isf_data``: its scan and ISF plan, in predicted time), and the predicted shapes count a video's
ViT segments per temporal patch (``omnibal_ext.model.sample_time.sample_work``).

On a 2-core machine keep PP=2 x DP=1 (one core per stage): more processes than cores time-share the
cores and hide pipeline imbalance; --dp/--tp are for bigger machines.

Outputs (``--out`` folder): e2e.json (also ``--json``), e2e.png (bar chart), the runs' logs.

Usage: python scripts/bench_e2e.py [--model internvl|qwen2.5-vl|qwen3-vl|qwen3.5] [--videos] [--json OUT] [--out DIR] [--quick] [--repeats 2]
       [--samples N --micro-batches m]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

GIB = 2**30
ROWS = ("baseline", "+data", "+model", "+memory")
BUDGET_FRACTION = 0.9  # of the baseline's measured peak without recompute
LEVEL_TOLERANCE = 0.03  # a level "adds speed" when its row is at most this much slower (or the rows' run spread)
NOISE_LIMIT = 0.15  # a row whose runs spread more than this (max - min over median samples/s) judges nothing


@dataclass(frozen=True)
class BenchModel:
    """A benchmarked model: its trainer flags, the side in px of the data's square images (one per stats tile),
    LLM tokens and ViT items (the family's unit: tiles, patches) per such image, and the ViT tokens of one
    image's attention segment (None: the family's fixed tiles, which the cost model sizes itself); its chart title.
    """

    flags: dict
    title: str
    image_px: int
    tokens_per_image: int
    items_per_image: int = 1
    segment_tokens: int | None = None


MODELS = {
    "internvl": BenchModel(bl.HETERO_MODEL, "tiny heterogeneous VLM", image_px=32, tokens_per_image=4),
    "qwen2.5-vl": BenchModel({"--model": "qwen2.5-vl-tiny"}, "tiny Qwen2.5-VL", image_px=56, tokens_per_image=4, items_per_image=16,
                             segment_tokens=16),
    # 64 px images kept at 64 px (the published budget would enlarge them to 256 x 256): 4 x 4 patches of 16 px
    "qwen3-vl": BenchModel({"--model": "qwen3-vl-tiny", "--min-pixels": 4096, "--max-pixels": 4096}, "tiny Qwen3-VL",
                           image_px=64, tokens_per_image=4, items_per_image=16, segment_tokens=16),
    # the same images on the hybrid LLM: 6 layers, linear (Gated DeltaNet) and full attention mixed
    "qwen3.5": BenchModel({"--model": "qwen3.5-tiny", "--min-pixels": 4096, "--max-pixels": 4096}, "tiny Qwen3.5",
                          image_px=64, tokens_per_image=4, items_per_image=16, segment_tokens=16),
}


def spec_of(model: BenchModel):
    """The ModelSpec of ``model``'s flags (the trainer's own flag handling)."""
    from megatron.training.flags import build_parser
    from megatron.training.specs import model_spec_from_flags

    return model_spec_from_flags(build_parser().parse_args(bl.trainer_argv(model.flags)))


def isf_group_count(spec, model: BenchModel, tokens: np.ndarray, images: np.ndarray, dp: int, k: int, tp: int,
                    seed: int) -> int:
    """Groups the trainer's ISF makes of samples of ``tokens`` LLM tokens and ``images`` square images each
    (megatron/training/isf.py ``search_isf`` with no caps given): by counts for a family whose ViT items cost alike,
    else in predicted time (``isf_sample_times`` on the trainer's default --omnibal-isf-time-device at TP ``tp``;
    each image ``items_per_image`` patches in a square grid, as the image rule keeps the bench's images)."""
    import math

    from omnibal_ext.data.search import SearchConfig, run_isf
    from omnibal_ext.data.search_time import run_isf_in_time
    from omnibal_ext.data.stats import ImageStats, SampleStats
    from omnibal_ext.model.cost_model import get_device
    from omnibal_ext.model.sample_time import ISF_TIME_DEVICE, isf_sample_times

    images = np.asarray(images, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    cfg = SearchConfig(dp_size=dp, samples_per_group=k, seed=seed, time_budget_s=math.inf)
    n_img = int(images.sum())
    offsets = np.concatenate([[0], np.cumsum(images)]).astype(np.int64)
    px = np.full(n_img, model.image_px, dtype=np.int64)
    stats = SampleStats(images * model.items_per_image, tokens, np.zeros(len(tokens), dtype=np.int32), [],
                        ImageStats(offsets, px, px, np.full(n_img, model.items_per_image, dtype=np.int64)))
    side = math.isqrt(model.items_per_image)
    grid = np.full(n_img, side, dtype=np.int64)
    timed = isf_sample_times(stats, spec, get_device(ISF_TIME_DEVICE), tp=tp,
                             grids=(grid, grid) if side * side == model.items_per_image else None)
    if timed is None:
        return len(run_isf(stats.vit, tokens, cfg).grouping)
    return len(run_isf_in_time(timed[0], tokens, timed[1], cfg).grouping)


def choose_samples(args, model: BenchModel, spec, dp: int, k: int, m: int) -> tuple[object, int, int]:
    """(dataset, N, ISF groups): the smallest N >= --samples with N/K and G multiples of m*DP, G counted as the
    trainer's ISF counts it (``isf_group_count``; the runs' ISF lines are checked against it)."""
    from megatron.vlm.data.synthetic import LengthRule, sample_plan

    rule = LengthRule(tokens_per_tile_model=model.tokens_per_image, max_tokens=bl.MAX_SAMPLE_TOKENS)
    files = bl.stats_files(args.stats_dir)
    step = m * k * dp
    n = -(-args.samples // step) * step
    for _ in range(200):
        plan = sample_plan(files, n, rule, args.data_seed)
        g = isf_group_count(spec, model, plan["tokens"], rule.tiles(plan["vit_num"]), dp, k, args.tp, args.seed)
        if g % (m * dp) == 0:
            data = bl.build_data(os.path.join(args.out, "data"), n, model.image_px, model.tokens_per_image,
                                 args.stats_dir, args.data_seed)
            return data, n, g
        n += step
    raise RuntimeError(f"no dataset size from {args.samples} on gives ISF groups divisible by {m * dp}")


def choose_video_samples(args, model: BenchModel, trainer_flags: dict, world: int, dp: int, k: int,
                         m: int) -> tuple[object, int, int]:
    """``choose_samples`` for ``--videos``: the video and image mix (``benchlib.write_video_mix``), its tokens,
    ViT items, ISF groups and ViT segment sums as the trainer's scan and ISF plan find them
    (``benchlib.trainer_isf_data``; ``trainer_flags``: the run's flags but the data)."""
    step = m * k * dp
    n = -(-args.samples // step) * step
    for _ in range(20):
        path = bl.write_video_mix(os.path.join(args.out, "data"), n, model.image_px, args.stats_dir, args.data_seed)
        flags = bl.trainer_argv({**trainer_flags, "--data-path": path, "--seq-length": bl.VIDEO_SEQ_LENGTH})
        tokens, items, g, sums = bl.trainer_isf_data(flags + ["--omnibal-isf"], world)
        if g % (m * dp) == 0:
            seq = int(-(-int(tokens.max()) // 64) * 64)
            info = {"kind": "video and image mix (H.264, PyAV)", "video_flags": bl.VIDEO_FLAGS, **sums,
                    "tokens_mean": float(tokens.mean()), "tokens_max": int(tokens.max()),
                    "tiles_mean": float(items.mean()), "vit_items_max": int(items.max())}
            return bl.DataSet(path, n, tokens, items, seq, info), n, g
        n += step
    raise RuntimeError(f"no dataset size from {args.samples} on gives ISF groups divisible by {m * dp}")


def mean_shape(summary: dict, m: int, dp: int, k: int, padded: bool, packed_sq: float,
               segment_tokens: int | None = None, vit_sq: tuple[float, float] | None = None):
    """Mean micro-batch (ViT items, LLM tokens as computed, sum of squared lengths) of a run.

    packed_sq: mean sum of squared sample lengths of a packed micro-batch (tokens^2); segment_tokens: ViT
    tokens per attention segment (image and window alike; None: the family's tiles); vit_sq: the micro-batch's
    mean (full-attention, window) sums of squared segment lengths (patches^2) instead (videos: per temporal patch)."""
    from omnibal_ext.model.cost_model import MicroBatchShape

    per_mb = m * dp
    tiles = summary["tiles_per_iter"] / per_mb
    real = summary["tokens_per_iter"] / per_mb
    if padded:  # K rows padded to the longest: tokens = K * longest, attention K * longest^2
        pad = summary["pad_ratio"] or 0.0
        tokens = real / max(1e-9, 1.0 - pad)
        sq = tokens * tokens / k
    else:  # one packed row; the trainer attends within each sample
        tokens = real
        sq = packed_sq
    items = max(1, int(round(tiles)))
    if vit_sq is None:
        full = window = None if segment_tokens is None else float(items * segment_tokens)
    else:
        full, window = vit_sq
    return MicroBatchShape(items, max(1, int(round(tokens))), dtype_bytes=4,
                           llm_attn_tokens_sq=float(min(sq, round(tokens) ** 2)),
                           vision_attn_tokens_sq=full, vision_window_tokens_sq=window)


def predict(profile_path, spec_dict, layout, shape, pp, m, tp, modes_fn) -> float:
    from omnibal_ext.model.cost_model import calibrated_costs, get_device
    from omnibal_ext.model.costs import CostTable
    from omnibal_ext.model.simulate import simulate_layout
    from omnibal_ext.model.units import spec_from_dict

    prof = CostTable.load(profile_path)
    spec = spec_from_dict(spec_dict)
    costs = calibrated_costs(spec, shape, prof, tp)
    sim = simulate_layout(costs, layout, pp, m, get_device("cpu").p2p_bytes_per_s, modes_fn(costs))
    return sim.iteration_s * 1e3


def stage_totals(memory: dict) -> list[float]:
    """Static + peak activation bytes per pipeline stage of a run's memory record."""
    return [a + s for a, s in zip(memory["peak_act_bytes_per_stage"], memory["static_bytes_per_stage"])]


def plot(rows: list[dict], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    meas = [r["samples_per_s"] for r in rows]
    pred = [r.get("predicted_samples_per_s") or 0 for r in rows]
    axes[0].bar(x - 0.2, meas, 0.4, label="measured")
    axes[0].bar(x + 0.2, pred, 0.4, label="predicted")
    axes[0].set_xticks(x, names)
    axes[0].set_ylabel("samples / s")
    axes[0].legend()
    axes[1].bar(x, [r["speedup"] for r in rows], color="tab:green")
    for i, r in enumerate(rows):
        axes[1].text(i, r["speedup"], f"{r['speedup']:.2f}x", ha="center", va="bottom")
    axes[1].set_xticks(x, names)
    axes[1].set_ylabel("speed-up over baseline (samples/s)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def repeat_rows(first: dict, flags: dict, repeats: int, out: str, world: int,
                warmup: int) -> dict[str, list]:
    """Every row's runs: its first-pass run ``first[name]``, then ``repeats`` - 1 more with the same flags,
    the rows alternating (benchlib.alternate_runs).  The profile exists by then, so a repeat must run the
    first run's layout and recompute plan (RuntimeError otherwise)."""
    runs = {name: [first[name]] for name in ROWS}
    if repeats > 1:
        more = bl.alternate_runs({name: flags[name] for name in ROWS}, repeats - 1, out, "e2e_rep",
                                 nproc=world, warmup=warmup)
        for name in ROWS:
            for r in more[name]:
                if (r.layout_flag, r.recompute_flag) != (first[name].layout_flag, first[name].recompute_flag):
                    raise RuntimeError(f"{name}: a repeat ran layout {r.layout_flag} / plan {r.recompute_flag}, "
                                       f"the first run {first[name].layout_flag} / {first[name].recompute_flag}")
            runs[name] += more[name]
    return runs


def run_spread(per_run: list[float]) -> float | None:
    """(max - min) / median of a row's samples/s over its runs: the machine's noise on it (None: one run)."""
    if len(per_run) < 2:
        return None
    return float((max(per_run) - min(per_run)) / np.median(per_run))


def level_check(before: dict, after: dict) -> str:
    """The self-check that row ``after`` adds speed over row ``before``, judged against measurement noise.

    Tolerance: the larger of ``LEVEL_TOLERANCE`` and either row's spread over its runs (``run_spread``).  PASS
    when ``after`` is at most that much slower, FAIL when it is slower by more; NOISY (neither) when a row's runs
    spread by more than ``NOISE_LIMIT`` (the machine's load changed too much to tell: rerun with more --repeats).
    """
    spreads = [r["run_spread"] for r in (before, after) if r["run_spread"] is not None]
    tol = max([LEVEL_TOLERANCE, *spreads])
    gain = after["samples_per_s"] / before["samples_per_s"]
    noise = ", ".join(f"{r['name']} {r['run_spread']:.1%}" for r in (before, after) if r["run_spread"] is not None)
    detail = (f"{after['name']} adds speed over {before['name']}: {gain:.3f}x (tolerance {tol:.1%}: the larger of "
              f"{LEVEL_TOLERANCE:.0%} and the rows' run-to-run spread{' ' + noise if noise else ', one run each'})")
    if tol > NOISE_LIMIT:
        return f"NOISY {detail}; a spread over {NOISE_LIMIT:.0%} decides nothing, rerun with more --repeats"
    verdict = "PASS" if gain >= 1.0 - tol else "FAIL"
    return f"{verdict} {detail}" + ("; slower within the noise" if verdict == "PASS" and gain < 1.0 else "")


def isf_groups_made(output: str) -> int | None:
    """The groups a run's ISF made (its "> ISF: N samples -> G groups" line), None without one."""
    import re

    m = re.search(r"> ISF: \d+ samples -> (\d+) groups", output)
    return int(m.group(1)) if m else None


def run(args) -> dict:
    from omnibal_ext.memory.memory_model import MemoryModelError
    from omnibal_ext.memory.recompute import MemoryBudgetError, parse_recompute_plan, plan_recompute
    from omnibal_ext.model.costs import CostTable
    from omnibal_ext.model.layout import parse_layout
    from omnibal_ext.plan import full_modes, stage_modes

    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    model = MODELS[args.model]
    spec = spec_of(model)
    pp, tp, dp, k, m = 2, args.tp, args.dp, args.micro_batch_size, args.micro_batches
    world = tp * pp * dp
    video_flags = {**bl.VIDEO_FLAGS, "--data-cache-dir": os.path.join(args.out, "cache")} if args.videos else {}
    if args.videos:
        data, n, groups = choose_video_samples(args, model, {**model.flags, **video_flags,
                                               "--pipeline-model-parallel-size": pp, "--tensor-model-parallel-size": tp,
                                               "--micro-batch-size": k, "--global-batch-size": k * m * dp,
                                               "--seed": args.seed}, world, dp, k, m)
    else:
        data, n, groups = choose_samples(args, model, spec, dp, k, m)
    iters = {"random": n // (m * k * dp), "isf": groups // (m * dp)}
    print(f"> {n} samples ({data.info['tokens_mean']:.0f} tokens, {data.info['tiles_mean']:.2f} tiles mean): "
          f"baseline {iters['random']} iterations of {m * k * dp} samples, ISF {groups} groups -> "
          f"{iters['isf']} iterations", flush=True)
    common = bl.trainer_argv({**model.flags, **video_flags, "--pipeline-model-parallel-size": pp,
                           "--tensor-model-parallel-size": tp, "--data-path": data.meta,
                           "--seq-length": data.seq_length, "--micro-batch-size": k,
                           "--global-batch-size": k * m * dp, "--seed": args.seed, "--lr-warmup-iters": 1})
    profile = os.path.join(args.out, "e2e_profile.json")
    if os.path.exists(profile):
        os.remove(profile)
    full = ["--recompute-granularity", "full", "--log-activation-memory"]
    isf = ["--omnibal-isf", "--train-iters", str(iters["isf"])]
    flags = {
        "baseline": common + ["--train-iters", str(iters["random"])] + full,
        "+data": common + isf + full,
        "+model": common + isf + ["--omnibal-partition", "auto", "--omnibal-profile", profile] + full,
    }
    flags["reference"] = common + ["--train-iters", str(iters["random"]), "--log-activation-memory"]
    results: dict[str, bl.RunResult] = {}  # the first pass: it writes the profile and sets the budget
    for name in ("baseline", "+data", "+model", "reference"):
        results[name] = bl.run_trainer(flags[name], args.out, f"e2e_{name.strip('+')}", nproc=world)
        print(f"  {name}: {bl.steady_ms(results[name].records, args.warmup):.0f} ms/iter, "
              f"layout {results[name].layout_flag}", flush=True)
    ref = stage_totals(results["reference"].memory)
    budget = BUDGET_FRACTION * max(ref)
    budget_note = (f"{BUDGET_FRACTION} x the baseline's measured peak without recompute "
                   f"{max(ref) / 2**20:.2f} MiB")
    costs = CostTable.load(profile)
    searched = parse_layout(results["+model"].layout_flag, spec, pp)
    prec, dist_opt = bl.planner_inputs()
    try:
        plan_recompute(costs, searched, budget, pp, tp, dp, m, distributed_optimizer=dist_opt, precision=prec)
    except (MemoryBudgetError, MemoryModelError) as e:
        least = getattr(e, "need_bytes", budget)
        budget = 1.01 * float(least)
        budget_note += f"; raised to the planner's least need x 1.01 ({e})"
    flags["+memory"] = (common + isf + ["--omnibal-partition", "auto", "--omnibal-profile", profile,
                                        "--omnibal-recompute", "auto", "--omnibal-memory-budget", repr(budget / GIB)])
    results["+memory"] = bl.run_trainer(flags["+memory"], args.out, "e2e_memory", nproc=world)
    print(f"  +memory: {bl.steady_ms(results['+memory'].records, args.warmup):.0f} ms/iter, plan "
          f"{results['+memory'].recompute_flag}", flush=True)

    runs = repeat_rows(results, flags, args.repeats, args.out, world, args.warmup)

    packed_sq = float((data.tokens.astype(float) ** 2).sum()) / groups  # mean sum(len^2) of an ISF group
    rows = []
    for name in ROWS:
        r = results[name]
        per_run = [bl.summarize(run.records, args.warmup) for run in runs[name]]
        s = {**per_run[0], **bl.pooled_rates(runs[name], args.warmup)}  # speed over every run of the row
        layout = parse_layout(r.layout_flag, spec, pp)
        if name == "+memory":
            stages = parse_recompute_plan(r.recompute_flag, pp)
            modes_fn = lambda c, layout=layout, stages=stages: stage_modes(c, layout, stages)  # noqa: E731
        else:
            modes_fn = full_modes
        micro_batches = n // k if name == "baseline" else groups  # in the epoch
        vit_sq = (data.info["vit_full_sq"] / micro_batches, data.info["vit_window_sq"] / micro_batches) \
            if args.videos else None
        shape = mean_shape(s, m, dp, k, padded=name == "baseline", packed_sq=packed_sq,
                           segment_tokens=model.segment_tokens, vit_sq=vit_sq)
        pred = predict(profile, costs.meta["spec"], layout, shape, pp, m, tp, modes_fn)
        mem = r.memory or {}
        rows.append({
            "name": name, "runs": s["runs"], "tokens_seen_per_run": [x["tokens_seen"] for x in per_run],
            "ms_per_iter": s["ms_per_iter"], "samples_per_s": s["samples_per_s"],
            "tokens_per_s": s["tokens_per_s"], "images_per_s": s["images_per_s"],
            "tokens_seen": s["tokens_seen"], "samples_seen": s["samples_seen"], "tiles_seen": s["tiles_seen"],
            "iterations": s["iterations"], "samples_per_iter": s["samples_per_iter"], "epoch_s": s["epoch_s"],
            "pad_ratio": s["pad_ratio"], "dist_ratio_llm": s["dist_ratio_llm"], "dist_ratio_vit": s["dist_ratio_vit"],
            "layout": r.layout_flag, "recompute": r.recompute_flag or "full",
            "peak_act_bytes_per_stage": mem.get("peak_act_bytes_per_stage"),
            "static_bytes_per_stage": mem.get("static_bytes_per_stage"),
            "predicted_peak_bytes_per_stage": mem.get("predicted_peak_bytes_per_stage"),
            "mean_microbatch_shape": shape.to_dict(),
            "predicted_ms_per_iter": pred, "predicted_samples_per_s": s["samples_per_iter"] / (pred / 1e3),
            "final_loss": s["final_loss"], "flags": flags[name],
        })
    base = rows[0]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        r["predicted_speedup"] = r["predicted_samples_per_s"] / base["predicted_samples_per_s"]
    seen = {t for r in rows for t in r["tokens_seen_per_run"]}
    out = {
        "model": dict(model.flags), "family": spec.family, "pp": pp, "tp": tp, "dp": dp, "micro_batches": m, "micro_batch_size": k,
        "samples": n, "isf_groups": groups, "iterations": iters, "warmup": args.warmup, "quick": args.quick,
        "data": {**data.info, "meta": data.meta, "tokens_total": int(data.tokens.sum())},
        "budget_bytes": budget, "budget_note": budget_note, "profile": profile, "rows": rows,
        "same_tokens_seen": len(seen) == 1 and seen == {int(data.tokens.sum())}, "videos": args.videos,
    }
    r_ref = results["reference"]
    s_ref = bl.summarize(r_ref.records, args.warmup)
    out["budget_reference"] = {"name": "baseline without recompute", "ms_per_iter": s_ref["ms_per_iter"],
                               "samples_per_s": s_ref["samples_per_s"], "tokens_seen": s_ref["tokens_seen"],
                               "peak_act_bytes_per_stage": r_ref.memory["peak_act_bytes_per_stage"],
                               "static_bytes_per_stage": r_ref.memory["static_bytes_per_stage"],
                               "total_bytes_per_stage": ref, "flags": flags["reference"]}
    peaks = {r["name"]: max(stage_totals(results[r["name"]].memory)) for r in rows}
    for r in rows:
        r["peak_total_bytes"] = peaks[r["name"]]
    for r in rows:
        r["samples_per_s_per_run"] = [bl.summarize(run.records, args.warmup)["samples_per_s"] for run in runs[r["name"]]]
        r["run_spread"] = run_spread(r["samples_per_s_per_run"])
    total = rows[-1]["speedup"]
    made = {name: isf_groups_made(results[name].output) for name in ROWS[1:]}
    out["targets"] = [
        f"{'PASS' if total >= 1.8 else 'FAIL'} measured speed-up of all three levels >= 1.8x: {total:.2f}x",
        *[level_check(a, b) for a, b in zip(rows, rows[1:])],
        f"{'PASS' if set(made.values()) == {groups} else 'FAIL'} the ISF rows trained the {groups} groups the "
        f"bench counted: " + ", ".join(f"{n} {g}" for n, g in made.items()),
        f"{'PASS' if out['same_tokens_seen'] else 'FAIL'} every row saw the same tokens: "
        f"{sorted(seen)} (dataset {int(data.tokens.sum())})",
        f"{'PASS' if max(peaks.values()) <= budget else 'FAIL'} every row's measured peak (static + activations) "
        f"<= budget {budget / 2**20:.2f} MiB: " + ", ".join(f"{n} {v / 2**20:.2f}" for n, v in peaks.items()),
    ]
    return out


def format_rows(res: dict) -> str:
    cols = [("row", "name", ""), ("ms/iter", "ms_per_iter", ".0f"), ("pred ms/it", "predicted_ms_per_iter", ".0f"),
            ("samples/s", "samples_per_s", ".2f"), ("tokens/s", "tokens_per_s", ".0f"), ("speed-up", "speedup", ".2f"),
            ("pred sp-up", "predicted_speedup", ".2f"), ("pad", "pad_ratio", ".3f"), ("dist llm", "dist_ratio_llm", ".3f"),
            ("dist vit", "dist_ratio_vit", ".3f"), ("iters", "iterations", "d"), ("tokens seen", "tokens_seen", "d")]
    lines = [f"PP={res['pp']} TP={res['tp']} DP={res['dp']}, {res['micro_batches']} micro-batches x K={res['micro_batch_size']}, "
             f"one epoch of {res['samples']} samples ({res['isf_groups']} ISF groups); budget "
             f"{res['budget_bytes'] / 2**20:.2f} MiB ({res['budget_note']})", bl.format_table(res["rows"], cols), ""]
    for r in res["rows"]:
        lines.append(f"{r['name']:<9} layout {r['layout']:<16} recompute {r['recompute']:<10} peak act MiB "
                     f"{bl.mib(r['peak_act_bytes_per_stage'])} static {bl.mib(r['static_bytes_per_stage'])}")
    ref = res["budget_reference"]
    lines.append(f"budget reference, baseline without recompute: {ref['ms_per_iter']:.0f} ms/iter, "
                 f"{ref['samples_per_s']:.2f} samples/s, peak MiB {bl.mib(ref['total_bytes_per_stage'])} (over budget)")
    lines += res["targets"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="internvl",
                    help="internvl: the heterogeneous tiny InternVL-style VLM; qwen2.5-vl: qwen2.5-vl-tiny; "
                         "qwen3-vl: qwen3-vl-tiny; qwen3.5: qwen3.5-tiny")
    ap.add_argument("--videos", action="store_true",
                    help="qwen2.5-vl: train on a mix of H.264 videos (PyAV, 1-8 s, 6-30 fps) and images")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--out", default="bench_out/e2e", help="folder for runs, JSON and the PNG chart")
    ap.add_argument("--quick", action="store_true", help="tiny epoch (16 samples, 2 micro-batches): a smoke test")
    ap.add_argument("--samples", type=int, default=512, help="at least this many samples in the epoch")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per iteration (m)")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="K: samples per random micro-batch, ISF target")
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the steady state")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each row, alternating (--quick: 1)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (one core per process!)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--seed", type=int, default=1234, help="trainer seed (batching, ISF)")
    ap.add_argument("--data-seed", type=int, default=0, help="which stats records the dataset draws")
    ap.add_argument("--stats-dir", default=None)
    args = ap.parse_args(argv)
    if args.quick:  # a smoke test: one run per row unless --repeats says otherwise
        args.samples, args.micro_batches, args.warmup = 16, 2, 1
        if "--repeats" not in (argv if argv is not None else sys.argv[1:]):
            args.repeats = 1
    if args.videos and args.model != "qwen2.5-vl":
        ap.error(f"--videos is implemented for --model qwen2.5-vl only, got {args.model}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    res = run(args)
    print(format_rows(res))
    bl.write_json(os.path.join(args.out, "e2e.json"), res)
    if args.json:
        bl.write_json(args.json, res)
    png = plot(res["rows"], os.path.join(args.out, "e2e.png"),
               f"{MODELS[args.model].title}, CPU PP={res['pp']} DP={res['dp']}, one epoch of {res['samples']} samples")
    print(f"wrote {os.path.join(args.out, 'e2e.json')} and {png}")
    return res


if __name__ == "__main__":
    main()
