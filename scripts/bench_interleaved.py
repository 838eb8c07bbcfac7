#!/usr/bin/env python
"""Interleaved (virtual) pipeline against the plain pipeline on CPU: measured and predicted side by side.

The fixed heterogeneous tiny VLM of scripts/benchlib.py (ViT 6 x 192 wide, LLM 6 x 64 wide), PP=2 x DP=1 on
the stats-matched synthetic data with ISF packing (one packed group per micro-batch, a steady shape that
matches the profile's), m micro-batches per iteration.  Two variants, each balanced by the same partition
search on the same unit profile (``--omnibal-partition auto``; the first run profiles the units and writes
the profile, every other run reads it):

* plain:        V = 1, the searched split of the units into 2 stages (1F1B);
* interleaved:  V = 2, the searched split into 2 x 2 virtual stages (rank r runs stages r and r + 2,
                megatron-core's interleaved 1F1B).

Runs alternate (plain, interleaved, plain, ...) so that the shared machine's load hits both alike; measured
ms/iteration is the median of the steady iterations pooled over the repeats.  Predicted: the simulator
(``omnibal_ext.model.simulate.simulate_layout``: 1F1B, or the interleaved schedule for a V x PP layout) with
the profile's unit costs.  The table goes into README Results.

Usage: python scripts/bench_interleaved.py [--json OUT] [--iters 12 --warmup 3 --repeats 2 --micro-batches 8]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402  (puts the repository on the path)

VARIANTS = (("plain", 1), ("interleaved", 2))


def measure(args) -> dict:
    from omnibal_ext.model.cost_model import get_device
    from omnibal_ext.model.costs import CostTable
    from omnibal_ext.model.layout import parse_layout
    from omnibal_ext.model.simulate import simulate_layout
    from omnibal_ext.model.units import build_units

    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    spec = bl.hetero_spec()
    data = bl.build_data(os.path.join(work, "data"), args.samples, spec.vision.image_size, spec.tokens_per_tile)
    pp, k, m = 2, args.micro_batch_size, args.micro_batches
    profile = os.path.join(work, "interleaved_profile.json")
    if os.path.exists(profile):
        os.remove(profile)  # profiled on this machine, in this run
    common = bl.trainer_argv({**bl.HETERO_MODEL, "--pipeline-model-parallel-size": pp, "--data-path": data.meta,
                              "--seq-length": data.seq_length, "--micro-batch-size": k, "--global-batch-size": k * m,
                              "--train-iters": args.iters, "--omnibal-isf": True, "--seed": 1234,
                              "--lr-warmup-iters": 1, "--omnibal-partition": "auto", "--omnibal-profile": profile})
    flags = {name: common + ["--virtual-pipeline-model-parallel-size", str(v)] for name, v in VARIANTS}
    runs = bl.alternate_runs(flags, args.repeats, work, "interleaved", pp, args.warmup)
    costs = CostTable.load(profile)
    units = build_units(spec)
    p2p = get_device("cpu").p2p_bytes_per_s
    out = {"model": dict(bl.HETERO_MODEL), "pp": pp, "micro_batches": m, "micro_batch_size": k,
           "iterations": args.iters, "warmup": args.warmup, "repeats": args.repeats,
           "data": {"samples": data.num_samples, **data.info}, "profile": profile,
           "note": "ms per iteration: median of the steady iterations pooled over the repeats; predicted: the "
                   "simulator (1F1B or interleaved 1F1B) with the profile's unit costs"}
    for name, v in VARIANTS:
        layout = parse_layout(runs[name][0].layout_flag, spec, pp, vpp=v)
        sim = simulate_layout(costs, layout, pp, m, p2p)
        out[name] = {"vpp": v, "layout": layout.to_flag(units), "stage_units": list(layout.stage_units),
                     "ms_per_iter": bl.pooled_ms(runs[name], args.warmup),
                     "ms_per_iter_runs": [bl.steady_ms(r.records, args.warmup) for r in runs[name]],
                     "losses": [r["lm loss"] for r in runs[name][0].records],
                     "predicted_ms_per_iter": sim.iteration_s * 1e3, "predicted_bubble": sim.bubble_fraction}
    meas = out["plain"]["ms_per_iter"] / out["interleaved"]["ms_per_iter"]
    pred = out["plain"]["predicted_ms_per_iter"] / out["interleaved"]["predicted_ms_per_iter"]
    out["measured_speedup"], out["predicted_speedup"] = meas, pred
    out["prediction_error"] = abs(pred - meas) / meas
    return out


def format_table(res: dict) -> str:
    lines = ["| variant | layout | ms/iteration measured | predicted | predicted bubble | speed-up measured | predicted |",
             "|---|---|---|---|---|---|---|"]
    for name, _ in VARIANTS:
        r = res[name]
        base = res["plain"]
        lines.append(f"| {name} (V={r['vpp']}) | `{r['layout'].replace('|', chr(92) + '|')}` | {r['ms_per_iter']:.1f} | "
                     f"{r['predicted_ms_per_iter']:.1f} | {r['predicted_bubble']:.1%} | "
                     f"{base['ms_per_iter'] / r['ms_per_iter']:.3f}x | "
                     f"{base['predicted_ms_per_iter'] / r['predicted_ms_per_iter']:.3f}x |")
    lines.append(f"\nPP={res['pp']}, {res['micro_batches']} micro-batches (ISF), {res['iterations']} iterations x "
                 f"{res['repeats']} repeats; prediction error of the speed-up {res['prediction_error']:.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--iters", type=int, default=12, help="training iterations per run")
    ap.add_argument("--warmup", type=int, default=3, help="iterations left out of the median")
    ap.add_argument("--repeats", type=int, default=2, help="alternating (plain, interleaved) pairs of runs")
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches per iteration (a multiple of PP)")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="target samples per ISF group")
    ap.add_argument("--samples", type=int, default=1024, help="samples of the stats-matched dataset")
    ap.add_argument("--workdir", default="bench_out/interleaved", help="runs, logs, data and the profile")
    args = ap.parse_args(argv)
    res = measure(args)
    print(format_table(res))
    if args.json:
        bl.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
