#!/usr/bin/env python
"""`omnibal plan` for the newer families: qwen3-vl-8b, qwen3-vl-32b and internvl3.5-38b on 64 and 128 GPUs, TP, PP,
DP and V chosen, with the DeepStack features' bytes in the partition search, the simulator and the memory model.

Each row is ``omnibal_ext.plan.make_plan`` under ``scripts/reproduce_paper.py``'s assumptions (80 GB A100s, 10%
of memory kept out of the budget, bf16 + Adam with the distributed optimizer, global batch 512 samples, K = 4
samples per micro-batch, FlashAttention, the published ai2d/chartqa/docvqa stats resampled to 1.2M samples, V up to
2).  Data per family:

* Qwen3-VL (native resolution): the published stats with one image per sample whose size is drawn to give its
  InternVL tile count (``omnibal_ext.data.native.derive_native_stats``), resized as Qwen3-VL's processor resizes it
  (16 px patches, 2 x 2 merged, the published folders' pixel budget:
  ``megatron.vlm.lineages.qwen.qwen3_vit.image_processing.PUBLISHED``); the planner groups in predicted time;
* InternVL3.5 (448 px tiles, 256 tokens each, as the stats count them): the published stats as they are.

Columns: the +memory plan's layout (``pp * V`` stages), its predicted iteration and the Megatron default's
(the whole ViT, projector and embedding on stage 0, LLM layers even; random padded batching, full recompute), the
speed-up in GPU-days of +data, +model and +memory over that default, the busiest GPU's peak, and the DeepStack
bytes the chosen layout sends with the hidden states at each boundary some feature crosses ("k>k+1": between layout
stages k and k + 1), per micro-batch and TP rank at the ISF caps (live features x the caps' merged image tokens x
LLM width x 2 bytes; "-": no feature crosses, or the model has none).

Usage::

    python scripts/bench_plan_families.py [--gpus 64 128] [--models ...] [--samples 1200000] [--json OUT]
        [--markdown OUT] | --tables-from JSON
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402  (puts the repository on the path)
from reproduce_paper import load_stats_dir, plan_of  # noqa: E402

from omnibal_ext.data.native import derive_native_stats  # noqa: E402
from omnibal_ext.data.stats import resample  # noqa: E402
from omnibal_ext.memory.memory_model import GIB  # noqa: E402
from omnibal_ext.model.units import family_of, get_preset  # noqa: E402

MODELS = ("qwen3-vl-8b", "qwen3-vl-32b", "internvl3.5-38b")
MIB = 2.0 ** 20


def native_stats(published, model: str, seed: int):
    """The published stats at native resolution for ``model``'s ViT (its patch and merge sizes, the published
    Qwen3-VL pixel budget), or as they are for a tiled family."""
    spec = get_preset(model)
    if family_of(spec).vision_item != "patch":
        return published
    from megatron.vlm.lineages.qwen.qwen3_vit.image_processing import PUBLISHED

    v = spec.vision
    return derive_native_stats(published, seed=seed, patch=v.patch_size, merge=v.spatial_merge_size,
                               min_pixels=PUBLISHED.min_pixels, max_pixels=PUBLISHED.max_pixels)


def plan_row(stats, model: str, gpus: int, args) -> dict:
    plan = plan_of(stats, model, gpus, args.gpu_memory, args.samples_per_group, args.global_batch_size,
                   args.samples, args.sim_iterations, args.isf_candidates, None, None, vpp=None, max_vpp=args.max_vpp)
    base, final = plan.row("baseline"), plan.row("+memory")
    sides = list(final.boundary_side_bytes)
    return {"model": model, "gpus": gpus, "tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "vpp": plan.vpp,
            "ep": plan.ep, "etp": plan.etp,
            "sequence_parallel": bool(plan.trainer_flags.get("--sequence-parallel")),
            "micro_batches": plan.num_microbatches, "layout": final.layout_flag, "recompute": final.recompute_flag,
            "iteration_s": final.iteration_s, "baseline_iteration_s": base.iteration_s,
            "baseline_layout": base.layout_flag, "baseline_fits": base.fits_memory,
            "peak_gib": max(final.stage_peak_bytes) / GIB, "gpu_days": final.gpu_days, "speedup": final.speedup,
            "speedups": {r.setting: r.speedup for r in plan.rows},
            "boundary_side_bytes": sides, "isf_caps": plan.shapes["isf_caps"], "isf_params": plan.isf["params"],
            "trainer_args": plan.trainer_args}


def side_cell(sides: list[float]) -> str:
    """The DeepStack MiB of each boundary some feature crosses, by layout stages ("0>1: 24.8"; "-" where none)."""
    if not any(sides):
        return "-"
    return ", ".join(f"{k}>{k + 1}: {b / MIB:.1f}" for k, b in enumerate(sides) if b)


COLUMNS = [("model", "model", ""), ("GPUs", "gpus", "d"), ("TP", "tp", "d"), ("PP", "pp", "d"), ("DP", "dp", "d"),
           ("V", "vpp", "d"), ("EP", "ep", "d"), ("ETP", "etp", "d"), ("step s", "iteration_s", ".2f"), ("default s", "baseline_iteration_s", ".2f"),
           ("+data", "+data", ".2f"), ("+model", "+model", ".2f"), ("+memory", "+memory", ".2f"),
           ("peak GiB", "peak_gib", ".1f"), ("DeepStack MiB per boundary", "sides", ""), ("layout (+memory)", "layout", "")]


def format_rows(rows: list[dict]) -> str:
    shown = [{**r, **r["speedups"], "sides": side_cell(r["boundary_side_bytes"])} for r in rows]
    return bl.format_table(shown, COLUMNS)


def markdown(rows: list[dict]) -> str:
    """The table for docs/results.md."""
    out = ["| model | GPUs | TP | PP | DP | V | EP x ETP | +memory layout | step s (default) | +data | +model | "
           "+memory | peak GiB | DeepStack MiB per boundary |", "|" + "---|" * 14]
    for r in rows:
        s = r["speedups"]
        out.append(f"| {r['model']} | {r['gpus']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['vpp']} | "
                   f"{r.get('ep', 1)} x {r.get('etp', 1)} | "
                   f"`{r['layout'].replace('|', chr(92) + '|')}` | {r['iteration_s']:.2f} "
                   f"({r['baseline_iteration_s']:.2f}) | {s['+data']:.2f}x | {s['+model']:.2f}x | "
                   f"{s['+memory']:.2f}x | {r['peak_gib']:.1f} | {side_cell(r['boundary_side_bytes'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 128])
    p.add_argument("--samples", type=int, default=1_200_000, help="resample the stats to this many samples")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    p.add_argument("--samples-per-group", type=int, default=bl.PAPER_SAMPLES_PER_GROUP, help="K (default 4)")
    p.add_argument("--global-batch-size", type=int, default=bl.PAPER_GLOBAL_BATCH, help="samples per iteration")
    p.add_argument("--sim-iterations", type=int, default=8, help="iterations simulated per setting")
    p.add_argument("--isf-candidates", type=int, default=20, help="ISF threshold candidates searched")
    p.add_argument("--max-vpp", type=int, default=2, metavar="V", help="largest V the planner tries (default 2)")
    p.add_argument("--stats-dir", type=Path, default=bl.STATS_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the rows and the assumptions here")
    p.add_argument("--markdown", default=None, metavar="OUT", help="write the table as markdown here")
    p.add_argument("--tables-from", default=None, metavar="JSON", help="print the tables of a saved --json run")
    args = p.parse_args(argv)
    if args.tables_from:
        rows = json.loads(Path(args.tables_from).read_text())["rows"]
        print(format_rows(rows))
        print(markdown(rows))
        return 0
    t0 = time.perf_counter()
    published = load_stats_dir(args.stats_dir)
    rows = []
    for model in args.models:
        stats = resample(native_stats(published, model, args.seed), args.samples, args.seed)
        for gpus in args.gpus:
            rows.append(plan_row(stats, model, gpus, args))
            print(f"> {model} on {gpus} GPUs planned ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(format_rows(rows))
    print(f"({time.perf_counter() - t0:.0f} s; step s: the +memory plan's predicted iteration, default s: the Megatron "
          "default's; speed-ups in GPU-days over the default; DeepStack MiB per boundary of the +memory layout, per "
          "micro-batch and TP rank at the ISF caps)")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows) + "\n")
    if args.json:
        bl.write_json(args.json, {"rows": rows, "samples": args.samples, "global_batch": args.global_batch_size,
                                  "gpu_memory_gib": args.gpu_memory, "samples_per_group": args.samples_per_group,
                                  "sim_iterations": args.sim_iterations, "max_vpp": args.max_vpp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
