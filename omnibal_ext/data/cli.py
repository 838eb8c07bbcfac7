"""``omnibal isf stats|search|pack``: the data level from the command line.

* ``stats``  summary of the stats files (samples, tiles, tokens per file);
* ``search`` choose ISF thresholds, group, assemble balanced steps, print random vs ISF metrics,
  write JSON (``--json``) and a plot (``--plot``);
* ``pack``   the same, then write the groups and their balanced order for the trainer
  (``--out FILE.json`` or ``FILE.npz``; read with ``omnibal_ext.data.assign.load_pack``).

JSON contract of ``search`` (keys kept stable): samples_in, samples_out, groups, seconds
(search + grouping, seconds), seconds_search, seconds_group, params {qv, qt, qv_min, qt_min, iters,
oversize}, isf and random {pad_ratio, dist_ratio_llm, dist_ratio_vit, fill_llm, fill_vit,
samples_per_group}, report (ISF counts), search (candidates tried), config, files.

ISF in time (``--model NAME``, native resolution): the samples' ViT work is counted in the model family's unit
(patches at native resolution: the stats must list each sample's images) and groups are balanced in the time the cost
model predicts (``--device``), ``data/search_time.py``; the JSON's ``params`` then hold the time caps too, and
``isf`` and ``random`` add the time metrics (dist_ratio_vit_time, dist_ratio_llm_time, dist_ratio_time); ``bound``
names the sample (a long video) whose own time exceeds a rank's mean step load and so bounds its step's balance
(``search_time.sample_bound``; null when none does).

Inputs: ``--stats FILE...``.  ``add_isf_parser(subparsers, stats_loader=...)`` lets the caller
accept other inputs (e.g. a meta JSON): the loader gets the parsed args and returns SampleStats.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Callable

import numpy as np

from ..errors import UserError, report
from ..model.cost_model import get_device
from ..model.sample_time import TIME_UNIT_S, sample_time_units
from ..model.units import family_of, get_preset
from .assign import make_pack, save_pack
from .isf import OVERSIZE_POLICIES, ISFParams
from .search import (IsfResult, SearchConfig, params_summary, random_baseline, random_group_totals, run_isf,
                     run_isf_by_source, step_matrix_epoch0)
from .search_time import random_baseline_time, run_isf_in_time, sample_bound
from .stats import SampleStats, StatsError, load_stats, resample

METRIC_KEYS = ("pad_ratio", "dist_ratio_llm", "dist_ratio_vit", "fill_llm", "fill_vit", "samples_per_group")
TIME_KEYS = ("dist_ratio_vit_time", "dist_ratio_llm_time", "dist_ratio_time")

StatsLoader = Callable[[argparse.Namespace], SampleStats]


def default_stats_loader(args: argparse.Namespace) -> SampleStats:
    if not args.stats:
        raise StatsError("no stats files: pass --stats FILE...")
    return load_stats(args.stats)


def _add_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stats", nargs="+", metavar="FILE", default=[],
                   help="per-sample stats JSON files (lists of {vit_num, token_num}); concatenated in order")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=int, default=8, help="data-parallel size N (default 8)")
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel packs per DP rank (default 1)")
    p.add_argument("--samples-per-group", type=float, default=None, metavar="K",
                   help="target samples per group (default 4 unless --max-seq-len)")
    p.add_argument("--max-seq-len", type=int, default=None, help="fixed token cap Qt per group (tokens)")
    p.add_argument("--vit-cap", type=int, default=None, help="most ViT tiles per group")
    p.add_argument("--min-fill", type=float, default=0.95, help="token fill the search must reach")
    p.add_argument("--iters", type=int, default=20, help="ISF passes T (the search also tries T/2, 2T)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--oversize", choices=OVERSIZE_POLICIES, default="error",
                   help="samples over a cap: error (default), solo (own group), truncate (cut to the caps)")
    p.add_argument("--per-source", action="store_true",
                   help="multi-group mode: thresholds per stats file, groups merged")
    p.add_argument("--max-candidates", type=int, default=20)
    p.add_argument("--search-samples", type=int, default=40_000, help="subset size the search runs on")
    p.add_argument("--time-budget", type=float, default=3.0, help="search CPU-time cap, seconds")
    for name in ("qt", "qv", "qt-min", "qv-min"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help="fixed threshold (give all four to skip the search)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="ISF in predicted time for this model preset (its family's ViT items: patches at "
                        "native resolution), thresholds searched")
    p.add_argument("--device", default="h200-141g", help="cost-model device of --model (default h200-141g)")


def add_isf_parser(subparsers, stats_loader: StatsLoader | None = None) -> argparse.ArgumentParser:
    """Add ``isf`` with sub-commands ``stats``, ``search`` and ``pack`` to an argparse subparsers."""
    loader = stats_loader or default_stats_loader
    isf = subparsers.add_parser("isf", help="data balancing: ISF grouping and balanced DP steps")
    sub = isf.add_subparsers(dest="isf_command", required=True)
    p = sub.add_parser("stats", help="summarise stats files")
    _add_inputs(p)
    p.set_defaults(func=_guarded(cmd_stats, loader))
    p = sub.add_parser("search", help="choose ISF thresholds; random vs ISF metrics")
    _add_inputs(p)
    _add_plan_args(p)
    p.add_argument("--resample", type=int, default=None, metavar="M",
                   help="resample the stats to M samples first (benchmarking, e.g. 1200000)")
    p.add_argument("--plot", metavar="PNG", help="plot per-step LLM tokens and ViT tiles across DP ranks")
    p.set_defaults(func=_guarded(cmd_search, loader))
    p = sub.add_parser("pack", help="write groups and their balanced step order for the trainer")
    _add_inputs(p)
    _add_plan_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="pack file, .json or .npz")
    p.set_defaults(func=_guarded(cmd_pack, loader))
    return isf


# ---------------------------------------------------------------------------------------------
def _config(args) -> SearchConfig:
    k = args.samples_per_group
    if k is None and args.max_seq_len is None:
        k = 4.0
    return SearchConfig(dp_size=args.dp, samples_per_group=k, max_seq_len=args.max_seq_len,
                        vit_cap=args.vit_cap, sp=args.sp, min_fill=args.min_fill, iters=args.iters,
                        max_candidates=args.max_candidates, time_budget_s=args.time_budget,
                        search_samples=args.search_samples, oversize=args.oversize, seed=args.seed)


def _fixed_params(args) -> ISFParams | None:
    vals = [args.qt, args.qv, args.qt_min, args.qv_min]
    if all(v is None for v in vals):
        return None
    if any(v is None for v in vals):
        raise UserError("omnibal isf: give all of --qt --qv --qt-min --qv-min, or none (search)")
    return ISFParams(qv=args.qv, qt=args.qt, qv_min=args.qv_min, qt_min=args.qt_min, iters=args.iters,
                     oversize=args.oversize)


def _times(args, stats: SampleStats):
    """(ViT items per sample, (ViT, LLM) predicted time units per sample) of ``--model``, or None without it."""
    if args.model is None:
        return None

    if args.per_source or _fixed_params(args) is not None:
        raise UserError("omnibal isf: --model (ISF in time) searches its thresholds over all files: no --per-source, "
                        "no fixed --qt/--qv")
    spec = get_preset(args.model)
    items = stats.vision_items(family_of(spec).vision_item)
    return items, sample_time_units(stats, spec, get_device(args.device))


def _plan(args, stats: SampleStats, timed=None) -> tuple[IsfResult, SearchConfig]:
    """The data plan of ``args``; ``timed``: ``_times``'s result (ISF in time)."""
    cfg = _config(args)
    if timed is not None:
        if cfg.samples_per_group is None:
            raise UserError("omnibal isf: --model (ISF in time) needs --samples-per-group K")
        return run_isf_in_time(timed[0], stats.tokens, timed[1], cfg), cfg
    fixed = _fixed_params(args)
    if args.per_source:
        per = None if fixed is None else {i: fixed for i in range(len(stats.files))}
        return run_isf_by_source(stats.vit, stats.tokens, stats.source, cfg, per), cfg
    return run_isf(stats.vit, stats.tokens, cfg, fixed), cfg


