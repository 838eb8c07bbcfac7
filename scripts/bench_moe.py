#!/usr/bin/env python
"""MoE load balancing on a tiny MoE VLM at EP2 on CPU: what each balancing method does to the expert load, the
iteration time and the loss.

The built-in ``tiny`` model with MoE decoder layers (every layer: 8 experts, top 2, expert FFN 64) trains on the
built-in digits dataset on 2 ranks at ``--expert-model-parallel-size 2`` (4 experts per rank, the dense part
data-parallel over both), random batching, the same seed and data for each of

==============  ========================================================================================
config          balancing
==============  ========================================================================================
aux_loss        softmax router, megatron-core's switch aux loss per micro-batch (``--moe-aux-loss-coeff``)
seq_aux_loss    softmax router, the sequence aux loss per packed sample (padding excluded)
none            softmax router, no balancing
bias            sigmoid router, aux-loss-free expert bias (DeepSeek-V3: ``--moe-router-enable-expert-bias``,
                ``--moe-router-bias-update-rate``), no aux loss
==============  ========================================================================================

Per config and iteration, from the trainer's JSON log: ``expert load imbalance`` (over the MoE layers, the largest
max / mean tokens per expert, every rank's tokens), ``ep load imbalance`` (the same over the 2 EP ranks' tokens),
the iteration time (ms) and the LM loss. The table (markdown, on stdout and in ``OUT/moe_balance.md``) gives the
imbalance over the first and the last iterations, the median iteration time after warm-up and the loss; the JSON
(``OUT/moe_balance.json``) holds every iteration's values; the plot (``OUT/moe_balance.png``) the imbalance and the
loss against the iteration.

    python scripts/bench_moe.py [--iters 40] [--out docs] [--work /tmp/bench_moe] [--aux-loss-coeff 0.01]
        [--bias-update-rate 0.01] [--configs aux_loss seq_aux_loss none bias]
    python scripts/bench_moe.py --quick --out /tmp/moe   # 2 iterations per config: a smoke run

About 3 minutes on 2 CPU cores with the defaults. The bias step is larger than DeepSeek-V3's 1e-3 so that the bias
moves the routing within a run of tens of iterations.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402  (puts the repository on the path)

CONFIGS = ("aux_loss", "seq_aux_loss", "none", "bias")
EP = 2
MODEL = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--moe-layer-freq", "1",
         "--expert-model-parallel-size", str(EP)]
WARMUP = 2  # iterations left out of the median time
FIRST, LAST = 5, 10  # iterations averaged at the start and the end


def config_flags(config: str, aux_loss_coeff: float, bias_update_rate: float) -> list[str]:
    """The balancing flags of ``config`` (one of CONFIGS)."""
    if config in ("aux_loss", "seq_aux_loss"):
        return ["--moe-router-load-balancing-type", config, "--moe-aux-loss-coeff", repr(aux_loss_coeff)]
    if config == "none":
        return ["--moe-router-load-balancing-type", "none"]
    if config == "bias":
        return ["--moe-router-load-balancing-type", "none", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", repr(bias_update_rate)]
    raise ValueError(f"unknown config {config!r}; one of {', '.join(CONFIGS)}")


def run_flags(config: str, iters: int, seed: int, work: Path, aux_loss_coeff: float, bias_update_rate: float) -> list:
    return ["--train-iters", str(iters), "--micro-batch-size", "2", "--global-batch-size", "8",
            "--lr-warmup-iters", "0", "--lr", "2e-3", "--log-interval", "1", "--seed", str(seed),
            "--eval-interval", "0", "--data-cache-dir", str(work / "data_cache"),
            *MODEL, *config_flags(config, aux_loss_coeff, bias_update_rate)]


def series(records: list[dict]) -> dict:
    """Per-iteration values of one run's training records."""
    return {"iteration": [r["iteration"] for r in records],
            "expert_load_imbalance": [r["expert load imbalance"] for r in records],
            "ep_load_imbalance": [r["ep load imbalance"] for r in records],
            "ms": [r[bl.ITER_KEY] for r in records],
            "lm_loss": [r["lm loss"] for r in records],
            "aux_loss": [r.get("moe aux loss") for r in records]}


def summary(config: str, s: dict, first: int = FIRST, last: int = LAST, warmup: int = WARMUP) -> dict:
    """The table row of one run's ``series``: imbalance means over the first ``first`` and last ``last`` iterations,
    the median ms per iteration after ``warmup``, the loss at the start and the end (means, same windows)."""
    def mean(key, window):
        values = s[key][:window] if window > 0 else s[key][window:]
        return float(np.mean(values))

    timed = s["ms"][warmup:] or s["ms"]
    return {"config": config, "router": "sigmoid" if config == "bias" else "softmax",
            "iterations": len(s["iteration"]),
            "imbalance_first": mean("expert_load_imbalance", first),
            "imbalance_last": mean("expert_load_imbalance", -last),
            "ep_imbalance_last": mean("ep_load_imbalance", -last),
            "ms_per_iteration": float(np.median(timed)),
            "loss_first": mean("lm_loss", first), "loss_last": mean("lm_loss", -last)}


def markdown(rows: list[dict], first: int = FIRST, last: int = LAST) -> str:
    head = ("| balancing | router | expert load imbalance, first {f} it. | last {l} it. | EP rank imbalance, last {l} "
            "it. | ms / iteration (median) | LM loss, first {f} it. | last {l} it. |").format(f=first, l=last)
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['config']} | {r['router']} | {r['imbalance_first']:.3f} | {r['imbalance_last']:.3f} | "
                     f"{r['ep_imbalance_last']:.3f} | {r['ms_per_iteration']:.0f} | {r['loss_first']:.3f} | "
                     f"{r['loss_last']:.3f} |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path) -> str:
    from omnibal_ext.plots import plot_curves

    return plot_curves([("expert load imbalance (max / mean)",
                         {c: (s["iteration"], s["expert_load_imbalance"]) for c, s in runs.items()}),
                        ("LM loss", {c: (s["iteration"], s["lm_loss"]) for c, s in runs.items()})],
                       str(path), xlabel="iteration",
                       title=f"tiny MoE VLM, 8 experts top-2, EP{EP} on CPU: balancing methods")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", type=Path, default=bl.ROOT / "docs")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_moe"), help="the runs' logs and data cache")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--aux-loss-coeff", type=float, default=0.01)
    ap.add_argument("--bias-update-rate", type=float, default=0.01)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="2 iterations per config (a smoke run)")
    args = ap.parse_args(argv)
    iters = 2 if args.quick else args.iters
    first, last, warmup = (1, 1, 0) if args.quick else (FIRST, LAST, WARMUP)
    runs, rows = {}, []
    for config in args.configs:
        flags = run_flags(config, iters, args.seed, args.work, args.aux_loss_coeff, args.bias_update_rate)
        result = bl.run_trainer(flags, args.work, f"moe_{config}", nproc=EP)
        runs[config] = series(result.records)
        rows.append(summary(config, runs[config], first, last, warmup))
        print(f"{config}: {iters} iterations in {result.wall_s:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, first, last)
    print(table)
    (args.out / "moe_balance.md").write_text(table + "\n")
    bl.write_json(args.out / "moe_balance.json",
                  {"model": "tiny + " + " ".join(MODEL), "iterations": iters, "seed": args.seed,
                   "aux_loss_coeff": args.aux_loss_coeff, "bias_update_rate": args.bias_update_rate,
                   "rows": rows, "series": runs})
    try:
        print("plot:", plot(runs, args.out / "moe_balance.png"))
    except ImportError as e:
        print(f"no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