def _result_json(plan: IsfResult, cfg: SearchConfig, stats: SampleStats, random: dict) -> dict:
    g = plan.grouping
    search = plan.search.to_dict() if hasattr(plan.search, "to_dict") else plan.search
    return {
        "samples_in": int(len(stats)),
        "samples_out": int(len(g.members)),
        "groups": int(len(g)),
        "seconds": plan.seconds_search + plan.seconds_group,
        "seconds_search": plan.seconds_search,
        "seconds_group": plan.seconds_group,
        "params": params_summary(plan.params),
        "isf": {k: plan.metrics[k] for k in METRIC_KEYS},
        "random": {k: random[k] for k in METRIC_KEYS},
        "report": g.report,
        "assembly": {"key": list(plan.assembly.key), "width": plan.assembly.width,
                     "full_steps": plan.assembly.num_full_steps},
        "search": search,
        "config": asdict(cfg),
        "files": list(stats.files),
    }


def format_table(rows: dict[str, dict], keys=METRIC_KEYS) -> str:
    """A plain-text table: one row per batching, one column per metric (``keys``)."""
    head = f"{'batching':<10}" + "".join(f"{k:>21}" if len(k) > 18 else f"{k:>19}" for k in keys)
    lines = [head, "-" * len(head)]
    for name, m in rows.items():
        lines.append(f"{name:<10}" + "".join(f"{m[k]:>21.4f}" if len(k) > 18 else f"{m[k]:>19.4f}" for k in keys))
    return "\n".join(lines)


def _write_json(path: str | None, doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=_json_default)


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def plot_steps(path: str, stats: SampleStats, plan: IsfResult, cfg: SearchConfig, k: float,
               num_steps: int = 64) -> None:
    """PNG of per-step totals per DP rank (LLM tokens, ViT tiles), random batching vs ISF."""
    import matplotlib  # a slow import: only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gt, gv, _, _ = random_group_totals(stats.vit, stats.tokens, k, cfg.seed)
    rnd = step_matrix_epoch0(len(gt), cfg.dp_size, None, cfg.seed)[:num_steps]
    g = plan.grouping
    isf = step_matrix_epoch0(len(g), plan.assembly.width, plan.assembly.order, cfg.seed)[:num_steps]
    fig, axes = plt.subplots(2, 2, figsize=(12, 6), sharex=True, sharey="row")
    for col, (name, steps, tok, til) in enumerate(
            (("random batching", rnd, gt, gv), ("ISF + balanced steps", isf, g.tokens, g.tiles))):
        for row, (label, vals) in enumerate((("LLM tokens per rank", tok[steps]), ("ViT tiles per rank", til[steps]))):
            ax = axes[row, col]
            x = np.arange(len(vals))
            for r in range(vals.shape[1]):
                ax.plot(x, vals[:, r], lw=0.6, alpha=0.6)
            ax.fill_between(x, vals.min(axis=1), vals.max(axis=1), alpha=0.15, color="k")
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(name)
            if row == 1:
                ax.set_xlabel("step")
    fig.suptitle(f"per-step load of {cfg.dp_size} DP ranks (first {num_steps} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
def cmd_stats(args, loader: StatsLoader) -> int:
    stats = loader(args)
    summary = stats.summary()
    print(f"{'file':<60}{'samples':>10}{'tiles mean':>12}{'tiles max':>10}{'tokens mean':>13}{'tokens max':>11}")
    for name, d in list(summary["files"].items()) + [("(all)", summary["all"])]:
        if d["samples"] == 0:
            print(f"{name[-60:]:<60}{0:>10}")
            continue
        print(f"{name[-60:]:<60}{d['samples']:>10}{d['tiles_mean']:>12.2f}{d['tiles_max']:>10}"
              f"{d['tokens_mean']:>13.1f}{d['tokens_max']:>11}")
    _write_json(args.json, summary)
    return 0


def cmd_search(args, loader: StatsLoader) -> int:
    stats = loader(args)
    if args.resample:
        stats = resample(stats, args.resample, args.seed)
    timed = _times(args, stats)
    plan, cfg = _plan(args, stats, timed)
    k = cfg.samples_per_group or plan.metrics["samples_per_group"]
    if timed is None:
        random = random_baseline(stats.vit, stats.tokens, cfg.dp_size * cfg.sp, k, cfg.seed)
    else:
        random = random_baseline_time(timed[0], stats.tokens, timed[1], cfg.dp_size * cfg.sp, k, cfg.seed)
    doc = _result_json(plan, cfg, stats, random)
    print(format_table({"random": random, "isf": plan.metrics}))
    if timed is not None:
        doc["isf"].update({k: plan.metrics[k] for k in TIME_KEYS})
        doc["random"].update({k: random[k] for k in TIME_KEYS})
        print(format_table({"random": random, "isf": plan.metrics}, TIME_KEYS))
        doc["bound"] = sample_bound(timed[1], plan.grouping, cfg.dp_size * cfg.sp)
        if doc["bound"] is not None:
            print(bound_line(doc["bound"], f"sample {doc['bound']['sample']}"))
    p = doc["params"]
    print(f"params: qt={p['qt']} qv={p['qv']} qt_min={p['qt_min']} qv_min={p['qv_min']} iters={p['iters']}; "
          f"{doc['groups']} groups of {doc['samples_in']} samples "
          f"({g_left(plan)} leftover groups); search {plan.seconds_search:.2f} s, "
          f"grouping {plan.seconds_group:.2f} s")
    _write_json(args.json, doc)
    if args.plot:
        plot_steps(args.plot, stats, plan, cfg, k)
    return 0


def bound_line(bound: dict, where: str) -> str:
    """The line that reports the sample setting the step bound (``search_time.sample_bound``); ``where`` names it."""

    ms = TIME_UNIT_S * 1e3
    return (f"bound: {where} takes {bound['time'] * ms:.1f} ms predicted, {bound['ratio']:.2f} x a rank's "
            f"mean step load ({bound['mean_rank_load'] * ms:.1f} ms): it sets the bound, its step's time "
            f"dist ratio >= {bound['step_dist_ratio_bound']:.4f}")


def g_left(plan: IsfResult) -> int:
    return int(plan.grouping.report.get("leftover_groups", 0))


def cmd_pack(args, loader: StatsLoader) -> int:
    stats = loader(args)
    plan, cfg = _plan(args, stats, _times(args, stats))
    meta = {"files": list(stats.files), "num_samples": int(len(stats)), "dp_size": cfg.dp_size, "sp": cfg.sp,
            "seed": cfg.seed, "params": params_summary(plan.params), "metrics": plan.metrics,
            "report": plan.grouping.report}
    save_pack(make_pack(plan.grouping, plan.assembly, meta), args.out)
    print(format_table({"isf": plan.metrics}))
    print(f"wrote {len(plan.grouping)} groups of {len(stats)} samples to {args.out}")
    _write_json(args.json, json.loads(json.dumps(meta, default=_json_default)))
    return 0


def _guarded(cmd, loader: StatsLoader):
    """``args.func`` for a sub-command: bad input becomes a one-line error and exit status 1."""

    def func(args: argparse.Namespace) -> int:
        try:
            return int(cmd(args, loader) or 0)
        except UserError as e:  # StatsError, OversizeError, ...
            return report(e, f"omnibal isf {args.isf_command}: ")

    return func
